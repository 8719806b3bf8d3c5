//! `postie_cancel`: a cancel request (`postie cancel`, a producer's cancel body)
//! covers a key up to a revision: a tombstone for a key never seen, `cancelled` for a
//! row in any status but `sent` and `sending`, which keep their status and record
//! `cancelled_through`, answered `cancelled` by a later claim (the SQL function in
//! `sql/schema.sql`).

use super::super::{DbError, Inbox};
use super::status::status_of;
use super::Status;

/// What `postie cancel` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// The key's status before the cancel ([`Status::New`] if unknown: a tombstone now).
    pub prior_status: Status,
    /// The highest revision the cancel covers.
    pub covers: i32,
}

/// `postie_cancel` (`sql/schema.sql`) with the `cancelled` event of a cancel that ends
/// a job; `before` is the statement's snapshot: the row as it was before the cancel
/// (none for a new key), for the type and Message-ID it knew.
const CANCEL: &str = "WITH c AS (SELECT prior_status, covers FROM postie_cancel($1, $2)),
 events AS (
    INSERT INTO postie_events (key, outcome, type, message_id, attempts)
    SELECT $1, 'cancelled', before.type, before.message_id,
           coalesce(before.attempts, 0)
      FROM c LEFT JOIN postie_inbox before ON before.key = $1
     WHERE $3::bool AND c.prior_status IN ('new', 'scheduled', 'retrying'))
 SELECT prior_status, covers FROM c";

impl Inbox {
    /// Cancels `key` up to `revision` (None: the newest seen); a tombstone if unknown.
    /// A cancel that ends a job (a key unknown so far, a scheduled or retrying row)
    /// writes its `cancelled` event in the same statement (`events.enabled`); one of
    /// a job already ended, sent or being sent writes none.
    pub async fn cancel(&self, key: &str, revision: Option<i32>) -> Result<Cancelled, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(CANCEL).await?;
        let row = client
            .query_one(&stmt, &[&key, &revision, &self.events])
            .await?;
        Ok(Cancelled {
            prior_status: status_of(row.get(0))?,
            covers: row.get(1),
        })
    }
}
