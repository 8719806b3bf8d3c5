//! Claiming a key and recording what became of it: the inbox's state machine. Every
//! call is one statement in its own implicit transaction: a claim is committed before
//! the send starts, and a completion (fenced: only the claim's holder may record)
//! before the ack.
//!
//! The states of a row and the statement behind each transition are drawn in
//! ARCHITECTURE.md, "The inbox's state machine"; the current SQL of `postie_claim`
//! and of every table is in `sql/schema.sql`. Into `sending`: [`Inbox::claim`]; out
//! of it: [`Inbox::complete`] with a [`Completion`], whose fenced `COMPLETE` is
//! here (a send also records its `provider` and `provider_message_id`). Also here: the
//! relay's scheduled records.

use std::time::Duration;

use super::{DbError, Inbox, Status};

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

/// What the holder of a claim records when it lets go of it: the transitions out of
/// `sending`, each a row of parameters for one fenced statement (`COMPLETE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion<'a> {
    /// The relay accepted the email: `sent`, an attempt counted, the body dropped.
    Sent {
        /// The Message-ID it carried.
        message_id: &'a str,
        /// Its due time (Unix ms), kept so that `sent_at - due_at` is the lateness.
        due_ms: i64,
        /// The transport that accepted it (`transport.providers`' name for it).
        provider: &'a str,
        /// The id the provider's API answered with (none from SMTP).
        provider_message_id: Option<&'a str>,
    },
    /// An SMTP attempt failed transiently (or the relay was unreachable): `retrying`,
    /// the attempt counted (the relay may have accepted it); whether the job's retry
    /// cycle is charged is the retry policy's business, not the inbox's.
    Retrying {
        /// What the attempt met.
        error: &'a str,
    },
    /// Dead-lettered after an SMTP attempt: `dead`, the attempt counted, the body dropped.
    Dead {
        /// Why.
        error: &'a str,
    },
    /// Dropped by its type's throttle (drop policy): `throttled`, the body dropped.
    Throttled,
    /// Every recipient is suppressed: `suppressed`, the body dropped, never sent.
    Suppressed {
        /// Which recipients, and why.
        why: &'a str,
    },
    /// Given back without an SMTP attempt (the throttle's defer policy, a pause before
    /// the send): `retrying`, no attempt counted.
    Unclaimed {
        /// Why it was given back.
        why: &'a str,
    },
}

/// Every completion: fenced (`fence = $2`), the lease released. A send also sets
/// `message_id`, `due_at`, `sent_at`, `provider`, `provider_message_id` and
/// `recipients` (`$13`, one address a line; the other completions keep theirs);
/// `$11` is the job's type (kept if NULL). A terminal status
/// writes its delivery event in the same statement when `$12` (`events.enabled`)
/// is true (`inbox::events`). One row back if recorded.
///
/// A row the relay `rescheduled` while it was sending (a newer revision recorded,
/// `Inbox::schedule_many`, sql/0017) ends `scheduled` unless the send succeeded: the
/// newer revision waits with its due time and body, for its own delivery or the
/// reconciler, and the older one, now stale, gets no terminal status and no event.
pub(super) const COMPLETE: &str = concat!(
    "WITH done AS (
  UPDATE postie_inbox
    SET status = CASE WHEN rescheduled AND $3::text <> 'sent' THEN 'scheduled'
                      ELSE $3::text END,
        attempts = attempts + $4::int, last_error = $5::text,
        body = CASE WHEN $6::bool AND NOT (rescheduled AND $3::text <> 'sent') THEN NULL
                    ELSE body END,
        rescheduled = false,
        message_id = coalesce($7::text, message_id),
        due_at = coalesce(to_timestamp($8::bigint / 1000.0), due_at),
        provider = coalesce($9::text, provider),
        provider_message_id = CASE WHEN $3::text = 'sent' THEN $10::text
                                   ELSE provider_message_id END,
        recipients = CASE WHEN $3::text = 'sent' THEN string_to_array($13::text, E'\n')
                          ELSE recipients END,
        sent_at = CASE WHEN $3::text = 'sent' THEN clock_timestamp() ELSE sent_at END,
        type = coalesce($11::text, type),
        announced = CASE WHEN $3::text IN ('sent', 'dead', 'suppressed', 'throttled')
                              AND NOT (rescheduled AND $3::text <> 'sent')
                         THEN $3::text ELSE announced END,
        owner = NULL, lease_until = NULL, updated_at = now()
  WHERE key = $1 AND fence = $2
  RETURNING key, status, type, message_id, provider, provider_message_id, last_error,
            attempts, sent_at,
            (SELECT o.announced FROM postie_inbox o WHERE o.key = $1) AS was_announced),
",
    super::events::events_of_done!("$12"),
    "
SELECT key FROM done"
);

/// The parameters of `COMPLETE` for one completion.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct CompletionRow<'a> {
    pub(super) status: Status,
    /// SMTP attempts to add: 1 if one was made.
    pub(super) attempt: i32,
    pub(super) error: Option<&'a str>,
    pub(super) drops_body: bool,
    pub(super) message_id: Option<&'a str>,
    pub(super) due_ms: Option<i64>,
    pub(super) provider: Option<&'a str>,
    pub(super) provider_message_id: Option<&'a str>,
}

impl<'a> Completion<'a> {
    /// The status the row takes.
    #[cfg(test)]
    pub(crate) fn status(&self) -> Status {
        self.row().status
    }

    pub(super) fn row(&self) -> CompletionRow<'a> {
        let row = |status, attempt, error, drops_body| CompletionRow {
            status,
            attempt,
            error,
            drops_body,
            message_id: None,
            due_ms: None,
            provider: None,
            provider_message_id: None,
        };
        match *self {
            Self::Sent {
                message_id,
                due_ms,
                provider,
                provider_message_id,
            } => CompletionRow {
                message_id: Some(message_id),
                due_ms: Some(due_ms),
                provider: Some(provider),
                provider_message_id,
                ..row(Status::Sent, 1, None, true)
            },
            Self::Retrying { error } => row(Status::Retrying, 1, Some(error), false),
            Self::Dead { error } => row(Status::Dead, 1, Some(error), true),
            Self::Throttled => row(Status::Throttled, 0, Some("throttled (drop policy)"), true),
            Self::Suppressed { why } => row(Status::Suppressed, 0, Some(why), true),
            Self::Unclaimed { why } => row(Status::Retrying, 0, Some(why), false),
        }
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This instance owns the key under `fence`.
    Claimed {
        /// Fencing token: completions must present it.
        fence: i64,
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
    /// Renews the claim `fence` on `key` for `lease` from now (the database's clock,
    /// as the claim's). `false`: the claim is gone (taken over, or finished), so its
    /// holder must not go on to hand the email over.
    pub(crate) async fn renew(
        &self,
        key: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
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
        let stmt = client
            .prepare_cached(
                "INSERT INTO postie_inbox AS i (key, status, revision, due_at, body, lane)
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
                    AND (i.cancelled_through IS NULL OR EXCLUDED.revision > i.cancelled_through)",
            )
            .await?;
        client
            .execute(&stmt, &[&keys, &revisions, &dues, &bodies, &lanes])
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_completion_is_one_row_of_the_fenced_statement() {
        let sent = Completion::Sent {
            message_id: "<m@x>",
            due_ms: 7,
            provider: "ses",
            provider_message_id: Some("0100-id"),
        };
        assert_eq!(
            sent.row(),
            CompletionRow {
                status: Status::Sent,
                attempt: 1,
                error: None,
                drops_body: true,
                message_id: Some("<m@x>"),
                due_ms: Some(7),
                provider: Some("ses"),
                provider_message_id: Some("0100-id"),
            }
        );
        let table = [
            (
                Completion::Retrying { error: "451" },
                Status::Retrying,
                1,
                Some("451"),
                false,
            ),
            (
                Completion::Dead { error: "550" },
                Status::Dead,
                1,
                Some("550"),
                true,
            ),
            (
                Completion::Throttled,
                Status::Throttled,
                0,
                Some("throttled (drop policy)"),
                true,
            ),
            (
                Completion::Suppressed {
                    why: "a@x: hard_bounce",
                },
                Status::Suppressed,
                0,
                Some("a@x: hard_bounce"),
                true,
            ),
            (
                Completion::Unclaimed { why: "later" },
                Status::Retrying,
                0,
                Some("later"),
                false,
            ),
        ];
        for (completion, status, attempt, error, drops_body) in table {
            let row = completion.row();
            assert_eq!(
                (row.status, row.attempt, row.error, row.drops_body),
                (status, attempt, error, drops_body),
                "{completion:?}"
            );
            assert_eq!((row.message_id, row.due_ms), (None, None));
            assert_eq!((row.provider, row.provider_message_id), (None, None));
            assert_eq!(completion.status(), status);
        }
    }
}
