//! Ladder mode's reconciler queries: scheduled jobs overdue by more than a grace
//! period that no worker has received (no arrival mark, no claim), with the bodies
//! the relay kept for them, and the frontier, each per lane (`LaneRows`); the arrival
//! marks themselves. (The end of a scheduled row whose job ended without a claim is a
//! transition: `machine/finish_unclaimed.rs`.)

use std::time::Duration;

use super::{DbError, Inbox};

/// A scheduled job the ladder has not delivered in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Overdue {
    /// The idempotency key.
    pub(crate) key: String,
    /// Due time, Unix ms.
    pub(crate) due_ms: i64,
    /// The job as published.
    pub(crate) body: Vec<u8>,
    /// The revision the worker recorded a debounced job's version under, by which it
    /// is claimed (`postie-revision`); `None` for any other row, a debounced job's
    /// version the relay recorded but no worker saw included (it is debounced when
    /// it arrives).
    pub(crate) debounced: Option<i32>,
}

/// Which rows belong to one lane: `lane` for a configured lane other than the default;
/// for the default lane (`lane` None), rows with no lane and rows of a lane not among
/// `others` (configured no more).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneRows<'a> {
    pub(crate) lane: Option<&'a str>,
    pub(crate) others: &'a [&'a str],
}

impl Inbox {
    /// The keys (and due times, Unix ms) of up to `limit` scheduled jobs due before `due_before_ms` (Unix
    /// ms), with a kept body, that no worker has marked as arrived and that were not
    /// re-published within the last `grace`; most overdue first. Bodies are read
    /// later, a few at a time ([`Inbox::mark_reconciled`]). A row the relay
    /// rescheduled while it was `sending` counts as scheduled once its sender is gone
    /// (its lease ran out): the newer revision's copy may be lost, and the older one's
    /// redelivery is stale (the model's finding 3, issue 34).
    pub(crate) async fn overdue(
        &self,
        lane: LaneRows<'_>,
        due_before_ms: i64,
        grace: Duration,
        limit: i64,
    ) -> Result<Vec<(String, i64)>, DbError> {
        let client = self.pool.get().await?;
        let grace_ms = grace.as_millis() as i64;
        let rows = client
            .query(
                // One literal: the model's harness runs this text as it is.
                "SELECT key, (extract(epoch FROM due_at) * 1000)::bigint FROM postie_inbox
                  WHERE (status = 'scheduled' AND arrived_at IS NULL
                         OR status = 'sending' AND rescheduled
                            AND lease_until <= clock_timestamp())
                    AND body IS NOT NULL
                    AND due_at < to_timestamp($1::bigint / 1000.0)
                    AND (reconciled_at IS NULL
                         OR reconciled_at < now() - $2::bigint * interval '1 millisecond')
                    AND (CASE WHEN $4::text IS NULL THEN lane IS NULL OR lane <> ALL($5::text[])
                              ELSE lane = $4::text END)
                  ORDER BY due_at LIMIT $3",
                &[&due_before_ms, &grace_ms, &limit, &lane.lane, &lane.others],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The latest due time (Unix ms) among scheduled jobs a worker holds (marked as
    /// arrived) in `lane`, if any: that lane's send queue's frontier.
    pub(crate) async fn arrived_frontier(
        &self,
        lane: LaneRows<'_>,
    ) -> Result<Option<i64>, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT (extract(epoch FROM max(due_at)) * 1000)::bigint FROM postie_inbox
                  WHERE status = 'scheduled' AND arrived_at IS NOT NULL
                    AND (CASE WHEN $1::text IS NULL THEN lane IS NULL OR lane <> ALL($2::text[])
                              ELSE lane = $1::text END)",
                &[&lane.lane, &lane.others],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Notes that `keys` are re-published now, if they are still scheduled (with a
    /// body) and no worker has marked them as arrived meanwhile; the jobs it noted,
    /// with their bodies, which are the ones to publish.
    pub(crate) async fn mark_reconciled(&self, keys: &[String]) -> Result<Vec<Overdue>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "UPDATE postie_inbox SET reconciled_at = now(), reconciled = reconciled + 1
                  WHERE key = ANY($1) AND body IS NOT NULL
                    AND (status = 'scheduled' AND arrived_at IS NULL
                         OR status = 'sending' AND rescheduled
                            AND lease_until <= clock_timestamp())
                 RETURNING key, (extract(epoch FROM due_at) * 1000)::bigint, body,
                           CASE WHEN debounce_last_at IS NOT NULL THEN revision END",
                &[&keys],
            )
            .await?;
        let mut jobs: Vec<Overdue> = rows
            .iter()
            .map(|r| Overdue {
                key: r.get(0),
                due_ms: r.get(1),
                body: r.get(2),
                debounced: r.get(3),
            })
            .collect();
        jobs.sort_by_key(|job| job.due_ms);
        Ok(jobs)
    }

    /// Marks `keys` as arrived: a worker holds each, waiting for its turn, unclaimed.
    /// Rows claimed or finished meanwhile are left alone.
    pub(crate) async fn mark_arrived(&self, keys: &[String]) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "UPDATE postie_inbox SET arrived_at = now()
                  WHERE key = ANY($1) AND status = 'scheduled' AND arrived_at IS NULL",
            )
            .await?;
        client.execute(&stmt, &[&keys]).await?;
        Ok(())
    }
}
