//! `BDAT` (RFC 3030, CHUNKING): a message in chunks of a stated size, the last one
//! marked `LAST`. A chunk is read whatever the reply, since its size says where the
//! next command starts; only a syntax error, which leaves that unknown, closes the
//! session.

use std::io;

use tokio::io::AsyncReadExt;

use super::{Fault, Flow, Session};
use crate::faults::Stage;

/// A `BDAT` command's arguments: the chunk's size and whether it is the last.
fn parse(arg: &str) -> Option<(usize, bool)> {
    let mut words = arg.split_whitespace();
    let size = words.next()?.parse().ok()?;
    let last = match words.next() {
        None => false,
        Some(word) if word.eq_ignore_ascii_case("LAST") => true,
        Some(_) => return None,
    };
    words.next().is_none().then_some((size, last))
}

impl Session {
    /// `BDAT <size> [LAST]`: reads the chunk; after the last one, records the message.
    pub(super) async fn bdat(&mut self, arg: &str) -> io::Result<Flow> {
        let Some((size, last)) = parse(arg) else {
            self.reply("501 5.5.4 Syntax: BDAT <size> [LAST]").await?;
            return Ok(Flow::Close);
        };
        let refusal = match self.tx.as_ref() {
            _ if !self.state.chunking => Some("502 5.5.1 Error: command not implemented"),
            None => Some("503 5.5.1 Error: need MAIL command"),
            Some(tx) if tx.rcpts.is_empty() => Some("554 5.5.1 Error: no valid recipients"),
            Some(_) => None,
        };
        if let Some(reply) = refusal {
            if !self.discard(size).await? {
                return Ok(Flow::Close);
            }
            // The transaction (if any) has failed; the client must start over.
            self.tx = None;
            return self.answer(reply).await;
        }
        let first = self.tx.as_ref().is_some_and(|tx| tx.chunks.is_none());
        if first {
            match self.fault(Stage::Data, None).await? {
                Fault::Proceed => {}
                Fault::Replied => {
                    self.tx = None;
                    let kept = self.discard(size).await?;
                    return Ok(if kept { Flow::Continue } else { Flow::Close });
                }
                Fault::Dropped { .. } => return Ok(Flow::Close),
            }
        }
        if !self.take_chunk(size).await? {
            return Ok(Flow::Close);
        }
        if !last {
            return self.answer(&format!("250 2.0.0 Ok: {size} octets")).await;
        }
        let Some(tx) = self.tx.as_mut() else {
            return Ok(Flow::Close);
        };
        if tx.too_large {
            self.tx = None;
            let reply = "552 5.3.4 Error: message exceeds fixed maximum message size";
            return self.answer(reply).await;
        }
        let body = std::mem::take(tx.chunks.get_or_insert_with(Vec::new));
        self.finish_data(body).await
    }

    /// Appends a chunk of `size` octets to the transaction (or, past the largest
    /// message, reads and forgets it); false when the client closed before its end.
    async fn take_chunk(&mut self, size: usize) -> io::Result<bool> {
        let Some(tx) = self.tx.as_mut() else {
            return self.discard(size).await;
        };
        let chunks = tx.chunks.get_or_insert_with(Vec::new);
        if tx.too_large || chunks.len() + size > self.state.max_size {
            tx.too_large = true;
            *chunks = Vec::new();
            return self.discard(size).await;
        }
        let start = chunks.len();
        chunks.resize(start + size, 0);
        match self.reader.read_exact(&mut chunks[start..]).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reads and forgets `size` octets; false when the client closed before their end.
    async fn discard(&mut self, size: usize) -> io::Result<bool> {
        let mut chunk = (&mut self.reader).take(size as u64);
        let read = tokio::io::copy(&mut chunk, &mut tokio::io::sink()).await?;
        Ok(read == size as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn bdat_arguments() {
        assert_eq!(parse("42"), Some((42, false)));
        assert_eq!(parse("0 LAST"), Some((0, true)));
        assert_eq!(parse("7 last"), Some((7, true)));
        assert_eq!(parse(""), None);
        assert_eq!(parse("-1 LAST"), None);
        assert_eq!(parse("7 FIRST"), None);
        assert_eq!(parse("7 LAST more"), None);
    }
}
