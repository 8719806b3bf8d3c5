//! `defer`: a job over its tenant's cap in its lane (issue 33) takes its tenant's next
//! slot, and its `scheduled` row is due at that slot, in the same statement, so that
//! the reconciler does not take a deferred job for a lost one. `scheduled` stays
//! `scheduled`; only `due_at` moves (and `arrived_at` is cleared).

use super::super::{DbError, Inbox};

/// `defer`: the tenant's next slot from the one rate engine (`postie_gcra_take` on
/// its row, `inbox::rate`), and, if it is more than the burst (`$5`, ms) ahead, the
/// job's scheduled row moved to it.
const DEFER: &str = concat!(
    "WITH slot AS (
    SELECT slot AS at, ahead_ms FROM postie_gcra_take(",
    super::super::rate::tenant_row_sql!(),
    ", $3::float8)),
 later AS (SELECT at FROM slot WHERE ahead_ms > $5::bigint),
 moved AS (
    UPDATE postie_inbox SET due_at = (SELECT at FROM later), arrived_at = NULL,
           updated_at = now()
     WHERE key = $4 AND status = 'scheduled' AND EXISTS (SELECT 1 FROM later)
    RETURNING 1)
 SELECT (extract(epoch FROM at) * 1000)::bigint FROM later"
);

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
