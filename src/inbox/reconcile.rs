//! Ladder mode's reconciler queries: scheduled jobs overdue by more than a grace
//! period that have not reached the inbox (no claim has moved them on), with the
//! bodies the relay kept for them.

use std::time::Duration;

use super::{DbError, Inbox};

/// A scheduled job the ladder has not delivered in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overdue {
    /// The idempotency key.
    pub key: String,
    /// Due time, Unix ms.
    pub due_ms: i64,
    /// The job as published.
    pub body: Vec<u8>,
}

impl Inbox {
    /// Up to `limit` scheduled jobs due more than `grace` ago, with a kept body, not
    /// re-published within the last `grace`; most overdue first.
    pub async fn overdue(&self, grace: Duration, limit: i64) -> Result<Vec<Overdue>, DbError> {
        let client = self.pool.get().await?;
        let grace_ms = grace.as_millis() as i64;
        let rows = client
            .query(
                "SELECT key, (extract(epoch FROM due_at) * 1000)::bigint, body
                   FROM postie_inbox
                  WHERE status = 'scheduled' AND body IS NOT NULL
                    AND due_at < now() - $1::bigint * interval '1 millisecond'
                    AND (reconciled_at IS NULL
                         OR reconciled_at < now() - $1::bigint * interval '1 millisecond')
                  ORDER BY due_at LIMIT $2",
                &[&grace_ms, &limit],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Overdue {
                key: r.get(0),
                due_ms: r.get(1),
                body: r.get(2),
            })
            .collect())
    }

    /// Notes that `keys` were re-published now.
    pub async fn mark_reconciled(&self, keys: &[String]) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        client
            .execute(
                "UPDATE postie_inbox SET reconciled_at = now()
                  WHERE key = ANY($1) AND status = 'scheduled'",
                &[&keys],
            )
            .await?;
        Ok(())
    }
}
