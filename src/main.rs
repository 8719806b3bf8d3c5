//! The `postie` binary: parses arguments, loads settings, sets up logging, runs a command.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use postie::commands::{self, PublishRequest};
use postie::config::Settings;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "postie",
    version,
    about = "Delayed email jobs from RabbitMQ, sent exactly once"
)]
struct Cli {
    /// Configuration file (TOML); environment variables POSTIE__SECTION__KEY override it.
    #[arg(long, global = true, env = "POSTIE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per run: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Consume jobs and send emails until SIGTERM or Ctrl-C.
    Serve,
    /// Apply the database migrations in sql/.
    Migrate,
    /// Declare the exchanges and queues (idempotent), or delete them.
    Topology {
        /// Delete every queue and exchange under the prefix instead (loses their messages).
        #[arg(long)]
        delete: bool,
    },
    /// Publish one job to the contract exchange, with a publisher confirm.
    Publish {
        /// Read the JSON body from a file (`-` for stdin) instead of the flags below.
        #[arg(long, conflicts_with_all = ["key", "order_id", "kind", "to", "subject", "text", "html"])]
        file: Option<PathBuf>,
        /// Idempotency key (default: ORDER_ID:TYPE).
        #[arg(long)]
        key: Option<String>,
        /// Order id.
        #[arg(long)]
        order_id: Option<String>,
        /// Notification type.
        #[arg(long = "type")]
        kind: Option<String>,
        /// Sender (default: smtp.default_from).
        #[arg(long)]
        from: Option<String>,
        /// Recipient; repeat for more.
        #[arg(long)]
        to: Vec<String>,
        /// Subject line.
        #[arg(long)]
        subject: Option<String>,
        /// Plain-text body.
        #[arg(long)]
        text: Option<String>,
        /// HTML body.
        #[arg(long)]
        html: Option<String>,
        /// Delay before sending, e.g. 90s or 2h (sets x-delay).
        #[arg(long, value_parser = humantime::parse_duration)]
        delay: Option<Duration>,
    },
    /// Show inbox counts by status and queue depths.
    Status,
    /// Cancel a key at once (a tombstone if no job for it was seen yet).
    Cancel {
        /// The idempotency key.
        key: String,
        /// Cancel revisions up to this one (default: the newest seen).
        #[arg(long)]
        revision: Option<i32>,
    },
    /// List and count scheduled jobs by due time (ladder mode).
    Pending {
        /// Only jobs due before this time (RFC 3339, or a duration from now like 10m).
        #[arg(long)]
        due_before: Option<String>,
        /// Only this key.
        #[arg(long)]
        key: Option<String>,
        /// Show at most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Inspect the dead-letter queue, or move dead letters back to be sent.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Show dead letters (key, kind, attempts, time, reason) without consuming them.
    List {
        /// Show at most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Move dead letters back to the work queue, each with a fresh retry cycle.
    Replay {
        /// Only those whose reason or kind contains this text (case-insensitive).
        #[arg(long)]
        reason: Option<String>,
        /// Only those with this idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Move at most this many.
        #[arg(long)]
        limit: Option<usize>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("postie: {e}");
            return ExitCode::from(2);
        }
    };
    // Before the runtime: the OTLP exporter runs a blocking client on its own thread.
    let _telemetry = match postie::telemetry::init(&settings.log, &settings.otel) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("postie: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
    runtime.block_on(run(cli.command, settings))
}

async fn run(command: Command, settings: Settings) -> ExitCode {
    let result = match command {
        Command::Serve => postie::consumer::serve(settings, shutdown_signal()).await,
        Command::Migrate => commands::migrate(&settings).await,
        Command::Topology { delete } => commands::topology(&settings, delete).await,
        Command::Status => commands::status(&settings).await,
        Command::Cancel { key, revision } => commands::cancel(&settings, &key, revision).await,
        Command::Pending {
            due_before,
            key,
            limit,
        } => commands::pending(&settings, due_before.as_deref(), key.as_deref(), limit).await,
        Command::Dlq { command } => match command {
            DlqCommand::List { limit } => postie::dlq::print_list(&settings, limit).await,
            DlqCommand::Replay { reason, key, limit } => {
                let filter = postie::dlq::ReplayFilter {
                    reason_contains: reason,
                    key,
                    limit,
                };
                postie::dlq::print_replay(&settings, &filter).await
            }
        },
        Command::Publish {
            file,
            key,
            order_id,
            kind,
            from,
            to,
            subject,
            text,
            html,
            delay,
        } => {
            let request = PublishRequest {
                file,
                key,
                order_id,
                kind,
                from,
                to,
                subject,
                text,
                html,
                delay,
            };
            commands::publish(&settings, &request).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postie: {}", postie::describe_error(&e));
            ExitCode::FAILURE
        }
    }
}

/// A token cancelled on SIGTERM or Ctrl-C.
fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing the SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("stop requested; draining");
        cancel.cancel();
    });
    token
}
