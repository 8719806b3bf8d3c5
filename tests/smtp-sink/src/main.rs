//! `postie-smtp-sink`: an in-memory SMTP server for integration tests and benchmarks.
//!
//! The sink speaks a subset of RFC 5321 over plain TCP, accepts every well-formed
//! message, keeps it in memory (optionally also writing `<seq>.eml` files to a
//! directory) and exposes what it received over a small HTTP control API. Faults
//! (rejections, dropped connections, delays, hung sessions) can be injected at each stage of the
//! SMTP conversation through the same API, which lets tests reproduce transient
//! failures and "accepted but the reply was lost" situations. In quota mode it accepts
//! at most R messages per second and refuses the rest as Amazon SES does (`454 4.7.0
//! Throttling failure: Maximum sending rate exceeded.`), for tests of rate limiting.
//!
//! On startup, once both listeners are bound, the process prints exactly one line,
//! `smtp=127.0.0.1:PORT control=127.0.0.1:PORT`, to stdout. It then serves until it
//! receives SIGTERM or Ctrl-C, and exits with status 0. With `--keep-bytes N` it keeps
//! only each message's first N bytes (its `size` is the whole message's); with
//! `--size N` it advertises `SIZE N` and refuses a larger message.
//!
//! Control API:
//! - `GET /messages[?raw=true]`, `DELETE /messages`
//! - `GET /stats`
//! - `GET /faults`, `PUT /faults` (JSON array of rules), `DELETE /faults`
//! - `GET /quota`, `PUT /quota` (JSON settings), `DELETE /quota` (quota mode off)
//! - `GET /health`
//!
//! A fault rule looks like
//! `{"stage": "rcpt", "rcpt_contains": "bad", "action": {"reply": "451 4.3.0 later"}, "times": 2}`
//! where `stage` is one of `connect`, `mail`, `rcpt`, `data` (reply to `DATA`, or to a
//! transaction's first `BDAT` before its chunk is read) or `data_end` (reply after the
//! final dot, or after the chunk of `BDAT … LAST`), and `action` is one of `{"reply": LINE}`,
//! `{"drop": true, "deliver": BOOL}`, `{"delay_ms": N}` (hold the reply N ms) or
//! `{"hang": true}` (never answer again: the session reads and discards input until the
//! client closes it, even after the rule is gone). Rules are checked in order;
//! the first active match fires, and `times` (if present) counts down to 0.
//!
//! Quota mode (`--quota-per-second R` at startup, or `PUT /quota` with
//! `{"per_second": R}`; `{"per_second": null}` or `DELETE /quota` turns it off, and an
//! optional `"reply": LINE` replaces the 454 reply) admits at most R messages in any
//! one-second window. It is checked when the final dot arrives, after any `data_end`
//! fault rule: a message over the quota gets the reply and is not recorded (a `drop`
//! rule with `deliver` then drops without recording). `GET /quota` (and `PUT /quota`)
//! answer with the settings and counters:
//! `{"per_second": 5, "reply": "454 4.7.0 …", "accepted": 10, "throttled": 15,
//! "accepted_per_second": [{"second": 1764510000, "accepted": 5}, …]}`, where
//! `accepted_per_second` counts every recorded message by Unix second, quota or not.
//! See the `quota` module.
//!
//! With `--chunking` the EHLO reply advertises CHUNKING and the sink takes `BDAT <size>
//! [LAST]` (RFC 3030): each chunk is read whatever the reply (503 without MAIL, 554
//! without an accepted recipient), a `data` rule fires at the transaction's first
//! chunk, and `GET /messages` marks a message that came in chunks `"chunked": true`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod control;
mod faults;
mod quota;
mod smtp;
mod state;

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
    about = "In-memory SMTP sink with fault injection and a quota mode"
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
    /// Quota mode: accept at most R messages in any one-second window and answer the
    /// rest `454 4.7.0 Throttling failure: Maximum sending rate exceeded.` (changeable
    /// at runtime with `PUT /quota`).
    #[arg(long, value_name = "R")]
    quota_per_second: Option<u32>,
    /// Leave PIPELINING out of the EHLO reply (a relay that takes one command at a time).
    #[arg(long)]
    no_pipelining: bool,
    /// Advertise CHUNKING and take `BDAT` (RFC 3030).
    #[arg(long)]
    chunking: bool,
    /// Keep only the first N bytes of each message (its headers; `size` stays the
    /// whole): for runs of many large messages (attachments), whose bodies would
    /// otherwise all be held in memory.
    #[arg(long, value_name = "N")]
    keep_bytes: Option<usize>,
    /// Advertise `SIZE N` (RFC 1870) and refuse a message over N bytes with 552
    /// (default 50 MiB).
    #[arg(long, value_name = "N")]
    size: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.maildir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating maildir {}", dir.display()))?;
    }
    let quota = quota::QuotaConfig::new(args.quota_per_second);
    let mut state = state::AppState::new(args.maildir, quota);
    state.pipelining = !args.no_pipelining;
    state.chunking = args.chunking;
    state.keep_bytes = args.keep_bytes;
    if let Some(size) = args.size {
        state.max_size = size;
    }
    let state = Arc::new(state);

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
