//! Retention: deleting finished inbox rows, old tombstones and spent throttle rows,
//! a few thousand rows per statement (each its own short transaction: no long
//! locks, no table rewrite). Autovacuum makes the space reusable: with it off
//! (maintenance warns), the table keeps growing, pruned or not.
//!
//! Every DELETE re-checks its condition on the live row, so a row that changed since
//! the batch was chosen (a `dead` key claimed again, a throttle row just taken) is
//! left alone. A claim racing the deletion of its key (`postie_claim` finds no row
//! after its insert conflicted) answers `busy` for 1 ms: the job is deferred to the
//! first retry step and then claimed as a new key, as any job whose key was pruned.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::{DbError, Inbox};

/// Statuses that are finished (see [`super::Status::in_flight`]); only these are pruned.
const FINISHED: &str = "status IN ('sent', 'dead', 'cancelled', 'throttled')";

/// Jobs that ended with every recipient suppressed (0012), pruned as finished rows.
const SUPPRESSED: &str = "status = 'suppressed'";

/// A cancel of a key never seen as a job (`postie_cancel`'s insert): no claim ever
/// recorded an attempt or an error, and the relay never scheduled it.
const TOMBSTONE: &str =
    "(status = 'cancelled' AND attempts = 0 AND last_error IS NULL AND due_at IS NULL)";

/// What one pass deletes.
#[derive(Debug, Clone)]
pub(crate) struct PrunePlan {
    /// Finished rows untouched for longer are deleted.
    pub(crate) retention: Duration,
    /// Tombstones untouched for longer are deleted.
    pub(crate) tombstone_retention: Duration,
    /// Throttle windows per type: a throttle row whose newest send is older than its
    /// type's window counts nothing any more. Types without a rule use `retention`.
    pub(crate) throttle_windows: Vec<(String, Duration)>,
    /// Rows per statement.
    pub(crate) batch: i64,
    /// Count instead of deleting.
    pub(crate) dry_run: bool,
}

impl PrunePlan {
    /// The plan the settings describe.
    pub(crate) fn from_settings(settings: &crate::config::Settings, dry_run: bool) -> Self {
        Self {
            retention: settings.inbox.retention,
            tombstone_retention: settings.inbox.tombstone_retention(),
            throttle_windows: settings
                .throttle
                .iter()
                .map(|(kind, rule)| (kind.clone(), rule.window))
                .collect(),
            batch: i64::from(settings.inbox.prune_batch),
            dry_run,
        }
    }
}

/// What one pass deleted (or, dry, would delete).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pruned {
    /// Finished inbox rows other than tombstones.
    pub(crate) finished: u64,
    /// Tombstones.
    pub(crate) tombstones: u64,
    /// Throttle rows.
    pub(crate) throttle: u64,
    /// Bounce and complaint records and send tallies past the rates' day
    /// (`reputation.rs`).
    pub(crate) feedback: u64,
    /// DELETE statements run.
    pub(crate) statements: u64,
    /// How long the pass took.
    pub(crate) took: Duration,
}

/// After each statement, a rest as long as it took: pruning keeps at most about half
/// of one database backend busy, so that on a small server the claims keep the rest.
async fn rest(batch_started: Instant) {
    tokio::time::sleep(batch_started.elapsed()).await;
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Inbox {
    /// Whether the server runs autovacuum, which reclaims what pruning deletes.
    pub(crate) async fn autovacuum_on(&self) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let row = client.query_one("SHOW autovacuum", &[]).await?;
        Ok(row.get::<_, String>(0) == "on")
    }

    /// One pass: finished rows, tombstones, throttle rows, then the rates' rows.
    pub(crate) async fn prune(&self, plan: &PrunePlan) -> Result<Pruned, DbError> {
        let started = Instant::now();
        let mut pruned = Pruned::default();
        let client = self.pool.get().await?;
        // Cutoffs fixed at the start (the database's clock), so a pass ends.
        let row = client
            .query_one(
                "SELECT now() - $1::bigint * interval '1 millisecond',
                        now() - $2::bigint * interval '1 millisecond', now()",
                &[&ms(plan.retention), &ms(plan.tombstone_retention)],
            )
            .await?;
        let (finished_cutoff, tombstone_cutoff, now): (
            DateTime<Utc>,
            DateTime<Utc>,
            DateTime<Utc>,
        ) = (row.get(0), row.get(1), row.get(2));
        drop(client);
        // Each class through its own partial index: finished rows (0004's), then
        // suppressed rows (0012's), then tombstones.
        let classes = [
            (
                format!("{FINISHED} AND NOT {TOMBSTONE}"),
                finished_cutoff,
                false,
            ),
            (SUPPRESSED.to_string(), finished_cutoff, false),
            (
                format!("{FINISHED} AND {TOMBSTONE}"),
                tombstone_cutoff,
                true,
            ),
        ];
        for (class, cutoff, tombstones) in classes {
            let n = self
                .prune_inbox(&class, cutoff, plan, &mut pruned.statements)
                .await?;
            if tombstones {
                pruned.tombstones += n;
            } else {
                pruned.finished += n;
            }
        }
        pruned.throttle = self
            .prune_throttle(plan, now, &mut pruned.statements)
            .await?
            + self
                .prune_tenant_slots(plan, &mut pruned.statements)
                .await?;
        pruned.feedback = self
            .prune_feedback(finished_cutoff, plan, &mut pruned.statements)
            .await?;
        pruned.took = started.elapsed();
        Ok(pruned)
    }

    /// Deletes rows of `class` (a predicate its partial index answers) last changed
    /// before `cutoff`, oldest first, walking the index upwards from the last batch's
    /// newest row.
    async fn prune_inbox(
        &self,
        class: &str,
        cutoff: DateTime<Utc>,
        plan: &PrunePlan,
        statements: &mut u64,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let candidates = format!("{class} AND updated_at < $1");
        if plan.dry_run {
            let n: i64 = client
                .query_one(
                    &format!("SELECT count(*) FROM postie_inbox WHERE {candidates}"),
                    &[&cutoff],
                )
                .await?
                .get(0);
            return Ok(n as u64);
        }
        let delete = client
            .prepare(&format!(
                "WITH gone AS (
                    DELETE FROM postie_inbox
                     WHERE ctid = ANY(ARRAY(
                            SELECT ctid FROM postie_inbox
                             WHERE {candidates} AND updated_at >= $2
                             ORDER BY updated_at LIMIT $3))
                       AND {candidates}
                    RETURNING updated_at)
                 SELECT count(*), max(updated_at) FROM gone"
            ))
            .await?;
        // Year 1: below any row, within PostgreSQL's range (chrono's MIN is not).
        let mut from = DateTime::<Utc>::from_timestamp(-62_135_596_800, 0).expect("year 1");
        let mut total = 0u64;
        loop {
            let batch_started = Instant::now();
            let row = client
                .query_one(&delete, &[&cutoff, &from, &plan.batch])
                .await?;
            *statements += 1;
            rest(batch_started).await;
            let n: i64 = row.get(0);
            total += n as u64;
            if let Some(newest) = row.get::<_, Option<DateTime<Utc>>>(1) {
                from = newest;
            }
            // A short batch: nothing older is left (or every candidate changed under us).
            if n < plan.batch {
                return Ok(total);
            }
        }
    }

    /// Deletes throttle rows whose newest send is older than their type's window,
    /// walking the primary key a batch at a time (one pass over the table).
    async fn prune_throttle(
        &self,
        plan: &PrunePlan,
        now: DateTime<Utc>,
        statements: &mut u64,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let kinds: Vec<&str> = plan
            .throttle_windows
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        let windows: Vec<i64> = plan.throttle_windows.iter().map(|(_, w)| ms(*w)).collect();
        let expired = "(SELECT max(s) FROM unnest(t.sends) s) < $3::timestamptz
                - coalesce((SELECT w FROM unnest($4::text[], $5::bigint[]) AS x(k, w)
                             WHERE x.k = t.kind), $6::bigint) * interval '1 millisecond'";
        let step = client
            .prepare(&format!(
                "WITH batch AS (
                    SELECT t.kind, t.recipient, {expired} AS spent FROM postie_throttle t
                     WHERE (t.kind, t.recipient) > ($1, $2)
                     ORDER BY t.kind, t.recipient LIMIT $7),
                 gone AS (
                    DELETE FROM postie_throttle t USING batch b
                     WHERE NOT $8::bool AND b.spent
                       AND t.kind = b.kind AND t.recipient = b.recipient AND {expired}
                    RETURNING 1),
                 last AS (
                    SELECT kind, recipient FROM batch ORDER BY kind DESC, recipient DESC LIMIT 1)
                 SELECT (SELECT count(*) FROM batch),
                        CASE WHEN $8 THEN (SELECT count(*) FROM batch WHERE spent)
                             ELSE (SELECT count(*) FROM gone) END,
                        (SELECT kind FROM last), (SELECT recipient FROM last)"
            ))
            .await?;
        let (mut kind, mut recipient) = (String::new(), String::new());
        let mut total = 0u64;
        loop {
            let batch_started = Instant::now();
            let row = client
                .query_one(
                    &step,
                    &[
                        &kind,
                        &recipient,
                        &now,
                        &kinds,
                        &windows,
                        &ms(plan.retention),
                        &plan.batch,
                        &plan.dry_run,
                    ],
                )
                .await?;
            *statements += 1;
            rest(batch_started).await;
            let seen: i64 = row.get(0);
            total += row.get::<_, i64>(1) as u64;
            if seen < plan.batch {
                return Ok(total);
            }
            kind = row.get(2);
            recipient = row.get(3);
        }
    }

    /// The planner's estimate of the inbox's rows (`pg_class.reltuples`): free to read,
    /// refreshed by (auto)vacuum and analyze. -1 before the first.
    pub(crate) async fn rows_estimate(&self) -> Result<i64, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT coalesce((SELECT reltuples::bigint FROM pg_class
                                   WHERE oid = to_regclass('postie_inbox')), -1)",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }
}
