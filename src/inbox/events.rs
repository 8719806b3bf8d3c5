//! The delivery events' outbox (`postie_events`, `sql/0014_events.sql`): one row per
//! outcome of a job, written in the statement that records the outcome (the
//! completions' `COMPLETE`, the cancel; [`record_event`] for the feedback), and
//! taken in batches by the publisher (`consume::events`), which deletes a batch only
//! once the broker has confirmed every event of it.

use std::future::Future;

use super::{DbError, Inbox};
use crate::ops::metrics::EventOutcome;

/// The completions' data-modifying CTE: one event per row of `done` (the `UPDATE …
/// RETURNING` of a completion, new values) whose status is terminal and not the one
/// the row had last recorded (`was_announced`, read by a sub-select, which sees the
/// row as it was before the statement: `sql/0016_announced.sql`), when `$events`
/// (the statement's parameter given as `$events`) is true. A send's event happened
/// at its `sent_at`.
macro_rules! events_of_done {
    ($events:literal) => {
        concat!(
            "events AS (
    INSERT INTO postie_events (key, outcome, type, message_id, provider, provider_message_id,
                               reason, attempts, occurred_at)
    SELECT key, status, type, message_id, provider, provider_message_id, last_error, attempts,
           CASE WHEN status = 'sent' THEN sent_at ELSE clock_timestamp() END
      FROM done
     WHERE ",
            $events,
            "::bool AND status IN ('sent', 'dead', 'suppressed', 'throttled')
       AND status IS DISTINCT FROM was_announced
     ORDER BY key)"
        )
    };
}
pub(super) use events_of_done;

/// Inserts one event of `$2` (an outcome) for the job `$1`, with `$3` as its reason,
/// the rest (type, Message-ID, provider and its id, attempts) from the job's inbox
/// row; nothing if the key has no row. See [`record_event`].
pub(crate) const RECORD_EVENT: &str = "INSERT INTO postie_events
        (key, outcome, type, message_id, provider, provider_message_id, reason, attempts)
    SELECT key, $2::text, type, message_id, provider, provider_message_id, $3::text, attempts
      FROM postie_inbox WHERE key = $1::text";

/// Writes an event of `outcome` (`Bounced`, `Complained`) for the job `key` inside
/// the caller's transaction, so that it is recorded with what it reports (the
/// feedback's row, the job's `feedback` column) or not at all; `reason`: the
/// evidence in words (no address). The type, Message-ID and provider's id are the
/// job's inbox row's. False if the key has no row (no event written).
///
/// `pub` for `tests/events.rs`, which writes a bounce with it as the feedback
/// ingestion will. A pool's transaction is one too (`deadpool_postgres::Transaction`
/// dereferences to it).
pub async fn record_event(
    tx: &tokio_postgres::Transaction<'_>,
    key: &str,
    outcome: EventOutcome,
    reason: Option<&str>,
) -> Result<bool, DbError> {
    let written = tx
        .execute(RECORD_EVENT, &[&key, &outcome.as_str(), &reason])
        .await?;
    Ok(written == 1)
}

/// One event as the outbox holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Event {
    /// The row's id: the event's unique id (its AMQP `message_id`).
    pub(crate) id: i64,
    /// The job's idempotency key (as the inbox stores it).
    pub(crate) key: String,
    /// What it reports.
    pub(crate) outcome: EventOutcome,
    /// The job's type, if known.
    pub(crate) kind: Option<String>,
    /// postie's Message-ID of the email.
    pub(crate) message_id: Option<String>,
    /// The transport's name (`transport.providers`).
    pub(crate) provider: Option<String>,
    /// The id the provider's API answered with.
    pub(crate) provider_message_id: Option<String>,
    /// Why (a dead letter's, a suppression's, a feedback's).
    pub(crate) reason: Option<String>,
    /// SMTP attempts counted for the key.
    pub(crate) attempts: i32,
    /// When it happened.
    pub(crate) occurred_at: chrono::DateTime<chrono::Utc>,
}

/// Why a batch was not published and deleted.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OutboxError<E: std::error::Error + 'static> {
    /// PostgreSQL: reading or deleting the batch.
    #[error("{0}")]
    Db(#[from] DbError),
    /// The publish: the batch stays and is taken again.
    #[error("{0}")]
    Publish(#[source] E),
}

impl Inbox {
    /// Takes up to `limit` events, oldest first, that no other instance is
    /// publishing (`FOR UPDATE SKIP LOCKED`), hands them to `publish`, and deletes
    /// them only if it succeeded (every publish confirmed), in one transaction: a
    /// failed publish, a lost connection or a killed instance leaves them to the next
    /// taker. The number of events published.
    pub(crate) async fn publish_events<E, F, Fut>(
        &self,
        limit: i64,
        publish: F,
    ) -> Result<usize, OutboxError<E>>
    where
        E: std::error::Error + 'static,
        F: FnOnce(Vec<Event>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let mut client = self.pool.get().await.map_err(DbError::from)?;
        let tx = client.transaction().await.map_err(DbError::from)?;
        let take = tx
            .prepare_cached(
                "SELECT id, key, outcome, type, message_id, provider, provider_message_id,
                        reason, attempts, occurred_at
                   FROM postie_events ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            )
            .await
            .map_err(DbError::from)?;
        let rows = tx.query(&take, &[&limit]).await.map_err(DbError::from)?;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            events.push(event_of(row)?);
        }
        if events.is_empty() {
            return Ok(0);
        }
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        publish(events).await.map_err(OutboxError::Publish)?;
        let delete = tx
            .prepare_cached("DELETE FROM postie_events WHERE id = ANY($1)")
            .await
            .map_err(DbError::from)?;
        tx.execute(&delete, &[&ids]).await.map_err(DbError::from)?;
        tx.commit().await.map_err(DbError::from)?;
        Ok(ids.len())
    }
}

/// Reads one outbox row.
fn event_of(row: &tokio_postgres::Row) -> Result<Event, DbError> {
    let outcome: &str = row.try_get(2)?;
    let outcome = EventOutcome::parse(outcome).ok_or_else(|| {
        DbError::unreadable(format!(
            "postie_events holds the outcome {outcome:?}, which this postie does not know"
        ))
    })?;
    Ok(Event {
        id: row.try_get(0)?,
        key: row.try_get(1)?,
        outcome,
        kind: row.try_get(3)?,
        message_id: row.try_get(4)?,
        provider: row.try_get(5)?,
        provider_message_id: row.try_get(6)?,
        reason: row.try_get(7)?,
        attempts: row.try_get(8)?,
        occurred_at: row.try_get(9)?,
    })
}
