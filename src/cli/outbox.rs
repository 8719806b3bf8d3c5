//! `postie outbox install`: the transactional outbox in a producer's database
//! (`outbox::install`); and the outbox sources' lag for `postie status` (per source,
//! the rows waiting and the oldest one's age).

use std::time::Duration;

use clap::{Args, Subcommand};
use secrecy::{ExposeSecret, SecretString};

use crate::config::Settings;
use crate::outbox::{install, lag, Grants, Source};

/// `postie outbox …`.
#[derive(Subcommand)]
pub enum OutboxCommand {
    /// Create (or bring up to date) the outbox in a producer's database: the schema
    /// `postie`, its table and `postie.enqueue`; re-runnable.
    Install(InstallArgs),
}

/// `postie outbox install`.
#[derive(Args)]
pub struct InstallArgs {
    /// The producer's database (postgres://…; TLS by `sslmode`, as database.url).
    #[arg(long, env = "POSTIE_OUTBOX_DATABASE", hide_env_values = true)]
    database: SecretString,
    /// A role that may then only call postie.enqueue (the application's).
    #[arg(long)]
    app_role: Option<String>,
    /// A role that may then only read and delete the outbox's rows (postie's relay).
    #[arg(long)]
    relay_role: Option<String>,
    /// The largest job `postie.enqueue` accepts, in bytes (default:
    /// `worker.max_body_bytes`, as `postie serve` refuses larger ones).
    #[arg(long)]
    max_body_bytes: Option<usize>,
}

/// Runs `command`.
pub(super) async fn run(settings: &Settings, command: OutboxCommand) -> anyhow::Result<()> {
    match command {
        OutboxCommand::Install(args) => run_install(settings, &args).await,
    }
}

async fn run_install(settings: &Settings, args: &InstallArgs) -> anyhow::Result<()> {
    let parsed = crate::config::outbox_source(
        "--database",
        args.database.expose_secret(),
        1,
        &settings.database,
    )?;
    let source = Source::new(&parsed, &settings.database)?;
    let mut client = source
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL at {}: {e}", source.shown))?;
    let grants = Grants {
        app: args.app_role.as_deref(),
        relay: args.relay_role.as_deref(),
    };
    // Each statement is quick, but the advisory lock waits for another install.
    let limit = settings.database.statement_timeout;
    let max_body_bytes = args
        .max_body_bytes
        .unwrap_or(settings.worker.max_body_bytes);
    let applied = tokio::time::timeout(limit, install(&mut client, grants, max_body_bytes))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "no answer from {} within {} (database.statement_timeout): another install holding the lock?",
                source.shown,
                humantime::format_duration(limit)
            )
        })??;
    if applied.is_empty() {
        out!("the outbox in {} is up to date", source.shown);
    }
    for name in applied {
        out!("applied {name} to {}", source.shown);
    }
    out!("postie.enqueue refuses jobs over {max_body_bytes} bytes (worker.max_body_bytes)");
    for (what, role) in [("enqueue", grants.app), ("relay", grants.relay)] {
        if let Some(role) = role {
            out!("granted {role:?} the {what} rights");
        }
    }
    Ok(())
}

/// `postie status`'s lines for `outbox.sources`: each source's rows waiting, the
/// oldest one's age and the rows set aside (refused for good), or why it cannot be read (each look under
/// `database.statement_timeout`).
pub(super) async fn status(settings: &Settings) -> anyhow::Result<()> {
    let parsed = settings.outbox.parse_sources(&settings.database)?;
    if parsed.is_empty() {
        return Ok(());
    }
    out!("outbox sources (rows waiting, oldest):");
    let limit = settings.database.connect_timeout + settings.database.statement_timeout;
    for parsed in &parsed {
        let source = Source::new(parsed, &settings.database)?;
        let look = async {
            let client = source.connect().await?;
            lag(&client).await
        };
        match tokio::time::timeout(limit, look).await {
            Ok(Ok(lag)) => out!(
                "  {:<24} {:>8} {}{}",
                source.name,
                lag.rows,
                humantime::format_duration(Duration::from_millis(
                    (lag.oldest_seconds * 1000.0) as u64
                )),
                match lag.rejected {
                    0 => String::new(),
                    n => format!("  ({n} set aside in postie.outbox_rejected)"),
                }
            ),
            Ok(Err(error)) => out!("  {:<24} (unavailable: {})", source.name, error.cause()),
            Err(_) => out!(
                "  {:<24} (no answer within {})",
                source.name,
                humantime::format_duration(limit)
            ),
        }
    }
    Ok(())
}
