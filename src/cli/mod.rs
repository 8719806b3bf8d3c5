//! The `postie` command line: one file per command, each with its clap arguments
//! and the code that runs it. `main.rs` only loads settings and logging and calls
//! [`run`]. [`Exit`] is a command's own exit status, which `main.rs` returns.

mod cancel;
mod console;
mod dlq;
mod feedback;
mod migrate;
mod outbox;
mod pending;
mod prune;
mod publish;
mod serve;
mod status;
mod suppression;
mod topology;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::Settings;

/// For `main.rs`: logging and traces started from the settings, and a line scrubbed
/// of the configured passwords (its last words).
pub use crate::endpoint::scrub;
pub use crate::ops::telemetry::init as init_telemetry;
pub(crate) use publish::PublishArgs;

/// A command's end with an exit status of its own (not 0, 1 or 2), and its last word.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    /// The process's exit status.
    pub code: u8,
    /// The last line, on stderr.
    pub message: String,
}

/// `postie --version`: the release, and the time-zone database compiled in (local
/// times are read with it, so instances of one release agree on every instant).
fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (time zones: IANA tzdb {})",
            env!("CARGO_PKG_VERSION"),
            crate::contract::tzdb_version()
        )
    })
}

/// `postie [--config FILE] COMMAND`.
#[derive(Parser)]
#[command(
    name = "postie",
    version = version(),
    about = "Delayed email jobs from RabbitMQ, sent exactly once"
)]
pub struct Cli {
    /// Configuration file (TOML); environment variables POSTIE__SECTION__KEY override it.
    #[arg(long, global = true, env = "POSTIE_CONFIG")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The sub-commands.
#[derive(Subcommand)]
pub enum Command {
    /// Consume jobs and send emails until SIGTERM or Ctrl-C.
    Serve,
    /// Apply the database migrations in sql/.
    Migrate,
    /// Declare the exchanges and queues (idempotent), or delete them.
    Topology(topology::TopologyArgs),
    /// Publish one job to the contract exchange, with a publisher confirm.
    Publish(PublishArgs),
    /// Show inbox counts by status and queue depths.
    Status(status::StatusArgs),
    /// Serve the operator console (a web UI) until SIGTERM or Ctrl-C.
    Console(console::ConsoleArgs),
    /// Cancel a key at once (a tombstone if no job for it was seen yet).
    Cancel(cancel::CancelArgs),
    /// List and count scheduled jobs by due time (ladder mode).
    Pending(pending::PendingArgs),
    /// Delete finished rows older than inbox.retention (one pass; --dry-run counts).
    Prune(prune::PruneArgs),
    /// Inspect the dead-letter queue, or move dead letters back to be sent.
    Dlq {
        /// What to do with the dead letters.
        #[command(subcommand)]
        command: dlq::DlqCommand,
    },
    /// The suppression list: addresses postie does not send to (hard bounces,
    /// complaints, unsubscribes, manual entries).
    Suppression {
        /// What to do with the list.
        #[command(subcommand)]
        command: suppression::SuppressionCommand,
    },
    /// Bounces and complaints reported after the send: `ingest` reads a DSN or an
    /// ARF report on stdin.
    Feedback {
        /// What to do.
        #[command(subcommand)]
        command: feedback::FeedbackCommand,
    },
    /// The transactional outbox in a producer's database (`install`), which `serve`
    /// relays from `outbox.sources`.
    Outbox {
        /// What to do.
        #[command(subcommand)]
        command: outbox::OutboxCommand,
    },
}

/// Runs `command` with `settings`, loaded from `config` (`serve` loads them again
/// for a console it also serves).
pub async fn run(
    command: Command,
    settings: Settings,
    config: Option<PathBuf>,
) -> anyhow::Result<()> {
    match command {
        Command::Serve => serve::run(settings, config.as_deref()).await,
        Command::Migrate => migrate::run(&settings).await,
        Command::Topology(args) => topology::run(&settings, &args).await,
        Command::Publish(args) => publish::run(&settings, &args).await,
        Command::Status(args) => status::run(&settings, &args).await,
        Command::Console(args) => console::run(settings, &args).await,
        Command::Cancel(args) => cancel::run(&settings, &args).await,
        Command::Pending(args) => pending::run(&settings, &args).await,
        Command::Prune(args) => prune::run(&settings, &args).await,
        Command::Dlq { command } => dlq::run(&settings, command).await,
        Command::Suppression { command } => suppression::run(&settings, command).await,
        Command::Feedback { command } => feedback::run(&settings, command).await,
        Command::Outbox { command } => outbox::run(&settings, command).await,
    }
}
