//! `postie-smtp-sink`: an in-memory SMTP server for integration tests and benchmarks.
//!
//! The sink speaks a subset of RFC 5321 over plain TCP, accepts every well-formed
//! message, keeps it in memory (optionally also writing `<seq>.eml` files to a
//! directory) and exposes what it received over a small HTTP control API. Faults
//! (rejections, dropped connections, delays) can be injected at each stage of the
//! SMTP conversation through the same API, which lets tests reproduce transient
//! failures and "accepted but the reply was lost" situations.
//!
//! On startup, once both listeners are bound, the process prints exactly one line,
//! `smtp=127.0.0.1:PORT control=127.0.0.1:PORT`, to stdout. It then serves until it
//! receives SIGTERM or Ctrl-C, and exits with status 0.
//!
//! Control API:
//! - `GET /messages[?raw=true]`, `DELETE /messages`
//! - `GET /stats`
//! - `GET /faults`, `PUT /faults` (JSON array of rules), `DELETE /faults`
//! - `GET /health`
//!
//! A fault rule looks like
//! `{"stage": "rcpt", "rcpt_contains": "bad", "action": {"reply": "451 4.3.0 later"}, "times": 2}`
//! where `stage` is one of `connect`, `mail`, `rcpt`, `data` (reply to `DATA`) or
//! `data_end` (reply after the final dot), and `action` is one of `{"reply": LINE}`,
//! `{"drop": true, "deliver": BOOL}` or `{"delay_ms": N}`. Rules are checked in order;
//! the first active match fires, and `times` (if present) counts down to 0.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(
    name = "postie-smtp-sink",
    about = "In-memory SMTP sink with fault injection"
)]
struct Args {
    /// Address the SMTP listener binds to.
    #[arg(long, default_value = "127.0.0.1:0")]
    smtp: SocketAddr,
    /// Address the HTTP control API binds to.
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
    /// If set, every accepted message is also written to `DIR/<seq>.eml`.
    #[arg(long, value_name = "DIR")]
    maildir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.maildir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating maildir {}", dir.display()))?;
    }
    let state = Arc::new(state::AppState::new(args.maildir));

    let smtp = TcpListener::bind(args.smtp)
        .await
        .with_context(|| format!("binding SMTP listener on {}", args.smtp))?;
    let control = TcpListener::bind(args.control)
        .await
        .with_context(|| format!("binding control listener on {}", args.control))?;
    announce(smtp.local_addr()?, control.local_addr()?);

    let smtp_task = tokio::spawn(smtp::serve(smtp, Arc::clone(&state)));
    let control_task = tokio::spawn(control::serve(control, state));
    tokio::select! {
        () = shutdown_signal() => Ok(()),
        res = smtp_task => res.context("SMTP server task failed")?,
        res = control_task => res.context("control server task failed")?,
    }
}

/// Prints the single startup line that tests parse, and flushes stdout.
fn announce(smtp: SocketAddr, control: SocketAddr) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    // A closed stdout must not stop the server; tests that care will notice.
    let _ = writeln!(out, "smtp={smtp} control={control}");
    let _ = out.flush();
}

/// Completes on Ctrl-C or (on Unix) SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sig) => {
                sig.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Writes a diagnostic line to stderr, ignoring failures (stderr may be closed).
fn warn(msg: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "postie-smtp-sink: {msg}");
}

/// Shared state: recorded messages, fault rules and counters.
mod state {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, MutexGuard, PoisonError};

    use serde::Serialize;

    use crate::faults::{Action, FaultRule, Stage};

    /// Message metadata, as listed by `GET /messages`.
    #[derive(Debug, Clone, Serialize)]
    pub(crate) struct MessageMeta {
        /// Global 1-based sequence number.
        pub(crate) seq: u64,
        /// Trimmed value of the `Message-ID` header, or `""`.
        pub(crate) message_id: String,
        /// Reverse path given in `MAIL FROM`.
        pub(crate) mail_from: String,
        /// Forward paths given in `RCPT TO`, in order.
        pub(crate) rcpt_to: Vec<String>,
        /// Unfolded, trimmed, undecoded value of the `Subject` header, or `""`.
        pub(crate) subject: String,
        /// Unix time in milliseconds when the final dot was received.
        pub(crate) received_at_ms: i64,
        /// Size of the message in bytes after dot-unstuffing.
        pub(crate) size: usize,
    }

    /// A recorded message: metadata plus the raw content.
    #[derive(Debug)]
    pub(crate) struct Recorded {
        /// Metadata shown in listings.
        pub(crate) meta: MessageMeta,
        /// The message after dot-unstuffing, decoded as lossy UTF-8.
        pub(crate) raw: String,
    }

    /// Serialization view of a message including its raw content.
    #[derive(Serialize)]
    struct WithRaw<'a> {
        #[serde(flatten)]
        meta: &'a MessageMeta,
        raw: &'a str,
    }

    /// Counters reported by `GET /stats`.
    #[derive(Debug, Default)]
    pub(crate) struct Counters {
        /// Messages recorded (including drop-with-deliver).
        pub(crate) accepted: AtomicU64,
        /// TCP connections accepted on the SMTP port.
        pub(crate) connections: AtomicU64,
        /// Fault rule firings.
        pub(crate) faults_applied: AtomicU64,
        /// Connections closed by a `drop` fault.
        pub(crate) dropped: AtomicU64,
    }

    /// Snapshot of [`Counters`].
    #[derive(Debug, Serialize)]
    pub(crate) struct Stats {
        accepted: u64,
        connections: u64,
        faults_applied: u64,
        dropped: u64,
    }

    /// Recorded messages and the next sequence number.
    #[derive(Debug, Default)]
    struct Store {
        next_seq: u64,
        messages: Vec<Recorded>,
    }

    /// Everything shared between SMTP sessions and the control API.
    #[derive(Debug)]
    pub(crate) struct AppState {
        store: Mutex<Store>,
        rules: Mutex<Vec<FaultRule>>,
        /// Event counters.
        pub(crate) counters: Counters,
        /// Optional directory receiving `<seq>.eml` copies.
        pub(crate) maildir: Option<PathBuf>,
    }

    /// Locks a mutex, recovering the data if another thread panicked while holding it.
    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(PoisonError::into_inner)
    }

    impl AppState {
        /// Creates empty state.
        pub(crate) fn new(maildir: Option<PathBuf>) -> Self {
            Self {
                store: Mutex::new(Store {
                    next_seq: 1,
                    messages: Vec::new(),
                }),
                rules: Mutex::new(Vec::new()),
                counters: Counters::default(),
                maildir,
            }
        }

        /// Records a message, assigning its sequence number, and returns that number.
        pub(crate) fn record(&self, mut meta: MessageMeta, raw: String) -> u64 {
            let mut store = lock(&self.store);
            let seq = store.next_seq;
            store.next_seq += 1;
            meta.seq = seq;
            store.messages.push(Recorded { meta, raw });
            drop(store);
            self.counters.accepted.fetch_add(1, Ordering::Relaxed);
            seq
        }

        /// Serializes all recorded messages as a JSON array.
        pub(crate) fn messages_json(&self, with_raw: bool) -> serde_json::Result<Vec<u8>> {
            let store = lock(&self.store);
            if with_raw {
                let view: Vec<WithRaw<'_>> = store
                    .messages
                    .iter()
                    .map(|m| WithRaw {
                        meta: &m.meta,
                        raw: &m.raw,
                    })
                    .collect();
                serde_json::to_vec(&view)
            } else {
                let view: Vec<&MessageMeta> = store.messages.iter().map(|m| &m.meta).collect();
                serde_json::to_vec(&view)
            }
        }

        /// Forgets all recorded messages (sequence numbers keep counting); returns how many.
        pub(crate) fn clear_messages(&self) -> usize {
            std::mem::take(&mut lock(&self.store).messages).len()
        }

        /// Returns a snapshot of the counters.
        pub(crate) fn stats(&self) -> Stats {
            let c = &self.counters;
            Stats {
                accepted: c.accepted.load(Ordering::Relaxed),
                connections: c.connections.load(Ordering::Relaxed),
                faults_applied: c.faults_applied.load(Ordering::Relaxed),
                dropped: c.dropped.load(Ordering::Relaxed),
            }
        }

        /// Returns the current fault rules with their remaining counts.
        pub(crate) fn rules(&self) -> Vec<FaultRule> {
            lock(&self.rules).clone()
        }

        /// Replaces the fault rules; returns how many rules were there before.
        pub(crate) fn set_rules(&self, rules: Vec<FaultRule>) -> usize {
            std::mem::replace(&mut *lock(&self.rules), rules).len()
        }

        /// Fires the first active rule matching `stage` and the recipients, if any.
        ///
        /// `rcpts` are the recipients accepted so far in the transaction; `candidate`
        /// is the address being given at the `rcpt` stage.
        pub(crate) fn fire(
            &self,
            stage: Stage,
            rcpts: &[String],
            candidate: Option<&str>,
        ) -> Option<Action> {
            let mut rules = lock(&self.rules);
            let rule = rules
                .iter_mut()
                .find(|r| r.is_active() && r.matches(stage, rcpts, candidate))?;
            rule.consume();
            let action = rule.action.clone();
            drop(rules);
            self.counters.faults_applied.fetch_add(1, Ordering::Relaxed);
            Some(action)
        }
    }
}

/// Fault rules: parsing, validation and matching.
mod faults {
    use serde::{Deserialize, Serialize};

    /// Point of the SMTP conversation a rule applies to.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub(crate) enum Stage {
        /// The greeting after the TCP connection is accepted.
        Connect,
        /// The reply to `MAIL FROM`.
        Mail,
        /// The reply to `RCPT TO`.
        Rcpt,
        /// The reply to the `DATA` command (normally 354).
        Data,
        /// The reply after the terminating dot (normally 250).
        DataEnd,
    }

    /// What a firing rule does.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(try_from = "ActionSpec", into = "ActionSpec")]
    pub(crate) enum Action {
        /// Send this reply line instead of the normal one.
        Reply(String),
        /// Close the connection without replying; at `data_end`, `deliver` records
        /// the message first.
        Drop {
            /// Record the message before dropping (only meaningful at `data_end`).
            deliver: bool,
        },
        /// Sleep this many milliseconds, then proceed normally.
        DelayMs(u64),
    }

    /// Wire form of [`Action`]: exactly one of `reply`, `drop`, `delay_ms`.
    #[derive(Debug, Clone, Default, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ActionSpec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reply: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        drop: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deliver: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        delay_ms: Option<u64>,
    }

    impl TryFrom<ActionSpec> for Action {
        type Error = String;

        fn try_from(spec: ActionSpec) -> Result<Self, Self::Error> {
            match (spec.reply, spec.drop, spec.delay_ms) {
                (Some(reply), None, None) if spec.deliver.is_none() => {
                    validate_reply(&reply)?;
                    Ok(Action::Reply(reply))
                }
                (None, Some(true), None) => Ok(Action::Drop {
                    deliver: spec.deliver.unwrap_or(false),
                }),
                (None, Some(false), None) => Err("\"drop\" must be true".to_owned()),
                (None, None, Some(ms)) if spec.deliver.is_none() => Ok(Action::DelayMs(ms)),
                _ => Err(
                    "action must have exactly one of \"reply\", \"drop\" (with optional \
                     \"deliver\") or \"delay_ms\""
                        .to_owned(),
                ),
            }
        }
    }

    impl From<Action> for ActionSpec {
        fn from(action: Action) -> Self {
            match action {
                Action::Reply(reply) => ActionSpec {
                    reply: Some(reply),
                    ..ActionSpec::default()
                },
                Action::Drop { deliver } => ActionSpec {
                    drop: Some(true),
                    deliver: Some(deliver),
                    ..ActionSpec::default()
                },
                Action::DelayMs(ms) => ActionSpec {
                    delay_ms: Some(ms),
                    ..ActionSpec::default()
                },
            }
        }
    }

    /// Checks that a reply is a single line starting with a 2xx-5xx code.
    fn validate_reply(reply: &str) -> Result<(), String> {
        let code_ok = reply.len() >= 3
            && reply.as_bytes()[..3].iter().all(u8::is_ascii_digit)
            && matches!(reply.as_bytes()[0], b'2'..=b'5')
            && matches!(reply.as_bytes().get(3), None | Some(b' '));
        if !code_ok {
            return Err(format!(
                "reply {reply:?} must start with a 3-digit code (2xx-5xx) followed by a space"
            ));
        }
        if reply.contains(['\r', '\n']) {
            return Err("reply must be a single line".to_owned());
        }
        Ok(())
    }

    /// One fault-injection rule.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(crate) struct FaultRule {
        /// Stage the rule applies to.
        pub(crate) stage: Stage,
        /// Only match when a recipient of the current transaction (at `rcpt`, also the
        /// address being given) contains this substring. A rule with this field never
        /// matches at `connect` or `mail`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub(crate) rcpt_contains: Option<String>,
        /// What to do when the rule fires.
        pub(crate) action: Action,
        /// Remaining firings; `None` means unlimited.
        #[serde(default)]
        pub(crate) times: Option<u64>,
    }

    impl FaultRule {
        /// Whether the rule may still fire.
        pub(crate) fn is_active(&self) -> bool {
            self.times != Some(0)
        }

        /// Whether the rule applies at `stage` given the transaction's recipients.
        pub(crate) fn matches(
            &self,
            stage: Stage,
            rcpts: &[String],
            candidate: Option<&str>,
        ) -> bool {
            if self.stage != stage {
                return false;
            }
            let Some(needle) = self.rcpt_contains.as_deref() else {
                return true;
            };
            if matches!(stage, Stage::Connect | Stage::Mail) {
                return false;
            }
            rcpts
                .iter()
                .map(String::as_str)
                .chain(candidate)
                .any(|addr| addr.contains(needle))
        }

        /// Records one firing.
        pub(crate) fn consume(&mut self) {
            if let Some(n) = self.times.as_mut() {
                *n = n.saturating_sub(1);
            }
        }
    }
}

/// The HTTP control API.
mod control {
    use std::sync::Arc;

    use axum::body::Bytes;
    use axum::extract::{Query, State};
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;
    use axum::{Json, Router};
    use serde::Deserialize;
    use serde_json::json;
    use tokio::net::TcpListener;

    use crate::faults::FaultRule;
    use crate::state::{AppState, Stats};

    /// Shared state as seen by handlers.
    type Shared = State<Arc<AppState>>;

    /// Serves the control API until the listener fails.
    pub(crate) async fn serve(listener: TcpListener, state: Arc<AppState>) -> anyhow::Result<()> {
        axum::serve(listener, router(state)).await?;
        Ok(())
    }

    /// Builds the control router.
    fn router(state: Arc<AppState>) -> Router {
        Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/messages", get(list_messages).delete(clear_messages))
            .route("/stats", get(stats))
            .route(
                "/faults",
                get(list_faults).put(set_faults).delete(clear_faults),
            )
            .with_state(state)
    }

    /// Query string of `GET /messages`.
    #[derive(Debug, Deserialize)]
    struct MessagesQuery {
        /// Include the raw message content.
        #[serde(default)]
        raw: bool,
    }

    /// `GET /messages[?raw=true]`.
    async fn list_messages(State(state): Shared, Query(q): Query<MessagesQuery>) -> Response {
        match state.messages_json(q.raw) {
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    }

    /// `DELETE /messages`.
    async fn clear_messages(State(state): Shared) -> Json<serde_json::Value> {
        Json(json!({ "deleted": state.clear_messages() }))
    }

    /// `GET /stats`.
    async fn stats(State(state): Shared) -> Json<Stats> {
        Json(state.stats())
    }

    /// `GET /faults`.
    async fn list_faults(State(state): Shared) -> Json<Vec<FaultRule>> {
        Json(state.rules())
    }

    /// `PUT /faults`: replaces the rules; answers with the new list, or 400.
    async fn set_faults(State(state): Shared, body: Bytes) -> Response {
        match serde_json::from_slice::<Vec<FaultRule>>(&body) {
            Ok(rules) => {
                state.set_rules(rules);
                Json(state.rules()).into_response()
            }
            Err(e) => (
                StatusCode::BAD_REQUEST,
                format!("invalid fault rules: {e}\n"),
            )
                .into_response(),
        }
    }

    /// `DELETE /faults`.
    async fn clear_faults(State(state): Shared) -> Json<serde_json::Value> {
        Json(json!({ "deleted": state.set_rules(Vec::new()) }))
    }
}

/// The SMTP side: accept loop, sessions, line reading and header extraction.
mod smtp {
    use std::io;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    use tokio::net::{TcpListener, TcpStream};

    use crate::faults::{Action, Stage};
    use crate::state::{AppState, MessageMeta};

    /// Largest accepted message, also advertised as `SIZE`.
    const MAX_MESSAGE_SIZE: usize = 50 * 1024 * 1024;
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

    /// Outcome of reading one line.
    enum LineRead {
        /// The peer closed the connection (possibly mid-line).
        Eof,
        /// A complete line, terminator included, was appended.
        Line,
        /// The line exceeded the cap; it was consumed but only partly appended.
        TooLong,
    }

    /// Outcome of reading a message body after `DATA`.
    enum Body {
        /// The peer closed the connection before the final dot.
        Eof,
        /// The message exceeded [`MAX_MESSAGE_SIZE`]; it was read and discarded.
        TooLarge,
        /// The complete, dot-unstuffed message.
        Complete(Vec<u8>),
    }

    /// The mail transaction in progress.
    #[derive(Debug, Default)]
    struct Transaction {
        mail_from: String,
        rcpts: Vec<String>,
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
                let read =
                    read_line_capped(&mut self.reader, &mut self.line, MAX_COMMAND_LINE).await?;
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
            let reply = format!(
                "250-{HOSTNAME}\r\n250-SIZE {MAX_MESSAGE_SIZE}\r\n250-8BITMIME\r\n250 PIPELINING"
            );
            self.reply(&reply).await?;
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
                rcpts: Vec::new(),
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

        /// Applies `data_end` faults, then records the message and acknowledges it.
        async fn finish_data(&mut self, body: Vec<u8>) -> io::Result<Flow> {
            // Rules see the transaction's recipients, so evaluate before ending it.
            let fault = self.fault(Stage::DataEnd, None).await?;
            let tx = self.tx.take().unwrap_or_default();
            match fault {
                Fault::Proceed => {}
                Fault::Replied => return Ok(Flow::Continue),
                Fault::Dropped { deliver } => {
                    if deliver {
                        self.deliver(tx, body).await;
                    }
                    return Ok(Flow::Close);
                }
            }
            let seq = self.deliver(tx, body).await;
            self.answer(&format!("250 2.0.0 Ok: queued as {seq}")).await
        }

        /// Records a message (and writes the maildir copy); returns its sequence number.
        async fn deliver(&self, tx: Transaction, body: Vec<u8>) -> u64 {
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
                received_at_ms: chrono::Utc::now().timestamp_millis(),
                size,
            };
            let Some(dir) = self.state.maildir.as_ref() else {
                return self.state.record(meta, raw);
            };
            let copy = raw.clone();
            let seq = self.state.record(meta, raw);
            let path = dir.join(format!("{seq}.eml"));
            if let Err(e) = tokio::fs::write(&path, copy).await {
                crate::warn(format_args!("writing {}: {e}", path.display()));
            }
            seq
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
                    MAX_MESSAGE_SIZE - start + 3
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
                        too_large |= body.len() > MAX_MESSAGE_SIZE;
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
            }
        }

        /// Buffers one reply (which may contain inner CRLFs) followed by CRLF.
        async fn reply(&mut self, line: &str) -> io::Result<()> {
            self.writer.write_all(line.as_bytes()).await?;
            self.writer.write_all(b"\r\n").await
        }
    }

    /// Appends bytes up to and including the next LF to `out`.
    ///
    /// At most `cap` bytes of the line are appended; a longer line is still consumed
    /// entirely and reported as [`LineRead::TooLong`].
    async fn read_line_capped<R: AsyncBufRead + Unpin>(
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
    fn strip_eol(line: &[u8]) -> &[u8] {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        line.strip_suffix(b"\r").unwrap_or(line)
    }

    /// Parses `FROM:<addr> params` / `TO:<addr> params` (prefix case-insensitive).
    ///
    /// Accepts an optional space after the colon and a bare address without brackets.
    fn parse_path(arg: &str, prefix: &str) -> Option<String> {
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
    fn into_lossy_string(bytes: Vec<u8>) -> String {
        String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// Returns the unfolded, trimmed value of the first header called `name`.
    ///
    /// Header names compare case-insensitively; only the header section (up to the
    /// first empty line) is searched.
    fn header_value(raw: &str, name: &str) -> Option<String> {
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
            let raw =
                "subject: Hello\r\n\tworld \r\nMESSAGE-ID:\r\n <a@b>\r\n\r\nSubject: body\r\n";
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
}
