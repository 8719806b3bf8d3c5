//! `defer`: a job over its tenant's cap in its lane (issue 33) takes its tenant's next
//! slot, and its `scheduled` row is due at that slot, in the same statement, so that
//! the reconciler does not take a deferred job for a lost one. `scheduled` stays
//! `scheduled`; only `due_at` moves (and `arrived_at` is cleared).

use super::super::{DbError, Inbox};

/// `defer`: the tenant's GCRA slot (`postie_tenant_slots`), and, if it is more than
/// the burst (`$5`) ahead, the job's scheduled row moved to it.
const DEFER: &str = "WITH slot AS (
    INSERT INTO postie_tenant_slots AS s (lane, tenant, tat)
    VALUES ($1, $2, clock_timestamp() + $3::float8 * interval '1 millisecond')
    ON CONFLICT (lane, tenant) DO UPDATE
       SET tat = greatest(s.tat, clock_timestamp())
                 + $3::float8 * interval '1 millisecond'
    RETURNING tat - $3::float8 * interval '1 millisecond' AS at),
 later AS (
    SELECT at FROM slot
     WHERE at > clock_timestamp() + $5::bigint * interval '1 millisecond'),
 moved AS (
    UPDATE postie_inbox SET due_at = (SELECT at FROM later), arrived_at = NULL,
           updated_at = now()
     WHERE key = $4 AND status = 'scheduled' AND EXISTS (SELECT 1 FROM later)
    RETURNING 1)
 SELECT (extract(epoch FROM at) * 1000)::bigint FROM later";

impl Inbox {
    /// Takes `tenant`'s next slot in `lane` for job `key` under a cap of one job per
    /// `interval_ms`: the slot's time (Unix ms, PostgreSQL's clock) if it is more than
    /// `burst_ms` ahead, and then, in the same statement, the job's scheduled row (if
    /// any) is due at its slot, so that the reconciler does not take a deferred job
    /// for a lost one; `None` if the job may go now.
    pub(crate) async fn tenant_slot(
        &self,
        (lane, tenant): (&str, &str),
        key: &str,
        interval_ms: f64,
        burst_ms: i64,
    ) -> Result<Option<i64>, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(DEFER).await?;
        let row = client
            .query_opt(&stmt, &[&lane, &tenant, &interval_ms, &key, &burst_ms])
            .await?;
        Ok(row.map(|row| row.get(0)))
    }
}
