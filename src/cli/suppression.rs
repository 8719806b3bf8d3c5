//! `postie suppression list|add|remove`: the addresses postie does not send to.

use std::time::Duration;

use clap::Subcommand;

use crate::config::Settings;
use crate::inbox::{Inbox, Suppress, SuppressionReason};

/// What to do with the suppression list.
#[derive(Subcommand)]
pub enum SuppressionCommand {
    /// List suppressed addresses (live entries), one per line, tab-separated.
    List {
        /// Only this address.
        #[arg(long)]
        address: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 1_000)]
        limit: i64,
    },
    /// Suppress an address (no-op if it already is, in that scope).
    Add {
        /// The address.
        address: String,
        /// hard_bounce, complaint, unsubscribe or manual.
        #[arg(long, default_value = "manual")]
        reason: String,
        /// `*` (every email) or one job type.
        #[arg(long, default_value = "*")]
        scope: String,
        /// Why, for the audit trail.
        #[arg(long)]
        note: Option<String>,
        /// Lifts itself after this long (`30d`, `12h`); default: until removed.
        #[arg(long, value_parser = humantime::parse_duration)]
        expires: Option<Duration>,
    },
    /// Stop suppressing an address (in one scope, or every one).
    Remove {
        /// The address.
        address: String,
        /// Only this scope (`*` or a job type); default: every scope.
        #[arg(long)]
        scope: Option<String>,
    },
}

/// Runs `command` against the inbox database.
pub(super) async fn run(settings: &Settings, command: SuppressionCommand) -> anyhow::Result<()> {
    let inbox = Inbox::connect(&settings.database).await?;
    inbox.migrate().await?;
    match command {
        SuppressionCommand::List { address, limit } => {
            let rows = inbox.suppression_list(address.as_deref(), limit).await?;
            for r in &rows {
                out!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    r.address,
                    r.scope,
                    r.reason.as_str(),
                    r.source,
                    r.created_at,
                    r.expires_at.as_deref().unwrap_or("-"),
                    crate::contract::readable(r.evidence.as_deref().unwrap_or("-"), 200)
                );
            }
            out!("{} suppressed", rows.len());
        }
        SuppressionCommand::Add {
            address,
            reason,
            scope,
            note,
            expires,
        } => {
            let reason = SuppressionReason::parse(&reason).ok_or_else(|| {
                anyhow::anyhow!(
                    "--reason {reason:?}: one of hard_bounce, complaint, unsubscribe, manual"
                )
            })?;
            anyhow::ensure!(address.contains('@'), "{address:?} is not an email address");
            let added = inbox
                .suppress(Suppress {
                    address: &address,
                    scope: &scope,
                    reason,
                    source: "cli",
                    evidence: note.as_deref(),
                    lasts: expires,
                })
                .await?;
            out!(
                "{address}: {}",
                if added {
                    "suppressed"
                } else {
                    "already suppressed in that scope (unchanged)"
                }
            );
        }
        SuppressionCommand::Remove { address, scope } => {
            let removed = inbox.unsuppress(&address, scope.as_deref(), "cli").await?;
            out!(
                "{address}: {removed} entr{} removed",
                if removed == 1 { "y" } else { "ies" }
            );
        }
    }
    Ok(())
}
