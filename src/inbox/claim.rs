//! Claiming a key and recording what became of it. Every call is one statement in
//! its own implicit transaction: a claim is committed before the send starts, and a
//! completion (fenced: only the claim's holder may record) before the ack.

use std::time::Duration;

use super::{DbError, Inbox};

/// A job the relay routed into the ladder, to be recorded as scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The idempotency key.
    pub key: String,
    /// Its revision.
    pub revision: i32,
    /// Due time, Unix ms.
    pub due_ms: i64,
    /// The job as published, kept until it is finished so that the reconciler can
    /// re-publish it (None: not kept, `delay.reconcile = false`).
    pub body: Option<Vec<u8>>,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This instance owns the key under `fence`.
    Claimed {
        /// Fencing token: completions must present it.
        fence: i64,
        /// SMTP attempts made before this claim, over the key's lifetime.
        attempts: i32,
        /// True if an expired `sending` lease was taken over: the previous owner may
        /// have sent the email (the one known duplicate window).
        takeover: bool,
    },
    /// Already sent: a duplicate to suppress.
    AlreadySent,
    /// Another instance holds a live lease for `remaining`.
    Busy {
        /// Time left on the other claim.
        remaining: Duration,
    },
    /// A cancel covers this revision.
    Cancelled,
    /// A newer revision of the key has been seen.
    Stale,
}

impl Inbox {
    /// Claims revision `revision` of `key` for `owner` for `lease` (see `postie_claim`
    /// in `sql/0008_claim_in_one_update.sql`, which falls back to 0002's function,
    /// kept as `postie_claim_locked`).
    pub async fn claim(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
        revision: i32,
    ) -> Result<Claim, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "SELECT outcome, fence, attempts, prior_status, wait_ms FROM postie_claim($1, $2, $3, $4)",
            )
            .await?;
        let lease_ms = lease.as_millis() as i64;
        let row = client
            .query_one(&stmt, &[&key, &owner, &lease_ms, &revision])
            .await?;
        let outcome: &str = row.get(0);
        Ok(match outcome {
            "claimed" => Claim::Claimed {
                fence: row.get(1),
                attempts: row.get(2),
                takeover: row.get::<_, &str>(3) == "sending",
            },
            "done" => Claim::AlreadySent,
            "cancelled" => Claim::Cancelled,
            "stale" => Claim::Stale,
            _ => Claim::Busy {
                remaining: Duration::from_millis(row.get::<_, i64>(4).max(1) as u64),
            },
        })
    }

    /// Renews the claim `fence` on `key` for `lease` from now (the database's clock,
    /// as the claim's). `false`: the claim is gone (taken over, or finished), so its
    /// holder must not go on to hand the email over.
    pub async fn renew(&self, key: &str, fence: i64, lease: Duration) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "UPDATE postie_inbox
                    SET lease_until = clock_timestamp() + $3::bigint * interval '1 millisecond'
                  WHERE key = $1 AND fence = $2 AND status = 'sending'",
            )
            .await?;
        let lease_ms = lease.as_millis() as i64;
        Ok(client.execute(&stmt, &[&key, &fence, &lease_ms]).await? == 1)
    }

    /// Ladder mode: records scheduled jobs in one statement and one commit, with
    /// the rules of `postie_schedule` (a newer or equal revision replaces a scheduled,
    /// cancelled-before or retrying row; a sent or in-flight row is left alone). A key
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
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "INSERT INTO postie_inbox AS i (key, status, revision, due_at, body)
                 SELECT k, 'scheduled', r, to_timestamp(d / 1000.0), b
                   FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bytea[]) AS t(k, r, d, b)
                 ON CONFLICT (key) DO UPDATE
                    SET status = 'scheduled', due_at = EXCLUDED.due_at,
                        revision = EXCLUDED.revision, body = EXCLUDED.body,
                        reconciled_at = NULL, arrived_at = NULL, updated_at = now()
                  WHERE i.status IN ('scheduled', 'cancelled', 'retrying')
                    AND EXCLUDED.revision >= i.revision
                    AND (i.cancelled_through IS NULL OR EXCLUDED.revision > i.cancelled_through)",
            )
            .await?;
        client
            .execute(&stmt, &[&keys, &revisions, &dues, &bodies])
            .await?;
        Ok(())
    }

    /// Records a job dropped by the throttle.
    pub async fn mark_throttled(&self, key: &str, fence: i64) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'throttled', updated_at = now(), body = NULL,
                    owner = NULL, lease_until = NULL, last_error = $3
              WHERE key = $1 AND fence = $2",
            key,
            fence,
            "throttled (drop policy)",
        )
        .await
    }

    /// Gives a claim back without an SMTP attempt (the throttle deferred the job).
    pub async fn unclaim(&self, key: &str, fence: i64, why: &str) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'retrying', updated_at = now(),
                    owner = NULL, lease_until = NULL, last_error = $3
              WHERE key = $1 AND fence = $2",
            key,
            fence,
            why,
        )
        .await
    }
    /// Records the send. `false` means the fence moved: another instance took the
    /// key over while this one was sending (counted as a possible duplicate).
    /// `due_ms` (Unix ms) is kept so that `sent_at - due_at` is the lateness.
    pub async fn mark_sent(
        &self,
        key: &str,
        fence: i64,
        message_id: &str,
        due_ms: i64,
    ) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "UPDATE postie_inbox SET status = 'sent', sent_at = clock_timestamp(), body = NULL,
                        updated_at = now(), attempts = attempts + 1, owner = NULL,
                        lease_until = NULL, message_id = $3, last_error = NULL,
                        due_at = to_timestamp($4::bigint / 1000.0)
                  WHERE key = $1 AND fence = $2",
            )
            .await?;
        Ok(client
            .execute(&stmt, &[&key, &fence, &message_id, &due_ms])
            .await?
            == 1)
    }

    /// Records an SMTP attempt that failed transiently and gives the claim back: the
    /// job goes to a retry queue, or (the relay unreachable, the circuit open) is held
    /// until the relay answers. The attempt is recorded either way (the relay may have
    /// accepted it); whether the job's retry cycle is charged is the retry policy's
    /// business, not the inbox's.
    pub async fn mark_retrying(&self, key: &str, fence: i64, error: &str) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'retrying', updated_at = now(),
                    attempts = attempts + 1, owner = NULL, lease_until = NULL, last_error = $3
              WHERE key = $1 AND fence = $2",
            key,
            fence,
            error,
        )
        .await
    }

    /// Records a dead letter after an SMTP attempt.
    pub async fn mark_dead(&self, key: &str, fence: i64, error: &str) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'dead', updated_at = now(), body = NULL,
                    attempts = attempts + 1, owner = NULL, lease_until = NULL, last_error = $3
              WHERE key = $1 AND fence = $2",
            key,
            fence,
            error,
        )
        .await
    }

    async fn complete(
        &self,
        sql: &str,
        key: &str,
        fence: i64,
        text: &str,
    ) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(sql).await?;
        Ok(client.execute(&stmt, &[&key, &fence, &text]).await? == 1)
    }
}
