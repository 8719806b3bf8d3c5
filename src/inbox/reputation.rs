//! Bounce and complaint rates per job type (issue 30, `sql/0015_reputation.sql`):
//! providers review an account whose rates climb (SES at 5 % bounces and 0.1 %
//! complaints), so postie counts both against what it sent.
//!
//! Sends are counted per type in memory ([`Tally`]) and added to `postie_send_tally`
//! every [`FLUSH`] and at a stop (one statement per instance, not one per email); a
//! flush that fails is kept for the next. Bounces and complaints are `postie_feedback`'s rows:
//! the relay's refusals at send time ([`Inbox::record_send_bounce`]) and what the
//! providers and reports say later. An instance that dies (kill -9) takes at most
//! [`FLUSH`] of its sends out of the rates. The rates are read over the last hour and
//! the last day; the tally's and the feedback's old rows are pruned here too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use deadpool_postgres::Pool;

use super::{DbError, Inbox};

/// How often an instance adds its counted sends to the table.
pub(crate) const FLUSH: Duration = Duration::from_secs(5);
/// The most job types an instance counts apart; sends of further types are counted
/// under [`OTHER`] (types come from producers: their number is theirs, the memory
/// is postie's).
const TYPES: usize = 1_000;
/// The type of sends past [`TYPES`].
const OTHER: &str = "(other)";

/// Sends per job type, not yet added to `postie_send_tally`.
#[derive(Default)]
pub(super) struct Tally {
    counts: Mutex<HashMap<String, i64>>,
    /// Set once the flushing task runs.
    started: std::sync::OnceLock<()>,
}

impl Tally {
    fn add(&self, kind: &str, n: i64) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(kind) {
            *count += n;
            return;
        }
        let kind = if counts.len() < TYPES { kind } else { OTHER };
        *counts.entry(kind.to_owned()).or_default() += n;
    }

    fn take(&self) -> HashMap<String, i64> {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Adds one flush's counts to the current minute.
const FLUSH_TALLY: &str = "INSERT INTO postie_send_tally AS t (minute, type, sent)
     SELECT date_trunc('minute', now()), k, n FROM unnest($1::text[], $2::bigint[]) AS u(k, n)
     ON CONFLICT (minute, type) DO UPDATE SET sent = t.sent + EXCLUDED.sent";

/// Every [`FLUSH`], adds what `tally` counted; ends when the tally is dropped (the
/// last counts are added by [`Inbox::flush_sends`] at a stop).
async fn flush_every(pool: Pool, tally: Weak<Tally>, deadline: Duration) {
    loop {
        tokio::time::sleep(FLUSH).await;
        let Some(tally) = tally.upgrade() else { return };
        flush(&pool, &tally, deadline).await;
    }
}

/// Adds what `tally` counted; what fails is kept for the next flush.
async fn flush(pool: &Pool, tally: &Tally, deadline: Duration) {
    let counts = tally.take();
    if counts.is_empty() {
        return;
    }
    let (kinds, sent): (Vec<&str>, Vec<i64>) = counts.iter().map(|(k, n)| (k.as_str(), *n)).unzip();
    let flushed = tokio::time::timeout(deadline, async {
        let client = pool.get().await?;
        let stmt = client.prepare_cached(FLUSH_TALLY).await?;
        client.execute(&stmt, &[&kinds, &sent]).await?;
        Ok::<_, DbError>(())
    })
    .await
    .unwrap_or_else(|_| Err(DbError::no_answer(deadline)));
    if let Err(error) = flushed {
        tracing::debug!(%error, "send tally not flushed; kept for the next flush");
        counts.iter().for_each(|(k, n)| tally.add(k, *n));
    }
}

/// One job type's sends, bounces and complaints over the last hour and day.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeRates {
    /// The job type (`""` for jobs without one; `"(unknown)"` for feedback that
    /// matched no job).
    pub kind: String,
    /// Emails sent in the last hour and day.
    pub sent: [i64; 2],
    /// Bounces in the last hour and day.
    pub bounces: [i64; 2],
    /// Complaints in the last hour and day.
    pub complaints: [i64; 2],
}

impl TypeRates {
    /// `count` per email sent in window `w` (0: hour, 1: day); `None` with no send.
    pub fn rate(&self, count: [i64; 2], w: usize) -> Option<f64> {
        (self.sent[w] > 0).then(|| count[w] as f64 / self.sent[w] as f64)
    }

    /// Whether `rate` (of window `w`) is over its warning threshold `limit`: it counts
    /// only once the window holds `min_sends` sends (`suppression.rate_min_sends`).
    pub fn over(&self, rate: f64, w: usize, limit: f64, min_sends: i64) -> bool {
        rate > limit && self.sent[w] >= min_sends
    }
}

/// The rates look back a day; their rows are kept two (and feedback, as evidence,
/// as long as finished jobs).
const KEPT: Duration = Duration::from_secs(2 * 24 * 3600);

impl Inbox {
    /// Deletes send tallies older than [`KEPT`] and feedback older than that and than
    /// `finished_cutoff` (the finished jobs' retention), `plan.batch` rows per
    /// statement; how many (or, dry, how many would go).
    pub(super) async fn prune_feedback(
        &self,
        finished_cutoff: chrono::DateTime<chrono::Utc>,
        plan: &super::PrunePlan,
        statements: &mut u64,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let kept = i64::try_from(KEPT.as_secs()).unwrap_or(i64::MAX);
        let classes = [
            (
                "postie_send_tally",
                "minute < now() - $1::bigint * interval '1 second' AND $2::timestamptz IS NOT NULL",
            ),
            (
                "postie_feedback",
                "received_at < least(now() - $1::bigint * interval '1 second', $2::timestamptz)",
            ),
        ];
        let mut total = 0u64;
        for (table, old) in classes {
            if plan.dry_run {
                let sql = format!("SELECT count(*) FROM {table} WHERE {old} AND $3::bigint > 0");
                let row = client
                    .query_one(&sql, &[&kept, &finished_cutoff, &plan.batch])
                    .await?;
                total += row.get::<_, i64>(0) as u64;
                continue;
            }
            let sql = format!(
                "DELETE FROM {table} WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM {table} WHERE {old} LIMIT $3))"
            );
            loop {
                let n = client
                    .execute(&sql, &[&kept, &finished_cutoff, &plan.batch])
                    .await?;
                *statements += 1;
                total += n;
                if n < plan.batch as u64 {
                    break;
                }
            }
        }
        Ok(total)
    }

    /// Counts one email of type `kind` sent by this instance (added to the table
    /// within [`FLUSH`]).
    pub(crate) fn count_sent(&self, kind: &str) {
        self.tally.add(kind, 1);
        if self.tally.started.set(()).is_ok() {
            let deadline = self.completer.deadline();
            let tally = Arc::downgrade(&self.tally);
            tokio::spawn(flush_every(self.pool.clone(), tally, deadline));
        }
    }

    /// Adds the sends counted since the last flush now (at a stop).
    pub(crate) async fn flush_sends(&self) {
        flush(&self.pool, &self.tally, self.completer.deadline()).await;
    }

    /// Records a recipient the relay refused permanently at send time (`source`:
    /// the transport's name) as a bounce of job `key`: counted once per key and
    /// address, however often it is tried.
    pub(crate) async fn record_send_bounce(
        &self,
        key: &str,
        kind: &str,
        address: &str,
        source: &str,
        evidence: &str,
    ) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "INSERT INTO postie_feedback
                        (source, notification_id, kind, address, key, type, evidence)
                 VALUES ($1, $2, 'bounce', $3, $2, $4, $5)
                 ON CONFLICT (source, notification_id, address) DO NOTHING",
            )
            .await?;
        client
            .execute(&stmt, &[&source, &key, &address, &kind, &evidence])
            .await?;
        Ok(())
    }

    /// Sends, bounces and complaints per job type over the last hour and day, by
    /// type.
    pub async fn rates(&self) -> Result<Vec<TypeRates>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "WITH sent AS (
                     SELECT type,
                            sum(sent) FILTER (WHERE minute > now() - interval '1 hour') AS hour,
                            sum(sent) AS day
                       FROM postie_send_tally WHERE minute > now() - interval '1 day'
                      GROUP BY type),
                 feedback AS (
                     SELECT coalesce(type, '(unknown)') AS type,
                            count(*) FILTER (WHERE kind = 'bounce'
                                               AND received_at > now() - interval '1 hour') AS bh,
                            count(*) FILTER (WHERE kind = 'bounce') AS bd,
                            count(*) FILTER (WHERE kind = 'complaint'
                                               AND received_at > now() - interval '1 hour') AS ch,
                            count(*) FILTER (WHERE kind = 'complaint') AS cd
                       FROM postie_feedback WHERE received_at > now() - interval '1 day'
                      GROUP BY 1)
                 SELECT type, coalesce(s.hour, 0)::bigint, coalesce(s.day, 0)::bigint,
                        coalesce(bh, 0), coalesce(bd, 0), coalesce(ch, 0), coalesce(cd, 0)
                   FROM sent s FULL JOIN feedback f USING (type)
                  ORDER BY type",
                &[],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(TypeRates {
                    kind: r.try_get(0)?,
                    sent: [r.try_get(1)?, r.try_get(2)?],
                    bounces: [r.try_get(3)?, r.try_get(4)?],
                    complaints: [r.try_get(5)?, r.try_get(6)?],
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_keeps_its_types_apart_up_to_its_bound() {
        let tally = Tally::default();
        for i in 0..TYPES + 10 {
            tally.add(&format!("t{i}"), 1);
        }
        tally.add("t0", 2);
        let counts = tally.take();
        assert_eq!(counts.len(), TYPES + 1, "the bound, and the rest together");
        assert_eq!(counts["t0"], 3);
        assert_eq!(counts[OTHER], 10);
        assert!(tally.take().is_empty(), "taken");
    }

    #[test]
    fn a_rate_needs_a_send() {
        let r = TypeRates {
            kind: "order".into(),
            sent: [0, 200],
            bounces: [0, 10],
            complaints: [0, 1],
        };
        assert_eq!(r.rate(r.bounces, 0), None);
        assert_eq!(r.rate(r.bounces, 1), Some(0.05));
        assert_eq!(r.rate(r.complaints, 1), Some(0.005));
        assert!(r.over(0.05, 1, 0.04, 200) && !r.over(0.05, 1, 0.04, 201));
        assert!(!r.over(0.05, 1, 0.05, 1), "at the threshold is not over it");
    }
}
