//! An email with attachments as a stream of chunks, never whole in memory: the
//! message lettre formatted with a placeholder for each attachment's body (the
//! skeleton), and at each placeholder's place that attachment's bytes, read from
//! memory (inline) or from the spool (fetched), base64-encoded in 76-column lines
//! as they go.
//!
//! A chunk is at most [`CHUNK`] bytes, so a send holds one chunk (and the transport's
//! own buffer) whatever the attachment's size. The size of the whole is known before
//! the first byte: a relay's `SIZE` and a provider's limit are checked, and a
//! `Content-Length` given, before anything is sent.

use std::io;
use std::sync::Arc;

use base64::Engine as _;

/// The most one chunk holds: 862 lines of 76 base64 characters and their CRLFs.
pub(crate) const CHUNK: usize = LINES_PER_CHUNK * (LINE + 2);
/// Base64 characters per line (RFC 2045 §6.8).
const LINE: usize = 76;
/// Bytes one line encodes.
const LINE_BYTES: usize = LINE / 4 * 3;
/// Lines a chunk of an attachment holds.
const LINES_PER_CHUNK: usize = 862;

/// An attachment's bytes, checked against its size and SHA-256.
#[derive(Clone)]
pub(crate) enum Content {
    /// Inline in the job, decoded when it was read.
    Memory(Arc<[u8]>),
    /// Fetched into the spool.
    Spooled(Arc<super::fetch::Spooled>),
}

impl std::fmt::Debug for Content {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Content({} bytes)", self.len())
    }
}

impl Content {
    /// Its size in bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Self::Memory(bytes) => bytes.len() as u64,
            Self::Spooled(file) => file.len(),
        }
    }

    /// Fills all of `buf` from `offset`; the content ending first is an error (a
    /// spool file shorter than its size).
    pub(crate) fn read_all_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let n = self.read_at(offset + filled as u64, &mut buf[filled..])?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the spooled attachment is shorter than its size",
                ));
            }
            filled += n;
        }
        Ok(())
    }

    /// Fills `buf` from `offset` (short only at the end).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Memory(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let n = buf.len().min(bytes.len() - start);
                buf[..n].copy_from_slice(&bytes[start..start + n]);
                Ok(n)
            }
            Self::Spooled(file) => file.read_at(offset, buf),
        }
    }
}

/// How many bytes `n` bytes become in base64 lines of 76 characters, separated (not
/// ended) by CRLF: the skeleton's own CRLF follows the last line.
pub(crate) fn encoded_len(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    let chars = n.div_ceil(3) * 4;
    let lines = chars.div_ceil(LINE as u64);
    chars + 2 * (lines - 1)
}

/// The placeholder for piece `index` of a body under `nonce` (128 random bits, one per
/// body): where a streamed piece goes, an attachment's encoded bytes in the MIME or a
/// file (or the whole email) in a provider's JSON. Letters and digits only (base64's
/// alphabet, left alone by MIME and by JSON escaping), so no text holds it by chance;
/// the closing `Z` keeps one mark from being the start of another (`N1Z`, `N10Z`).
pub(crate) fn mark(nonce: &str, index: usize) -> String {
    format!("POSTIEPIECE{nonce}N{index}Z")
}

/// `text` cut at each of `marks`, each where it first occurs, the marks taken out: the
/// text before, between and after them in the order they occur, and which mark each
/// cut was. `None` if a mark is missing.
pub(crate) fn cut<'t>(text: &'t [u8], marks: &[String]) -> Option<(Vec<&'t [u8]>, Vec<usize>)> {
    let mut places = Vec::with_capacity(marks.len());
    for (index, mark) in marks.iter().enumerate() {
        let at = memchr::memmem::find(text, mark.as_bytes())?;
        places.push((at, mark.len(), index));
    }
    places.sort_unstable();
    let mut pieces = Vec::with_capacity(marks.len() + 1);
    let mut order = Vec::with_capacity(marks.len());
    let mut from = 0;
    for (at, len, index) in places {
        if at < from {
            return None;
        }
        pieces.push(&text[from..at]);
        order.push(index);
        from = at + len;
    }
    pieces.push(&text[from..]);
    Some((pieces, order))
}

/// Where an attachment's encoded bytes go in the skeleton.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Splice {
    /// Offset in the skeleton.
    pub(crate) at: usize,
    /// Which of the contents (in the job's order) goes there.
    pub(crate) index: usize,
}

/// The chunks of a skeleton spliced with its attachments, in order. Reading the spool
/// can fail (the disk): the error ends the stream, and the transport must then
/// abandon the message, never end it.
pub(crate) struct Chunks {
    skeleton: Arc<[u8]>,
    splices: Arc<[Splice]>,
    contents: Arc<[Content]>,
    /// The next splice.
    next: usize,
    /// Where the skeleton goes on from.
    from: usize,
    /// Within the splice being encoded: the next byte to read.
    reading: Option<u64>,
    raw: Vec<u8>,
}

impl Chunks {
    pub(crate) fn new(
        skeleton: Arc<[u8]>,
        splices: Arc<[Splice]>,
        contents: Arc<[Content]>,
    ) -> Self {
        Self {
            skeleton,
            splices,
            contents,
            next: 0,
            from: 0,
            reading: None,
            raw: Vec::new(),
        }
    }

    /// The next chunk of one attachment: up to [`LINES_PER_CHUNK`] lines, each but the
    /// attachment's first after a CRLF.
    fn encode(&mut self, offset: u64) -> io::Result<Vec<u8>> {
        let content = &self.contents[self.splices[self.next].index];
        let want = ((content.len() - offset) as usize).min(LINES_PER_CHUNK * LINE_BYTES);
        self.raw.resize(want, 0);
        content.read_all_at(offset, &mut self.raw)?;
        let mut out = Vec::with_capacity(CHUNK);
        let engine = base64::engine::general_purpose::STANDARD;
        let mut encoded = [0u8; LINE];
        for (i, line) in self.raw.chunks(LINE_BYTES).enumerate() {
            if offset > 0 || i > 0 {
                out.extend_from_slice(b"\r\n");
            }
            let n = engine
                .encode_slice(line, &mut encoded)
                .map_err(io::Error::other)?;
            out.extend_from_slice(&encoded[..n]);
        }
        let read = offset + want as u64;
        if read < content.len() {
            self.reading = Some(read);
        } else {
            self.reading = None;
            self.next += 1;
        }
        Ok(out)
    }
}

impl Iterator for Chunks {
    type Item = io::Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(offset) = self.reading {
            return Some(self.encode(offset));
        }
        let until = self
            .splices
            .get(self.next)
            .map_or(self.skeleton.len(), |splice| splice.at);
        if self.from < until {
            let end = until.min(self.from + CHUNK);
            let chunk = self.skeleton[self.from..end].to_vec();
            self.from = end;
            return Some(Ok(chunk));
        }
        if self.next < self.splices.len() {
            if self.contents[self.splices[self.next].index].len() == 0 {
                self.next += 1;
                return self.next();
            }
            return Some(self.encode(0));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(skeleton: &[u8], splices: &[Splice], contents: Vec<Content>) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in Chunks::new(skeleton.into(), splices.into(), contents.into()) {
            let chunk = chunk.unwrap();
            assert!(!chunk.is_empty() && chunk.len() <= CHUNK, "{}", chunk.len());
            out.extend_from_slice(&chunk);
        }
        out
    }

    /// The reference: base64 of the whole, cut into 76-column lines.
    fn lines(bytes: &[u8]) -> Vec<u8> {
        let text = base64::engine::general_purpose::STANDARD.encode(bytes);
        text.as_bytes()
            .chunks(LINE)
            .collect::<Vec<_>>()
            .join(&b"\r\n"[..])
    }

    #[test]
    fn spliced_attachments_are_base64_lines_in_their_places() {
        for size in [0usize, 1, 2, 3, 56, 57, 58, 114, 49_134, 49_135, 200_001] {
            let bytes: Vec<u8> = (0..size).map(|i| (i * 7 + i / 3) as u8).collect();
            let other = b"second file".to_vec();
            let skeleton = b"head\r\n\r\nA\r\n--b\r\n\r\nB\r\n--b--\r\n";
            // The second file in the job's order goes first.
            let splices = [Splice { at: 11, index: 1 }, Splice { at: 22, index: 0 }];
            let contents = vec![
                Content::Memory(other.clone().into()),
                Content::Memory(bytes.clone().into()),
            ];
            let mut expected = skeleton[..11].to_vec();
            expected.extend(lines(&bytes));
            expected.extend_from_slice(&skeleton[11..22]);
            expected.extend(lines(&other));
            expected.extend_from_slice(&skeleton[22..]);
            let got = whole(skeleton, &splices, contents);
            assert_eq!(got, expected, "size {size}");
            assert_eq!(
                encoded_len(size as u64),
                lines(&bytes).len() as u64,
                "size {size}"
            );
        }
    }

    #[test]
    fn marks_cut_where_they_occur_and_none_is_taken_for_another() {
        let marks: Vec<String> = (0..12).map(|i| mark("n", i)).collect();
        // Mark 10 first (an inline image before the attachments), then 1 .. 9, 11, 0.
        let mut order: Vec<usize> = vec![10];
        order.extend(1..10);
        order.extend([11, 0]);
        let mut text = String::new();
        for (i, index) in order.iter().enumerate() {
            text.push_str(&format!("<{i}>{}", marks[*index]));
        }
        text.push_str("<end>");
        let (pieces, found) = cut(text.as_bytes(), &marks).unwrap();
        assert_eq!(found, order);
        let pieces: Vec<&str> = pieces
            .iter()
            .map(|p| std::str::from_utf8(p).unwrap())
            .collect();
        let mut want: Vec<String> = (0..12).map(|i| format!("<{i}>")).collect();
        want.push("<end>".into());
        assert_eq!(pieces, want);
        assert!(cut(b"no marks here", &marks[..1]).is_none());
    }

    #[test]
    fn a_long_skeleton_comes_in_chunks_too() {
        let skeleton = vec![b'x'; CHUNK * 2 + 5];
        assert_eq!(whole(&skeleton, &[], vec![]), skeleton);
        assert_eq!(
            Chunks::new(skeleton.into(), Arc::new([]), Arc::new([])).count(),
            3
        );
    }
}
