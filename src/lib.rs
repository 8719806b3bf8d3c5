//! postie: delayed email jobs from RabbitMQ, claimed in PostgreSQL by business key,
//! sent over SMTP exactly once.
//!
//! The data flow, one module per step:
//!
//! - [`config`]: typed settings in layers (defaults, file, `POSTIE__…` environment).
//! - [`topology`]: the exchanges and queues, declared idempotently.
//! - [`delay`]: the `x-delay` contract: due times, and the plugin-free TTL ladder.
//! - [`job`]: the producers' contract: parse and validate one message into an [`job::EmailJob`].
//! - [`inbox`]: the PostgreSQL inbox: migrations, claim by key, record the outcome.
//! - [`mailer`]: build the email and hand it to SMTP (or to `.eml` files).
//! - [`relay`]: ladder mode: route each new job into the TTL cascade by its due time.
//! - [`worker`]: the unit of work: one delivery in, one named [`worker::Outcome`] out.
//! - [`consumer`]: the supervised consume loop: maps outcomes to publish + ack.
//! - [`acks`]: coalesced acks: one `multiple` ack per run of finished deliveries.
//! - [`amqp`]: connections, confirmed publishes and header helpers.
//! - [`health`], [`metrics`], [`http`]: readiness, the SMTP circuit breaker, Prometheus
//!   metrics and the `/metrics` `/healthz` `/readyz` endpoint.
//! - [`commands`]: the CLI sub-commands other than `serve`.
//! - [`dlq`]: `postie dlq`: list dead letters without consuming them, replay them.
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

pub mod acks;
pub mod amqp;
pub mod commands;
pub mod config;
pub mod consumer;
pub mod delay;
pub mod dlq;
pub mod health;
pub mod http;
pub mod inbox;
pub mod job;
pub mod mailer;
pub mod metrics;
pub mod relay;
pub mod telemetry;
pub mod topology;
pub mod worker;

/// An error and its causes on one line, for the last words of a failed command.
pub fn describe_error(error: &anyhow::Error) -> String {
    error
        .chain()
        .map(ToString::to_string)
        .fold(String::new(), |mut line, part| {
            if !line.contains(&part) {
                if !line.is_empty() {
                    line.push_str(": ");
                }
                line.push_str(&part);
            }
            line
        })
}
