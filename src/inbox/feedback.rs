//! Asynchronous feedback (issue 30, `sql/0013_feedback.sql`): a bounce or complaint
//! reported after the email was accepted (a provider's webhook, a DSN, an ARF report)
//! recorded once, matched to its job, and the address put on the suppression list.
//!
//! One transaction: the notification's row in `postie_feedback` (a replay inserts
//! nothing and changes nothing: [`Recorded::Duplicate`]), the job found by its
//! Message-ID or the provider's id, its row's `feedback` set, and the address
//! suppressed (a hard bounce as `hard_bounce`, a complaint as `complaint`; a soft
//! bounce is recorded and suppresses nothing). An unmatched notification still
//! suppresses: the address is known even when the email is not.

use super::suppression::{normalise, SuppressionReason, ADD_SQL};
use super::{record_event, DbError, Inbox};
use crate::ops::metrics::EventOutcome;

/// What a notification reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedbackKind {
    /// The email bounced; `hard`: permanently (the address suppressed).
    Bounce {
        /// A permanent failure (suppresses); a soft one is only recorded.
        hard: bool,
    },
    /// The recipient reported it as spam.
    Complaint,
}

impl FeedbackKind {
    /// `postie_feedback.kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bounce { .. } => "bounce",
            Self::Complaint => "complaint",
        }
    }

    /// The job row's `feedback`.
    fn row_value(self) -> &'static str {
        match self {
            Self::Bounce { .. } => "bounced",
            Self::Complaint => "complained",
        }
    }

    /// The delivery event it is for the matched job, if any (a soft bounce is no
    /// outcome: the provider tries again).
    fn event(self) -> Option<EventOutcome> {
        match self {
            Self::Bounce { hard: true } => Some(EventOutcome::Bounced),
            Self::Bounce { hard: false } => None,
            Self::Complaint => Some(EventOutcome::Complained),
        }
    }

    /// The suppression it adds, if any.
    pub fn reason(self) -> Option<SuppressionReason> {
        match self {
            Self::Bounce { hard: true } => Some(SuppressionReason::HardBounce),
            Self::Bounce { hard: false } => None,
            Self::Complaint => Some(SuppressionReason::Complaint),
        }
    }
}

/// One notification about one address.
#[derive(Debug, Clone)]
pub struct Feedback {
    /// Where it came from (`ses`, `sendgrid`, `postmark`, `mailgun`, `dsn`, `arf`).
    pub source: String,
    /// What the source calls the notification (its replays carry the same).
    pub notification_id: String,
    /// Bounce (hard or soft) or complaint.
    pub kind: FeedbackKind,
    /// The recipient it is about.
    pub address: String,
    /// The email's Message-ID, with or without its angle brackets.
    pub message_id: Option<String>,
    /// The provider's id of the email (`provider_message_id`).
    pub provider_message_id: Option<String>,
    /// The report or reply, in words (kept as the evidence).
    pub evidence: String,
}

/// What recording a notification did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// New, and matched to the job of this key.
    Matched {
        /// The job's key.
        key: String,
    },
    /// Seen before (same source, notification and address): nothing changed.
    Duplicate,
    /// New, but no job has its Message-ID or provider id (the address is still
    /// suppressed when the kind says so).
    Unmatched,
}

/// A Message-ID as the inbox stores it: `<id@domain>`.
pub fn bracketed(message_id: &str) -> String {
    let bare = message_id
        .trim()
        .trim_start_matches('<')
        .trim_end_matches('>');
    format!("<{}>", bare.trim())
}

impl Inbox {
    /// Records `f` in one transaction (see the module's doc).
    pub async fn record_feedback(&self, f: &Feedback) -> Result<Recorded, DbError> {
        let address = normalise(&f.address);
        let message_id = f.message_id.as_deref().map(bracketed);
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let found = tx
            .query_opt(
                "SELECT key, type FROM postie_inbox
                  WHERE ($1::text IS NOT NULL AND message_id = $1)
                     OR ($2::text IS NOT NULL AND provider_message_id = $2)
                  ORDER BY (message_id = $1) DESC NULLS LAST LIMIT 1",
                &[&message_id, &f.provider_message_id],
            )
            .await?;
        let (key, kind): (Option<String>, Option<String>) =
            found.map_or((None, None), |r| (r.get(0), r.get(1)));
        let inserted = tx
            .execute(
                "INSERT INTO postie_feedback
                        (source, notification_id, kind, address, key, type, evidence)
                 VALUES ($1, $2, $3, $4, $5, $7, $6)
                 ON CONFLICT (source, notification_id, address) DO NOTHING",
                &[
                    &f.source,
                    &f.notification_id,
                    &f.kind.as_str(),
                    &address,
                    &key,
                    &f.evidence,
                    &kind,
                ],
            )
            .await?;
        if inserted == 0 {
            tx.rollback().await?;
            return Ok(Recorded::Duplicate);
        }
        if let Some(key) = &key {
            tx.execute(
                "UPDATE postie_inbox SET feedback = $2, feedback_at = now() WHERE key = $1",
                &[key, &f.kind.row_value()],
            )
            .await?;
        }
        if let Some(reason) = f.kind.reason() {
            let lasts: Option<f64> = None;
            tx.execute(
                ADD_SQL,
                &[
                    &address,
                    &"*",
                    &reason.as_str(),
                    &f.source,
                    &Some(f.evidence.as_str()),
                    &lasts,
                ],
            )
            .await?;
        }
        // The matched job's `bounced` / `complained` delivery event, in this
        // transaction: it exists iff the feedback does.
        if let (Some(key), Some(outcome), true) = (&key, f.kind.event(), self.events) {
            record_event(&tx, key, outcome, Some(&f.evidence)).await?;
        }
        tx.commit().await?;
        if f.kind.reason().is_some() {
            self.note_suppressed(&address);
        }
        Ok(match key {
            Some(key) => Recorded::Matched { key },
            None => Recorded::Unmatched,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_compare_in_the_inbox_form_and_kinds_suppress_as_documented() {
        assert_eq!(bracketed("abc@x"), "<abc@x>");
        assert_eq!(bracketed(" <abc@x> "), "<abc@x>");
        assert_eq!(
            FeedbackKind::Bounce { hard: true }.reason(),
            Some(SuppressionReason::HardBounce)
        );
        assert_eq!(FeedbackKind::Bounce { hard: false }.reason(), None);
        assert_eq!(
            FeedbackKind::Complaint.reason(),
            Some(SuppressionReason::Complaint)
        );
    }
}
