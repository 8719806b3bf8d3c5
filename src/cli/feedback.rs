//! `postie feedback unsubscribe`: one email to the one-click unsubscribe's mailto
//! address on stdin, its Subject's token read and recorded as a one-click POST is
//! (issue 50).
//!
//! `postie feedback ingest`: one bounce report (RFC 3464 DSN) or abuse report
//! (RFC 5965 ARF) on stdin, e.g. from a mailbox or an MTA pipe, recorded as the
//! webhooks' notifications are (the job's row by its Message-ID, the suppression list).
//!
//! Anyone can mail a bounce mailbox, so a report suppresses an address only when it
//! names an email postie sent to that address; otherwise it is recorded and the
//! command says so and exits with [`UNMATCHED`] (3; `feedback.trust_unmatched = ["dsn"]`
//! or `["arf"]` trusts such reports, explicitly).

use clap::Subcommand;
use tokio::io::AsyncReadExt;

use super::Exit;
use crate::config::Settings;
use crate::feedback::{report, unsubscribe};
use crate::inbox::{Inbox, Recorded};
use crate::mail::unsubscribe::Links;

/// The exit status of an ingest that suppressed no one it was asked to, because the
/// report names no email postie sent to that address (a forgery, or mail not
/// postie's): distinct from 1 (an error: not a report, no database) so that an MTA
/// pipe can tell them apart.
pub(super) const UNMATCHED: u8 = 3;

/// What to do with feedback.
#[derive(Subcommand)]
pub enum FeedbackCommand {
    /// Read one DSN or ARF report on stdin (at most feedback.max_body_bytes) and record
    /// its bounces or complaint; one line per recipient says what was recorded. Exit
    /// 3: read, but an address was not suppressed because the report names no email
    /// postie sent to it.
    Ingest,
    /// Read one email sent to the one-click unsubscribe's mailto address
    /// (`unsubscribe.mailto`) on stdin and record the unsubscribe its Subject's token
    /// asks for (source `mailto`), as a one-click POST does. Exit 1: no valid token.
    Unsubscribe,
}

/// Runs `command`.
pub(super) async fn run(settings: &Settings, command: FeedbackCommand) -> anyhow::Result<()> {
    let limit = settings.feedback.max_body_bytes;
    let mut message = Vec::new();
    tokio::io::stdin()
        .take(limit as u64 + 1)
        .read_to_end(&mut message)
        .await?;
    anyhow::ensure!(
        message.len() <= limit,
        "the message is over feedback.max_body_bytes ({limit} bytes)"
    );
    match command {
        FeedbackCommand::Ingest => ingest(settings, &message).await,
        FeedbackCommand::Unsubscribe => mailto(settings, &message).await,
    }
}

/// `postie feedback unsubscribe`.
async fn mailto(settings: &Settings, message: &[u8]) -> anyhow::Result<()> {
    let domain = &settings.transport.message_id_domain;
    let links = Links::new(&settings.unsubscribe, domain)
        .ok_or_else(|| anyhow::anyhow!("unsubscribe.url is not configured"))?;
    let token = unsubscribe::token_in_subject(message)
        .ok_or_else(|| anyhow::anyhow!("the message has no Subject with a token"))?;
    let link = links
        .read(&token, jiff::Timestamp::now())
        .map_err(|refusal| anyhow::anyhow!("not unsubscribed: {}", refusal.reason()))?;
    let inbox = Inbox::connect(&settings.database).await?;
    if unsubscribe::record(&inbox, &link, "mailto").await? {
        out!("unsubscribed from {} (key {})", link.scope, link.key);
    } else {
        out!(
            "already unsubscribed from {} (key {})",
            link.scope,
            link.key
        );
    }
    Ok(())
}

/// `postie feedback ingest`.
async fn ingest(settings: &Settings, message: &[u8]) -> anyhow::Result<()> {
    let notes = report::read(message, &settings.suppression.hard_bounce_codes)
        .map_err(|why| anyhow::anyhow!("not a report postie reads: {why}"))?;
    if notes.is_empty() {
        out!("nothing to record: the report names no failed recipient and no abuse");
        return Ok(());
    }
    let inbox = Inbox::connect(&settings.database).await?;
    let mut unmatched = 0;
    for note in &notes {
        let what = match note.kind.reason() {
            Some(reason) => format!("{} ({})", note.kind.as_str(), reason.as_str()),
            None => format!("{} (soft: not suppressed)", note.kind.as_str()),
        };
        let trusted = settings.feedback.trusts_unmatched(&note.source);
        match inbox.record_feedback(note, trusted).await? {
            Recorded::Matched { key } => {
                out!("recorded: {what} from {}, key {key}", note.source)
            }
            Recorded::Duplicate => out!("duplicate: {what} from {} already recorded", note.source),
            Recorded::Unmatched { why, suppressed } if suppressed => out!(
                "recorded: {what} from {}, suppressed although {} (feedback.trust_unmatched)",
                note.source,
                why.as_str()
            ),
            Recorded::Unmatched { why, .. } => {
                unmatched += note.kind.reason().is_some() as usize;
                out!(
                    "recorded, not suppressed: {} from {}: {}",
                    note.kind.as_str(),
                    note.source,
                    why.as_str()
                )
            }
            Recorded::Invalid(why) => out!("not recorded: {why}"),
        }
    }
    if unmatched > 0 {
        return Err(Exit {
            code: UNMATCHED,
            message: format!("{unmatched} address(es) not suppressed: the report names no email postie sent to them (feedback.trust_unmatched would trust it)"),
        }
        .into());
    }
    Ok(())
}
