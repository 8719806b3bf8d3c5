//! One-click unsubscribe recorded (issue 50): the address suppressed for the link's
//! scope (reason `unsubscribe`) and an `unsubscribed` event for the job whose email
//! carried the link, in one transaction, once: a second request for the same
//! address and scope adds nothing and writes no event.

use super::suppression::{normalise, SuppressionReason, ADD_SQL};
use super::{DbError, Inbox};

/// The event, with the job's type, provider and attempts from its row, or without
/// them (its Message-ID given) if retention has deleted the row.
const EVENT_SQL: &str = "INSERT INTO postie_events
        (key, outcome, type, message_id, provider, provider_message_id, reason, attempts)
    SELECT $1::text, 'unsubscribed', i.type, coalesce(i.message_id, $2::text), i.provider,
           i.provider_message_id, $3::text, coalesce(i.attempts, 0)
      FROM (SELECT 1) AS one LEFT JOIN postie_inbox i ON i.key = $1::text";

/// A verified unsubscribe request.
#[derive(Debug, Clone)]
pub(crate) struct Unsubscribing<'a> {
    /// The recipient's address (normalised here).
    pub address: &'a str,
    /// The scope the link leaves.
    pub scope: &'a str,
    /// The job whose email carried the link.
    pub key: &'a str,
    /// The Message-ID of that email (postie derives it from the key).
    pub message_id: &'a str,
    /// `one-click` or `mailto`.
    pub source: &'a str,
    /// The request in words (the link's key id and issue time; no address).
    pub evidence: &'a str,
}

impl Inbox {
    /// Records `u`: true if the address was suppressed by it, false if it already was
    /// for that scope (nothing written).
    pub(crate) async fn unsubscribe(&self, u: &Unsubscribing<'_>) -> Result<bool, DbError> {
        let address = normalise(u.address);
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let lasts: Option<f64> = None;
        let added = tx
            .execute(
                ADD_SQL,
                &[
                    &address,
                    &u.scope,
                    &SuppressionReason::Unsubscribe.as_str(),
                    &u.source,
                    &u.evidence,
                    &lasts,
                ],
            )
            .await?;
        if added == 1 {
            let reason = format!("unsubscribed from {} ({})", u.scope, u.source);
            tx.execute(EVENT_SQL, &[&u.key, &u.message_id, &reason])
                .await?;
        }
        tx.commit().await?;
        if added == 1 {
            self.note_suppressed(&address);
        }
        Ok(added == 1)
    }
}
