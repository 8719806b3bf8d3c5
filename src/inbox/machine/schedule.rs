//! `schedule`: the relay records a job it routed into the ladder (ladder mode), the
//! schedule of record that the reconciler reads: into `scheduled` from no row, or from
//! an older (or equal) revision that is not being sent; a newer revision of a job
//! being sent is remembered on the `sending` row (`rescheduled`, sql/0017), for
//! `complete` to turn into `scheduled` unless the send succeeded.

use super::super::{DbError, Inbox};

/// A job the relay routed into the ladder, to be recorded as scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The idempotency key.
    pub key: String,
    /// Its revision.
    pub revision: i32,
    /// Due time, Unix ms.
    pub due_ms: i64,
    /// Its lane, `None` for the default (the reconciler's frontier is per lane).
    pub lane: Option<String>,
    /// The job as published, kept until it is finished so that the reconciler can
    /// re-publish it (None: not kept, `delay.reconcile = false`).
    pub body: Option<Vec<u8>>,
}

/// `schedule` for a batch of jobs, one row each (keys unique and in order): a newer or
/// equal revision replaces a `scheduled`, `cancelled` (past the cancel) or `retrying`
/// row; a newer one a `dead`, `throttled` or `suppressed` row, or marks a `sending`
/// row `rescheduled` with its due time and body.
const SCHEDULE: &str = "INSERT INTO postie_inbox AS i (key, status, revision, due_at, body, lane)
 SELECT k, 'scheduled', r, to_timestamp(d / 1000.0), b, l
   FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bytea[], $5::text[])
        AS t(k, r, d, b, l)
 ON CONFLICT (key) DO UPDATE
    SET status = CASE WHEN i.status = 'sending' THEN 'sending' ELSE 'scheduled' END,
        rescheduled = (i.status = 'sending'),
        due_at = EXCLUDED.due_at,
        revision = EXCLUDED.revision, body = EXCLUDED.body, lane = EXCLUDED.lane,
        reconciled_at = NULL, arrived_at = NULL, updated_at = now()
  WHERE (i.status IN ('scheduled', 'cancelled', 'retrying')
         AND EXCLUDED.revision >= i.revision
         OR i.status IN ('sending', 'dead', 'throttled', 'suppressed')
         AND EXCLUDED.revision > i.revision)
    AND (i.cancelled_through IS NULL OR EXCLUDED.revision > i.cancelled_through)";

impl Inbox {
    /// Ladder mode: records scheduled jobs in one statement and one commit (a newer
    /// or equal revision replaces a scheduled, cancelled-before or retrying row; a
    /// sent or in-flight row is left alone). A key
    /// given twice keeps its highest revision. Keys are written in order, so that two
    /// instances' batches lock rows in the same order and cannot deadlock.
    pub async fn schedule_many(&self, jobs: &[Scheduled]) -> Result<(), DbError> {
        let mut newest: std::collections::BTreeMap<&str, &Scheduled> = Default::default();
        for job in jobs {
            let entry = newest.entry(job.key.as_str()).or_insert(job);
            if job.revision >= entry.revision {
                *entry = job;
            }
        }
        let keys: Vec<&str> = newest.keys().copied().collect();
        let revisions: Vec<i32> = newest.values().map(|j| j.revision).collect();
        let dues: Vec<i64> = newest.values().map(|j| j.due_ms).collect();
        let bodies: Vec<Option<&[u8]>> = newest.values().map(|j| j.body.as_deref()).collect();
        let lanes: Vec<Option<&str>> = newest.values().map(|j| j.lane.as_deref()).collect();
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(SCHEDULE).await?;
        client
            .execute(&stmt, &[&keys, &revisions, &dues, &bodies, &lanes])
            .await?;
        Ok(())
    }
}
