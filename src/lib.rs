//! postie: delayed email jobs from RabbitMQ, claimed in PostgreSQL by business key,
//! sent over SMTP exactly once. `ARCHITECTURE.md` at the repository root is the map;
//! in one line each, the path of a job:
//!
//! - `outbox`: the producers' transactional outbox, in their own databases.
//! - `contract`: the producers' contract: one message in, one validated job out.
//! - `topology`: the broker objects' names and the ladder's arithmetic, no I/O.
//! - `broker`: RabbitMQ: connections, confirmed publishes, declaration, probe, acks.
//! - `consume`: `postie serve`: the session supervisor and the consume loops.
//! - `work`: the unit of work (claim → send → record), its outcomes and retry policy.
//! - `inbox`: the PostgreSQL inbox: claims, completions, migrations.
//! - `mail`: the transport seam: building the email and handing it over.
//! - `feedback`: bounces and complaints after the send: webhooks and reports.
//! - `dlq`: dead letters for operators: list and replay.
//! - `ops`: health, circuit breaker, metrics, the HTTP endpoint, logs and traces.
//! - `console`: the operator console, a small web UI over what the CLI reaches.
//! - [`cli`]: the command line.
//!
//! And the leaves everything may use:
//!
//! - [`config`]: settings, loaded in layers and checked once.
//! - `headers`: message headers, and the seal on postie's own.
//! - `endpoint`: loopback check, URL redaction, passwords to scrub.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, clippy::await_holding_lock)]

/// `println!` for command output that ends the process quietly when stdout is
/// closed early (`postie pending | head`), as Unix tools do, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let written = writeln!(std::io::stdout().lock(), $($arg)*);
        if let Err(e) = written {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
        }
    }};
}

mod broker;
pub mod cli;
pub mod config;
mod console;
mod consume;
mod contract;
mod dlq;
mod endpoint;
mod feedback;
mod headers;
mod inbox;
mod mail;
mod ops;
mod outbox;
mod topology;
mod work;

/// The integration tests' door to the internals (`src/testing.rs`); nothing else may
/// use it.
#[doc(hidden)]
pub mod testing;

/// An error and its causes on one line, for the last words of a failed command.
pub fn describe_error(error: &anyhow::Error) -> String {
    error_chain(error.as_ref())
}

/// An error and its causes on one line, each said once.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
