//! A request body for an email with attachments, streamed: literal text (the JSON or
//! the form around the email) and, in between, the email's MIME (`stream.rs`'s
//! chunks) or one file's bytes, each as it is or base64-encoded in one line (as JSON
//! strings carry them). Its length is known before the first byte, so the request
//! has a `Content-Length`, and a provider's size limit is checked before sending.
//! The same pieces can be read twice: SES hashes the body for its signature first.

use std::io;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, StreamBody};
use sha2::{Digest, Sha256};

use super::HttpRequest;
use crate::mail::message::FileField;
use crate::mail::stream::{self, Content};
use crate::mail::{Email, SendError};

/// Raw bytes a chunk of a file holds (a multiple of 3: base64 without carry).
const FILE_CHUNK: usize = 48 * 1024;

/// What a piece is read from.
#[derive(Clone)]
enum Source {
    Text(Bytes),
    /// The email's MIME.
    Email(Email),
    /// One attachment's bytes.
    File(Content),
}

/// A streamed request body.
#[derive(Clone, Default)]
pub(crate) struct Payload {
    pieces: Vec<(Source, bool)>,
    /// Set when a read of the spool failed while the body was being sent: the request
    /// then broke off short of its `Content-Length`, so the provider took nothing.
    spool_failed: Arc<OnceLock<SendError>>,
}

/// A failed read of the spool: the instance's disk, not the job's fault, and nothing
/// was handed over (the job waits in the retry ladder, no attempt counted).
fn spool_failed(e: &io::Error) -> SendError {
    SendError::Unavailable(format!(
        "reading the spooled attachment: {e}; the request was abandoned before its end"
    ))
}

impl Payload {
    /// Literal text.
    pub(crate) fn text(mut self, text: impl Into<Bytes>) -> Self {
        self.pieces.push((Source::Text(text.into()), false));
        self
    }

    /// The email's MIME, base64-encoded in one line if `base64`.
    pub(crate) fn email(mut self, email: &Email, base64: bool) -> Self {
        self.pieces.push((Source::Email(email.clone()), base64));
        self
    }

    /// A file's bytes, base64-encoded in one line.
    pub(crate) fn file_base64(mut self, content: &Content) -> Self {
        self.pieces.push((Source::File(content.clone()), true));
        self
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.pieces
            .iter()
            .map(|(source, base64)| {
                let raw = match source {
                    Source::Text(text) => text.len() as u64,
                    Source::Email(email) => email.size(),
                    Source::File(content) => content.len(),
                };
                if *base64 {
                    raw.div_ceil(3) * 4
                } else {
                    raw
                }
            })
            .sum()
    }

    /// Its chunks, in order.
    fn chunks(self) -> impl Iterator<Item = io::Result<Bytes>> + Send + Sync + 'static {
        self.pieces.into_iter().flat_map(|(source, base64)| {
            let raw: Box<dyn Iterator<Item = io::Result<Bytes>> + Send + Sync> = match source {
                Source::Text(text) => Box::new(std::iter::once(Ok(text))),
                Source::Email(email) => Box::new(email.chunks().map(|c| c.map(Bytes::from))),
                Source::File(content) => Box::new(file_chunks(content)),
            };
            if base64 {
                Box::new(Base64::new(raw))
                    as Box<dyn Iterator<Item = io::Result<Bytes>> + Send + Sync>
            } else {
                raw
            }
        })
    }

    /// Its SHA-256, hex (a first pass over the pieces, for a signature).
    pub(crate) fn sha256_hex(&self) -> Result<String, SendError> {
        let mut hash = Sha256::new();
        for chunk in self.clone().chunks() {
            let chunk = chunk.map_err(|e| spool_failed(&e))?;
            hash.update(&chunk);
        }
        Ok(hex::encode(hash.finalize()))
    }

    /// Why the body broke off, if a read of the spool failed while it was sent
    /// ([`Payload::into_body`]).
    pub(crate) fn spool_failure(&self) -> Arc<OnceLock<SendError>> {
        self.spool_failed.clone()
    }

    /// The body hyper sends: the chunks as they are read. A read of the spool that
    /// fails ends it with the error, noted for [`Payload::spool_failure`].
    pub(crate) fn into_body(self) -> BoxBody<Bytes, io::Error> {
        let failed = self.spool_failed.clone();
        let frames = self.chunks().map(move |chunk| {
            chunk
                .inspect_err(|e| {
                    let _ = failed.set(spool_failed(e));
                })
                .map(http_body::Frame::data)
        });
        StreamBody::new(futures_util::stream::iter(frames)).boxed()
    }

    /// Refused before sending when over `limit` bytes (`what` names the provider's
    /// limit in the reason).
    pub(crate) fn within(self, limit: u64, what: &str) -> Result<Self, SendError> {
        let len = self.len();
        if len > limit {
            return Err(SendError::Permanent(format!(
                "the request is {len} bytes with its attachments, over {what} ({limit} bytes)"
            )));
        }
        Ok(self)
    }
}

/// A file's bytes in chunks of [`FILE_CHUNK`].
fn file_chunks(content: Content) -> impl Iterator<Item = io::Result<Bytes>> + Send + Sync {
    let len = content.len();
    (0..len.div_ceil(FILE_CHUNK as u64)).map(move |n| {
        let from = n * FILE_CHUNK as u64;
        let mut buf = vec![0u8; (len - from).min(FILE_CHUNK as u64) as usize];
        content.read_all_at(from, &mut buf)?;
        Ok(Bytes::from(buf))
    })
}

/// Base64 in one line over a stream of chunks: up to two bytes carried from one
/// chunk to the next, padding only at the end.
struct Base64<I> {
    inner: I,
    carry: Vec<u8>,
    done: bool,
}

impl<I> Base64<I> {
    fn new(inner: I) -> Self {
        Self {
            inner,
            carry: Vec::with_capacity(2),
            done: false,
        }
    }
}

impl<I: Iterator<Item = io::Result<Bytes>>> Iterator for Base64<I> {
    type Item = io::Result<Bytes>;

    fn next(&mut self) -> Option<Self::Item> {
        let engine = base64::engine::general_purpose::STANDARD;
        loop {
            if self.done {
                return None;
            }
            match self.inner.next() {
                Some(Ok(chunk)) => {
                    let mut raw = std::mem::take(&mut self.carry);
                    raw.extend_from_slice(&chunk);
                    let whole = raw.len() / 3 * 3;
                    self.carry = raw[whole..].to_vec();
                    if whole > 0 {
                        return Some(Ok(Bytes::from(engine.encode(&raw[..whole]))));
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None => {
                    self.done = true;
                    if self.carry.is_empty() {
                        return None;
                    }
                    return Some(Ok(Bytes::from(engine.encode(&self.carry))));
                }
            }
        }
    }
}

/// `value` serialised, cut at each of `marks` (string values standing for a streamed
/// piece, [`stream::mark`]): the text before the first, between, and after the last,
/// and which mark each cut was, as they occur. Each mark's quotes stay with the text
/// around it.
pub(crate) fn split_json(
    value: &serde_json::Value,
    marks: &[String],
) -> Result<(Vec<Bytes>, Vec<usize>), SendError> {
    let text = serde_json::to_vec(value)
        .map_err(|e| SendError::Permanent(format!("the request cannot be encoded: {e}")))?;
    let (pieces, order) = stream::cut(&text, marks)
        .ok_or_else(|| SendError::Permanent("the request lost a placeholder".into()))?;
    let pieces = pieces.into_iter().map(Bytes::copy_from_slice).collect();
    Ok((pieces, order))
}

/// `request` with `body` as its JSON: whole when the email has no files; else with
/// `body[list]` describing each file (`describe`: its fields, and a mark where its
/// base64 content goes), streamed (the JSON around each file, each file's bytes in
/// base64), refused when over `limit` (bytes, and how the reason names it).
pub(crate) fn json_with_files(
    request: HttpRequest,
    mut body: serde_json::Value,
    list: &str,
    email: &Email,
    describe: impl Fn(&FileField, &str) -> serde_json::Value,
    limit: (u64, &str),
) -> Result<HttpRequest, SendError> {
    let files = &super::fields(email)?.files;
    if files.is_empty() {
        return Ok(request.json(&body));
    }
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let marks: Vec<String> = (0..files.len()).map(|i| stream::mark(&nonce, i)).collect();
    let described: Vec<serde_json::Value> = files
        .iter()
        .zip(&marks)
        .map(|(file, mark)| describe(file, mark))
        .collect();
    body[list] = described.into();
    let (parts, order) = split_json(&body, &marks)?;
    let mut payload = Payload::default();
    for (text, index) in parts.iter().zip(order) {
        payload = payload
            .text(text.clone())
            .file_base64(&email.contents()[index]);
    }
    let payload = payload
        .text(parts[parts.len() - 1].clone())
        .within(limit.0, limit.1)?;
    Ok(request
        .header("content-type", "application/json")
        .streamed(payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(payload: Payload) -> Vec<u8> {
        payload.chunks().flat_map(|c| c.unwrap().to_vec()).collect()
    }

    #[test]
    fn files_in_base64_read_back_and_the_length_is_exact() {
        for size in [0usize, 1, 2, 3, 4, 49_151, 49_152, 49_153, 150_001] {
            let bytes: Vec<u8> = (0..size).map(|i| (i * 13 + 7) as u8).collect();
            let content = Content::Memory(bytes.clone().into());
            let payload = Payload::default()
                .text("{\"content\":\"")
                .file_base64(&content)
                .text("\"}");
            let got = read(payload.clone());
            let want = format!(
                "{{\"content\":\"{}\"}}",
                base64::engine::general_purpose::STANDARD.encode(&bytes)
            );
            assert_eq!(String::from_utf8(got).unwrap(), want, "size {size}");
            assert_eq!(payload.len(), want.len() as u64, "size {size}");
            assert_eq!(
                payload.sha256_hex().unwrap(),
                hex::encode(Sha256::digest(want.as_bytes()))
            );
        }
    }

    /// A spool that fails to read while the body is sent ends the body with the error
    /// and notes why for the transport: nothing handed over, not the job's fault.
    #[tokio::test]
    async fn a_spool_failing_mid_body_ends_it_and_is_noted_as_unavailable() {
        let file = tempfile::tempfile().unwrap();
        let spooled = crate::mail::fetch::Spooled::of_file(file, 100_000);
        let content = Content::Spooled(std::sync::Arc::new(spooled));
        let payload = Payload::default()
            .text("{\"content\":\"")
            .file_base64(&content)
            .text("\"}");
        assert!(
            matches!(payload.sha256_hex(), Err(SendError::Unavailable(_))),
            "the signature's pass fails as unavailable"
        );
        let failure = payload.spool_failure();
        assert!(failure.get().is_none());
        let body = payload.into_body();
        let collected = body.collect().await;
        assert!(collected.is_err(), "the body ends with the error");
        match failure.get() {
            Some(SendError::Unavailable(why)) => {
                assert!(why.contains("reading the spooled attachment"), "{why}")
            }
            other => panic!("noted {other:?}"),
        }
    }

    #[test]
    fn json_splits_at_its_marks() {
        let (a, b) = (stream::mark("n", 0), stream::mark("n", 1));
        let value = serde_json::json!({"x": [{"content": a}, {"content": b}], "y": "é\"q"});
        let (parts, order) = split_json(&value, &[a, b]).unwrap();
        assert_eq!((parts.len(), order), (3, vec![0, 1]));
        let parts: Vec<&str> = parts
            .iter()
            .map(|p| std::str::from_utf8(p).unwrap())
            .collect();
        let joined = parts.join("QQ");
        let back: serde_json::Value = serde_json::from_str(&joined).unwrap();
        assert_eq!(back["x"][1]["content"], "QQ");
        assert_eq!(back["y"], "é\"q");
        assert!(Payload::default()
            .text("abcd")
            .within(3, "a limit")
            .is_err());
    }
}
