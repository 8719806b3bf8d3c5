//! `postie dlq list` and `postie dlq replay`: the dead-letter queue for operators.

use clap::Subcommand;

use crate::config::Settings;
use crate::dlq::{self, names, peek, replay, table, ReplayFilter};

/// What to do with the dead letters.
#[derive(Subcommand)]
pub enum DlqCommand {
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

/// Runs a `postie dlq` sub-command.
pub(super) async fn run(settings: &Settings, command: DlqCommand) -> anyhow::Result<()> {
    match command {
        DlqCommand::List { limit } => print_list(settings, limit).await,
        DlqCommand::Replay { reason, key, limit } => {
            let filter = dlq::ReplayFilter {
                reason_contains: reason,
                key,
                limit,
            };
            print_replay(settings, &filter).await
        }
    }
}

/// `postie dlq list`: prints a table of up to `limit` dead letters.
async fn print_list(settings: &Settings, limit: usize) -> anyhow::Result<()> {
    let (depth, letters) = peek(settings, limit).await?;
    let queue = names(settings).dead_queue().to_owned();
    match depth {
        0 => out!("{queue} is empty"),
        n if (n as usize) > letters.len() => {
            out!(
                "{queue}: {n} dead letter(s), the first {} shown",
                letters.len()
            )
        }
        n => out!("{queue}: {n} dead letter(s)"),
    }
    if !letters.is_empty() {
        print!("{}", table(&letters));
    }
    Ok(())
}

/// `postie dlq replay`: replays and prints the counts.
async fn print_replay(settings: &Settings, filter: &ReplayFilter) -> anyhow::Result<()> {
    let report = replay(settings, filter).await?;
    let topology = names(settings);
    out!(
        "moved {} dead letter(s) to {}; {} not matching the filter left in {}",
        report.moved,
        topology.send_queue(),
        report.kept,
        topology.dead_queue()
    );
    Ok(())
}
