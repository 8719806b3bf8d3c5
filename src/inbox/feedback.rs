//! Asynchronous feedback (issue 30, `sql/0013_feedback.sql`): a bounce or complaint
//! reported after the email was accepted (a provider's webhook, a DSN, an ARF report)
//! recorded once, matched to its job, and the address put on the suppression list.
//!
//! The address is read as a job's recipient is (`contract::Address`): one that could
//! not be a recipient is refused and nothing is recorded ([`Recorded::Invalid`]).
//! Then one transaction: the notification's row in `postie_feedback` (a replay inserts
//! nothing and changes nothing: [`Recorded::Duplicate`]); the job found by its
//! Message-ID or the provider's id, and matched only if the email went to this
//! address (`postie_inbox.recipients`, issue 45); a matched job's row `feedback` set
//! and its event written; and the address suppressed (a hard bounce as
//! `hard_bounce`, a complaint as `complaint`; a soft bounce is recorded and
//! suppresses nothing). An unmatched notification is recorded without a key and
//! suppresses no one, unless its source is trusted for that
//! (`feedback.trust_unmatched`): a notice that names no email postie sent to the
//! address is what a forger would send.

use super::suppression::{normalise, SuppressionReason, ADD_SQL};
use super::{record_event, DbError, Inbox};
use crate::contract::Address;
use crate::ops::metrics::EventOutcome;

/// What a notification reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FeedbackKind {
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
    pub(crate) fn as_str(self) -> &'static str {
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
    pub(crate) fn reason(self) -> Option<SuppressionReason> {
        match self {
            Self::Bounce { hard: true } => Some(SuppressionReason::HardBounce),
            Self::Bounce { hard: false } => None,
            Self::Complaint => Some(SuppressionReason::Complaint),
        }
    }
}

/// One notification about one address.
#[derive(Debug, Clone)]
pub(crate) struct Feedback {
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
pub(crate) enum Recorded {
    /// New, and matched to the job of this key (an email sent to the address).
    Matched {
        /// The job's key.
        key: String,
    },
    /// Seen before (same source, notification and address): nothing changed.
    Duplicate,
    /// New, but it names no email postie sent to the address: recorded without a key;
    /// the address suppressed only if the source is trusted for that.
    Unmatched {
        /// Why it matched nothing.
        why: Unmatched,
        /// Whether the address was suppressed all the same (`feedback.trust_unmatched`).
        suppressed: bool,
    },
    /// The address is not one a job could have been sent to: nothing recorded.
    Invalid(String),
}

/// Why a notification matched no job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmatched {
    /// No job has its Message-ID or provider id.
    NoJob,
    /// The job with its id was not sent to this address.
    NotSentTo,
    /// The job with its id was sent before postie recorded recipients (0021).
    RecipientsUnknown,
}

impl Unmatched {
    /// In words, for a log line or the ingest's output.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::NoJob => "no job postie sent has its Message-ID or provider id",
            Self::NotSentTo => "the job with its Message-ID or provider id was not sent to this address",
            Self::RecipientsUnknown => "the job with its Message-ID or provider id was sent before postie recorded recipients",
        }
    }
}

/// A Message-ID as the inbox stores it: `<id@domain>`.
pub(crate) fn bracketed(message_id: &str) -> String {
    let bare = message_id
        .trim()
        .trim_start_matches('<')
        .trim_end_matches('>');
    format!("<{}>", bare.trim())
}

/// The job (key, type) whose email `f` names (by Message-ID, else the provider's
/// id) and went to `address`, or why there is none.
async fn sent_to(
    tx: &tokio_postgres::Transaction<'_>,
    f: &Feedback,
    address: &str,
) -> Result<Result<(String, Option<String>), Unmatched>, DbError> {
    let message_id = f.message_id.as_deref().map(bracketed);
    let found = tx
        .query_opt(
            "SELECT key, type, recipients FROM postie_inbox
              WHERE ($1::text IS NOT NULL AND message_id = $1)
                 OR ($2::text IS NOT NULL AND provider_message_id = $2)
              ORDER BY (message_id = $1) DESC NULLS LAST LIMIT 1",
            &[&message_id, &f.provider_message_id],
        )
        .await?;
    let Some(row) = found else {
        return Ok(Err(Unmatched::NoJob));
    };
    Ok(match row.try_get::<_, Option<Vec<String>>>(2)? {
        None => Err(Unmatched::RecipientsUnknown),
        Some(to) if !to.iter().any(|a| a == address) => Err(Unmatched::NotSentTo),
        Some(_) => Ok((row.try_get(0)?, row.try_get(1)?)),
    })
}

impl Inbox {
    /// Records `f` in one transaction (see the module's doc); `trusted`: an unmatched
    /// notice suppresses all the same (`feedback.trust_unmatched` names its source).
    pub(crate) async fn record_feedback(
        &self,
        f: &Feedback,
        trusted: bool,
    ) -> Result<Recorded, DbError> {
        let address = match Address::parse("address", f.address.trim()) {
            Ok(parsed) => normalise(&parsed.email),
            Err(why) => return Ok(Recorded::Invalid(why.to_string())),
        };
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let matched = sent_to(&tx, f, &address).await?;
        let (key, kind) = match &matched {
            Ok((key, kind)) => (Some(key.as_str()), kind.as_deref()),
            Err(_) => (None, None),
        };
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
        if let Some(key) = key {
            tx.execute(
                "UPDATE postie_inbox SET feedback = $2, feedback_at = now() WHERE key = $1",
                &[&key, &f.kind.row_value()],
            )
            .await?;
        }
        let suppress = f.kind.reason().filter(|_| key.is_some() || trusted);
        if let Some(reason) = suppress {
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
        if let (Some(key), Some(outcome), true) = (key, f.kind.event(), self.events) {
            record_event(&tx, key, outcome, Some(&f.evidence)).await?;
        }
        tx.commit().await?;
        if suppress.is_some() {
            self.note_suppressed(&address);
        }
        Ok(match matched {
            Ok((key, _)) => Recorded::Matched { key },
            Err(why) => Recorded::Unmatched {
                why,
                suppressed: suppress.is_some(),
            },
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
