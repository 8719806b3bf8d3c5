//! The SMTP side: the accept loop and one session per connection, which answers
//! commands, applies fault rules at each stage and records messages.

mod chunking;
mod wire;

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use crate::faults::{Action, Stage};
use crate::state::{AppState, MessageMeta};
use wire::{header_value, into_lossy_string, parse_path, read_line_capped, strip_eol, LineRead};

/// Largest accepted message, also advertised as `SIZE`, unless `--size` says otherwise.
pub(crate) const MAX_MESSAGE_SIZE: usize = 50 * 1024 * 1024;
/// Largest accepted command line, including CRLF.
const MAX_COMMAND_LINE: usize = 4096;
/// Line cap used while discarding the rest of an oversized message.
const DISCARD_LINE: usize = 1024;
/// Hostname used in the greeting and replies.
const HOSTNAME: &str = "postie-smtp-sink";

/// Accepts connections forever, one task per session.
pub(crate) async fn serve(listener: TcpListener, state: Arc<AppState>) -> anyhow::Result<()> {
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                state.counters.connections.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(Session::new(stream, Arc::clone(&state)).run());
            }
            Err(e) => {
                // Typically EMFILE; back off briefly instead of spinning or exiting.
                crate::warn(format_args!("accept failed: {e}"));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Whether the session continues after a command.
enum Flow {
    /// Read the next command.
    Continue,
    /// Close the connection.
    Close,
}

/// Result of applying the fault rules at one stage.
enum Fault {
    /// No rule fired, or a delay elapsed: do the normal thing.
    Proceed,
    /// A replacement reply was sent; the command failed.
    Replied,
    /// The connection must be closed without a reply.
    Dropped {
        /// Record the message before closing (`data_end` only).
        deliver: bool,
    },
}

/// Outcome of reading a message body after `DATA`.
enum Body {
    /// The peer closed the connection before the final dot.
    Eof,
    /// The message exceeded the advertised `SIZE`; it was read and discarded.
    TooLarge,
    /// The complete, dot-unstuffed message.
    Complete(Vec<u8>),
}

/// The mail transaction in progress.
#[derive(Debug, Default)]
struct Transaction {
    mail_from: String,
    rcpts: Vec<String>,
    /// The `BDAT` chunks so far, once the first has come.
    chunks: Option<Vec<u8>>,
    /// The chunks went past the advertised `SIZE` (and were discarded).
    too_large: bool,
}

/// One SMTP connection.
struct Session {
    reader: BufReader<OwnedReadHalf>,
    writer: BufWriter<OwnedWriteHalf>,
    state: Arc<AppState>,
    greeted: bool,
    tx: Option<Transaction>,
    line: Vec<u8>,
}

impl Session {
    /// Wraps an accepted stream.
    fn new(stream: TcpStream, state: Arc<AppState>) -> Self {
        // Small replies must not wait for Nagle; failure here is harmless.
        let _ = stream.set_nodelay(true);
        let (read, write) = stream.into_split();
        Self {
            reader: BufReader::with_capacity(64 * 1024, read),
            writer: BufWriter::with_capacity(16 * 1024, write),
            state,
            greeted: false,
            tx: None,
            line: Vec::with_capacity(256),
        }
    }

    /// Runs the session to completion; I/O errors simply end it.
    async fn run(mut self) {
        let _ = self.converse().await;
    }

    /// Greets, then answers commands until QUIT, EOF or a fault closes the session.
    async fn converse(&mut self) -> io::Result<()> {
        match self.fault(Stage::Connect, None).await? {
            Fault::Proceed => {}
            Fault::Replied | Fault::Dropped { .. } => return self.writer.flush().await,
        }
        self.reply(&format!("220 {HOSTNAME} ESMTP")).await?;
        self.writer.flush().await?;
        loop {
            self.line.clear();
            let read = read_line_capped(&mut self.reader, &mut self.line, MAX_COMMAND_LINE).await?;
            let flow = match read {
                LineRead::Eof => Flow::Close,
                LineRead::TooLong => {
                    self.reply("500 5.5.2 Error: line too long").await?;
                    Flow::Continue
                }
                LineRead::Line => self.command().await?,
            };
            // Pipelining: only flush once no further commands are already buffered.
            if matches!(flow, Flow::Close) || self.reader.buffer().is_empty() {
                self.writer.flush().await?;
            }
            if matches!(flow, Flow::Close) {
                return Ok(());
            }
        }
    }

    /// Dispatches the command line in `self.line`.
    async fn command(&mut self) -> io::Result<Flow> {
        let text = String::from_utf8_lossy(strip_eol(&self.line)).into_owned();
        let (verb, arg) = match text.split_once(' ') {
            Some((verb, arg)) => (verb, arg.trim()),
            None => (text.as_str(), ""),
        };
        match verb.to_ascii_uppercase().as_str() {
            "EHLO" => self.ehlo().await,
            "HELO" => self.helo().await,
            "MAIL" => self.mail(arg).await,
            "RCPT" => self.rcpt(arg).await,
            "DATA" => self.data().await,
            "BDAT" => self.bdat(arg).await,
            "RSET" => {
                self.tx = None;
                self.answer("250 2.0.0 Ok").await
            }
            "NOOP" => self.answer("250 2.0.0 Ok").await,
            "VRFY" => {
                let reply = "252 2.0.0 Cannot VRFY user, but will accept message";
                self.answer(reply).await
            }
            "QUIT" => {
                self.reply("221 2.0.0 Bye").await?;
                Ok(Flow::Close)
            }
            _ => self.answer("500 5.5.2 Error: command not recognized").await,
        }
    }

    /// Sends `line` and continues with the next command.
    async fn answer(&mut self, line: &str) -> io::Result<Flow> {
        self.reply(line).await?;
        Ok(Flow::Continue)
    }

    /// `EHLO`: multi-line reply advertising extensions; resets the transaction.
    async fn ehlo(&mut self) -> io::Result<Flow> {
        self.greeted = true;
        self.tx = None;
        let mut lines = vec![
            HOSTNAME.to_string(),
            format!("SIZE {}", self.state.max_size),
            "8BITMIME".into(),
        ];
        if self.state.pipelining {
            lines.push("PIPELINING".into());
        }
        if self.state.chunking {
            lines.push("CHUNKING".into());
        }
        let last = lines.len() - 1;
        let reply: Vec<String> = (lines.iter().enumerate())
            .map(|(i, line)| format!("250{}{line}", if i == last { ' ' } else { '-' }))
            .collect();
        self.reply(&reply.join("\r\n")).await?;
        Ok(Flow::Continue)
    }

    /// `HELO`: plain greeting; resets the transaction.
    async fn helo(&mut self) -> io::Result<Flow> {
        self.greeted = true;
        self.tx = None;
        self.answer(&format!("250 {HOSTNAME}")).await
    }

    /// `MAIL FROM:<addr> [params]`: starts a transaction.
    async fn mail(&mut self, arg: &str) -> io::Result<Flow> {
        if !self.greeted {
            return self.answer("503 5.5.1 Error: send HELO/EHLO first").await;
        }
        if self.tx.is_some() {
            return self.answer("503 5.5.1 Error: nested MAIL command").await;
        }
        let Some(from) = parse_path(arg, "FROM:") else {
            return self.answer("501 5.5.4 Syntax: MAIL FROM:<address>").await;
        };
        match self.fault(Stage::Mail, None).await? {
            Fault::Proceed => {}
            Fault::Replied => return Ok(Flow::Continue),
            Fault::Dropped { .. } => return Ok(Flow::Close),
        }
        self.tx = Some(Transaction {
            mail_from: from,
            ..Transaction::default()
        });
        self.answer("250 2.1.0 Ok").await
    }

    /// `RCPT TO:<addr> [params]`: adds a recipient.
    async fn rcpt(&mut self, arg: &str) -> io::Result<Flow> {
        if self.tx.is_none() {
            return self.answer("503 5.5.1 Error: need MAIL command").await;
        }
        let Some(to) = parse_path(arg, "TO:").filter(|to| !to.is_empty()) else {
            return self.answer("501 5.5.4 Syntax: RCPT TO:<address>").await;
        };
        match self.fault(Stage::Rcpt, Some(&to)).await? {
            Fault::Proceed => {}
            Fault::Replied => return Ok(Flow::Continue),
            Fault::Dropped { .. } => return Ok(Flow::Close),
        }
        if let Some(tx) = self.tx.as_mut() {
            tx.rcpts.push(to);
        }
        self.answer("250 2.1.5 Ok").await
    }

    /// `DATA`: reads the message and records it.
    async fn data(&mut self) -> io::Result<Flow> {
        match self.tx.as_ref() {
            None => return self.answer("503 5.5.1 Error: need MAIL command").await,
            Some(tx) if tx.rcpts.is_empty() => {
                return self.answer("503 5.5.1 Error: need RCPT command").await;
            }
            Some(tx) if tx.chunks.is_some() => {
                return self.answer("503 5.5.1 Error: BDAT in progress").await;
            }
            Some(_) => {}
        }
        match self.fault(Stage::Data, None).await? {
            Fault::Proceed => {}
            Fault::Replied => {
                // The transaction is failed; the client must start over.
                self.tx = None;
                return Ok(Flow::Continue);
            }
            Fault::Dropped { .. } => return Ok(Flow::Close),
        }
        self.reply("354 End data with <CR><LF>.<CR><LF>").await?;
        self.writer.flush().await?;
        self.quickack();
        match self.read_body().await? {
            Body::Eof => Ok(Flow::Close),
            Body::TooLarge => {
                self.tx = None;
                self.answer("552 5.3.4 Error: message exceeds fixed maximum message size")
                    .await
            }
            Body::Complete(body) => self.finish_data(body).await,
        }
    }

    /// Applies `data_end` faults, then records the message (quota permitting) and answers.
    async fn finish_data(&mut self, body: Vec<u8>) -> io::Result<Flow> {
        // Rules see the transaction's recipients, so evaluate before ending it.
        let fault = self.fault(Stage::DataEnd, None).await?;
        let tx = self.tx.take().unwrap_or_default();
        match fault {
            Fault::Proceed => {}
            Fault::Replied => return Ok(Flow::Continue),
            Fault::Dropped { deliver } => {
                if deliver {
                    // Over the quota, it is not recorded either (and counts as throttled).
                    let _ = self.deliver(tx, body).await;
                }
                return Ok(Flow::Close);
            }
        }
        match self.deliver(tx, body).await {
            Ok(seq) => self.answer(&format!("250 2.0.0 Ok: queued as {seq}")).await,
            // Over the quota: the transaction is over, the session goes on.
            Err(throttled) => self.answer(&throttled).await,
        }
    }

    /// Records a message (and writes the maildir copy) unless it is over the quota;
    /// returns its sequence number, or the reply for a throttled message.
    async fn deliver(&self, tx: Transaction, body: Vec<u8>) -> Result<u64, String> {
        let size = body.len();
        let mut raw = into_lossy_string(body);
        // Stored messages can be many; don't keep the read buffer's slack.
        raw.shrink_to_fit();
        let meta = MessageMeta {
            seq: 0,
            message_id: header_value(&raw, "Message-ID").unwrap_or_default(),
            mail_from: tx.mail_from,
            rcpt_to: tx.rcpts,
            subject: header_value(&raw, "Subject").unwrap_or_default(),
            received_at_ms: 0,
            size,
            chunked: tx.chunks.is_some(),
        };
        if let Some(keep) = self.state.keep_bytes.filter(|keep| raw.len() > *keep) {
            let mut cut = keep;
            while !raw.is_char_boundary(cut) {
                cut -= 1;
            }
            raw.truncate(cut);
            raw.shrink_to_fit();
        }
        let Some(dir) = self.state.maildir.as_ref() else {
            return self.state.record(meta, raw);
        };
        let copy = raw.clone();
        let seq = self.state.record(meta, raw)?;
        let path = dir.join(format!("{seq}.eml"));
        if let Err(e) = tokio::fs::write(&path, copy).await {
            crate::warn(format_args!("writing {}: {e}", path.display()));
        }
        Ok(seq)
    }

    /// Asks Linux to acknowledge incoming segments immediately.
    ///
    /// Clients that write the body and the final `.` separately without
    /// `TCP_NODELAY` (lettre does) otherwise stall on Nagle's algorithm until
    /// our delayed ACK fires, about 40 ms per message.
    fn quickack(&self) {
        #[cfg(target_os = "linux")]
        {
            let stream: &TcpStream = self.reader.get_ref().as_ref();
            // Purely a latency optimisation; failure is harmless.
            let _ = stream.set_quickack(true);
        }
    }

    /// Reads the message after the 354 reply, up to the line consisting of ".".
    async fn read_body(&mut self) -> io::Result<Body> {
        let mut body = Vec::with_capacity(8 * 1024);
        let mut too_large = false;
        loop {
            let start = body.len();
            // Room for the rest of the message plus a stuffed dot and CRLF.
            let cap = if too_large {
                DISCARD_LINE
            } else {
                self.state.max_size.saturating_sub(start) + 3
            };
            match read_line_capped(&mut self.reader, &mut body, cap).await? {
                LineRead::Eof => return Ok(Body::Eof),
                LineRead::TooLong => too_large = true,
                LineRead::Line => {
                    let line = &body[start..];
                    if line == b".\r\n" || line == b".\n" {
                        body.truncate(start);
                        return Ok(if too_large {
                            Body::TooLarge
                        } else {
                            Body::Complete(body)
                        });
                    }
                    if line.first() == Some(&b'.') {
                        body.remove(start);
                    }
                    too_large |= body.len() > self.state.max_size;
                }
            }
            if too_large {
                // Keep consuming until the final dot without holding the data.
                body = Vec::new();
            }
        }
    }

    /// Looks up and applies the first matching fault rule for `stage`.
    async fn fault(&mut self, stage: Stage, candidate: Option<&str>) -> io::Result<Fault> {
        let rcpts = self.tx.as_ref().map_or(&[][..], |tx| tx.rcpts.as_slice());
        let Some(action) = self.state.fire(stage, rcpts, candidate) else {
            return Ok(Fault::Proceed);
        };
        match action {
            Action::Reply(line) => {
                self.reply(&line).await?;
                Ok(Fault::Replied)
            }
            Action::Drop { deliver } => {
                self.state.counters.dropped.fetch_add(1, Ordering::Relaxed);
                // Earlier (pipelined) replies were legitimately produced; send them.
                self.writer.flush().await?;
                Ok(Fault::Dropped { deliver })
            }
            Action::DelayMs(ms) => {
                self.writer.flush().await?;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(Fault::Proceed)
            }
            Action::Hang => {
                self.state.counters.hung.fetch_add(1, Ordering::Relaxed);
                self.writer.flush().await?;
                self.swallow().await?;
                Ok(Fault::Dropped { deliver: false })
            }
        }
    }

    /// Reads and discards what the client sends until it closes: a hung session.
    async fn swallow(&mut self) -> io::Result<()> {
        let mut sink = tokio::io::sink();
        tokio::io::copy(&mut self.reader, &mut sink).await?;
        Ok(())
    }

    /// Buffers one reply (which may contain inner CRLFs) followed by CRLF.
    async fn reply(&mut self, line: &str) -> io::Result<()> {
        self.writer.write_all(line.as_bytes()).await?;
        self.writer.write_all(b"\r\n").await
    }
}
