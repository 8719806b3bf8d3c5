//! Wire-level helpers of the SMTP side: capped line reading, path and header parsing.

use std::io;

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// Outcome of reading one line.
pub(super) enum LineRead {
    /// The peer closed the connection (possibly mid-line).
    Eof,
    /// A complete line, terminator included, was appended.
    Line,
    /// The line exceeded the cap; it was consumed but only partly appended.
    TooLong,
}

/// Appends bytes up to and including the next LF to `out`.
///
/// At most `cap` bytes of the line are appended; a longer line is still consumed
/// entirely and reported as [`LineRead::TooLong`].
pub(super) async fn read_line_capped<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    out: &mut Vec<u8>,
    cap: usize,
) -> io::Result<LineRead> {
    let mut taken = 0usize;
    let mut too_long = false;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(LineRead::Eof);
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let len = chunk.len();
        let room = cap.saturating_sub(taken);
        if len > room {
            too_long = true;
        }
        out.extend_from_slice(&chunk[..len.min(room)]);
        taken += len;
        reader.consume(len);
        if done {
            return Ok(if too_long {
                LineRead::TooLong
            } else {
                LineRead::Line
            });
        }
    }
}

/// Removes a trailing LF or CRLF.
pub(super) fn strip_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Parses `FROM:<addr> params` / `TO:<addr> params` (prefix case-insensitive).
///
/// Accepts an optional space after the colon and a bare address without brackets.
pub(super) fn parse_path(arg: &str, prefix: &str) -> Option<String> {
    let head = arg.get(..prefix.len())?;
    if !head.eq_ignore_ascii_case(prefix) {
        return None;
    }
    let rest = arg[prefix.len()..].trim_start();
    match rest.strip_prefix('<') {
        Some(inner) => inner.find('>').map(|end| inner[..end].to_owned()),
        None => rest.split_whitespace().next().map(str::to_owned),
    }
}

/// Converts bytes to a `String`, replacing invalid UTF-8 without copying valid input.
pub(super) fn into_lossy_string(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Returns the unfolded, trimmed value of the first header called `name`.
///
/// Header names compare case-insensitively; only the header section (up to the
/// first empty line) is searched.
pub(super) fn header_value(raw: &str, name: &str) -> Option<String> {
    let mut value: Option<String> = None;
    for line in raw.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)) {
        if line.is_empty() {
            break;
        }
        if line.starts_with([' ', '\t']) {
            if let Some(v) = value.as_mut() {
                v.push_str(line);
            }
            continue;
        }
        if value.is_some() {
            break;
        }
        if let Some((field, v)) = line.split_once(':') {
            if field.trim_end().eq_ignore_ascii_case(name) {
                value = Some(v.to_owned());
            }
        }
    }
    value.map(|v| v.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_value_unfolds_and_ignores_case() {
        let raw = "subject: Hello\r\n\tworld \r\nMESSAGE-ID:\r\n <a@b>\r\n\r\nSubject: body\r\n";
        assert_eq!(
            header_value(raw, "Subject").as_deref(),
            Some("Hello\tworld")
        );
        assert_eq!(header_value(raw, "Message-ID").as_deref(), Some("<a@b>"));
        assert_eq!(header_value(raw, "To"), None);
    }

    #[test]
    fn parse_path_variants() {
        assert_eq!(
            parse_path("FROM:<a@b> SIZE=1", "FROM:").as_deref(),
            Some("a@b")
        );
        assert_eq!(parse_path("from: <>", "FROM:").as_deref(), Some(""));
        assert_eq!(parse_path("to:c@d", "TO:").as_deref(), Some("c@d"));
        assert_eq!(parse_path("TO:<unterminated", "TO:"), None);
        assert_eq!(parse_path("FRO", "FROM:"), None);
        assert_eq!(parse_path("é:<x>", "TO:"), None);
    }
}
