//! `postie pending`: scheduled jobs by due time (ladder mode), in UTC and, for a job
//! with a time zone or a send window (its own or its lane's), in its zone with its
//! window.

use crate::config::Settings;
use crate::inbox::Inbox;

/// Arguments of `postie pending`.
#[derive(clap::Args)]
pub struct PendingArgs {
    /// Only jobs due before this time (RFC 3339, or a duration from now like 10m).
    #[arg(long)]
    due_before: Option<String>,
    /// Only this key.
    #[arg(long)]
    key: Option<String>,
    /// Show at most this many.
    #[arg(long, default_value_t = 100)]
    limit: i64,
}

/// Lists and counts scheduled jobs.
pub(super) async fn run(settings: &Settings, args: &PendingArgs) -> anyhow::Result<()> {
    let due_before_ms = args.due_before.as_deref().map(parse_instant).transpose()?;
    let inbox = Inbox::connect(&settings.database).await?;
    let (jobs, total) = inbox
        .pending(due_before_ms, args.key.as_deref(), args.limit)
        .await?;
    for job in &jobs {
        let due = chrono::DateTime::from_timestamp_millis(job.due_ms)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            .unwrap_or_default();
        let local = job.terms.describe(&settings.topology, job.due_ms);
        let local = if local.is_empty() {
            local
        } else {
            format!("  ({local})")
        };
        out!("{due}  rev {:<3} {}{local}", job.revision, job.key);
    }
    out!(
        "{total} pending{}",
        if (jobs.len() as i64) < total {
            format!(" ({} shown)", jobs.len())
        } else {
            String::new()
        }
    );
    Ok(())
}

/// An RFC 3339 time, or a duration from now (`10m`), in Unix ms.
fn parse_instant(text: &str) -> anyhow::Result<i64> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(text) {
        return Ok(at.timestamp_millis());
    }
    let ahead = humantime::parse_duration(text).map_err(|_| {
        anyhow::anyhow!("{text:?} is neither an RFC 3339 time nor a duration like 10m")
    })?;
    Ok(chrono::Utc::now().timestamp_millis() + ahead.as_millis() as i64)
}
