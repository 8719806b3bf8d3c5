//! `postie feedback ingest`: one bounce report (RFC 3464 DSN) or abuse report
//! (RFC 5965 ARF) on stdin, e.g. from a mailbox or an MTA pipe, recorded as the
//! webhooks' notifications are (the job's row by its Message-ID, the suppression list).

use clap::Subcommand;
use tokio::io::AsyncReadExt;

use crate::config::Settings;
use crate::feedback::report;
use crate::inbox::{Inbox, Recorded};

/// What to do with feedback.
#[derive(Subcommand)]
pub enum FeedbackCommand {
    /// Read one DSN or ARF report on stdin (at most feedback.max_body_bytes) and record
    /// its bounces or complaint; one line per recipient says what was recorded.
    Ingest,
}

/// Runs `command`.
pub(super) async fn run(settings: &Settings, command: FeedbackCommand) -> anyhow::Result<()> {
    let FeedbackCommand::Ingest = command;
    let limit = settings.feedback.max_body_bytes;
    let mut message = Vec::new();
    tokio::io::stdin()
        .take(limit as u64 + 1)
        .read_to_end(&mut message)
        .await?;
    anyhow::ensure!(
        message.len() <= limit,
        "the report is over feedback.max_body_bytes ({limit} bytes)"
    );
    let notes = report::read(&message, &settings.suppression.hard_bounce_codes)
        .map_err(|why| anyhow::anyhow!("not a report postie reads: {why}"))?;
    if notes.is_empty() {
        out!("nothing to record: the report names no failed recipient and no abuse");
        return Ok(());
    }
    let inbox = Inbox::connect(&settings.database).await?;
    for note in &notes {
        let what = match note.kind.reason() {
            Some(reason) => format!("{} ({})", note.kind.as_str(), reason.as_str()),
            None => format!("{} (soft: not suppressed)", note.kind.as_str()),
        };
        match inbox.record_feedback(note).await? {
            Recorded::Matched { key } => {
                out!("recorded: {what} from {}, key {key}", note.source)
            }
            Recorded::Duplicate => out!("duplicate: {what} from {} already recorded", note.source),
            Recorded::Unmatched => out!(
                "recorded: {what} from {}, no job has its Message-ID",
                note.source
            ),
        }
    }
    Ok(())
}
