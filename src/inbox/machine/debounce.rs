//! `debounce`: a debounced job's version arrives (the worker, on its first sight of
//! it): into `scheduled` from no row, from `scheduled`, `retrying` and `cancelled`,
//! and from a finished `dead`, `throttled` or `suppressed` row, as a new revision
//! postie assigns (one more than the row's), due at its arrival + `wait` but never
//! past the series' first arrival + `max_wait`, its body the one kept; a `sending`
//! row is marked `rescheduled` with it (as `schedule` does), so the email being
//! sent is not replaced: if that send succeeds, this version is a duplicate of a
//! sent key. A `sent` row is left alone, and so is a row whose latest version
//! arrived after this one (this one is stale).
//!
//! Every copy of an older revision, wherever it is (the ladder, a retry queue, a
//! worker's hold), is then stale at its claim; the new revision's copy carries its
//! number in the sealed `postie-revision` header.

use super::super::{DbError, Inbox};

/// One version of a debounced job, as it arrives.
#[derive(Debug, Clone)]
pub struct Debouncing<'a> {
    /// The idempotency key.
    pub key: &'a str,
    /// The revision the producer gave it (a floor for postie's).
    pub revision: i32,
    /// When it arrived: its own due time (publish time, `x-delay`, `send_at`), Unix ms.
    pub arrival_ms: i64,
    /// `wait`, ms.
    pub wait_ms: i64,
    /// `max_wait`, ms, counted from the series' first arrival.
    pub max_wait_ms: Option<i64>,
    /// Its body, kept for the reconciler (`delay.reconcile`).
    pub body: Option<&'a [u8]>,
    /// Its lane, `None` for the default.
    pub lane: Option<&'a str>,
}

/// What became of one version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Debounced {
    /// It is the pending version now: `revision`, due at `due_ms`.
    Replaced {
        /// The revision postie gave it.
        revision: i32,
        /// Its due time, Unix ms.
        due_ms: i64,
    },
    /// The key was sent already.
    AlreadySent,
    /// A later version had arrived already.
    Stale,
}

/// The series continues while the row is pending (`scheduled`, `retrying`,
/// `sending`); otherwise this version starts one. One statement: the row's answer,
/// or, when it was left alone, why.
const DEBOUNCE: &str = "WITH arrival AS (SELECT to_timestamp($3::bigint / 1000.0) AS at),
 up AS (
 INSERT INTO postie_inbox AS i (key, status, revision, due_at, body, lane,
                                debounce_first_at, debounce_last_at)
 SELECT $1, 'scheduled', $2,
        a.at + least($4::bigint, coalesce($5::bigint, $4::bigint)) * interval '1 millisecond',
        $6, $7, a.at, a.at
   FROM arrival a
 ON CONFLICT (key) DO UPDATE
    SET status = CASE WHEN i.status = 'sending' THEN 'sending' ELSE 'scheduled' END,
        rescheduled = (i.status = 'sending'),
        revision = greatest(i.revision + 1, EXCLUDED.revision),
        debounce_first_at = CASE WHEN i.status IN ('scheduled', 'retrying', 'sending')
                                 THEN coalesce(i.debounce_first_at, EXCLUDED.debounce_first_at)
                                 ELSE EXCLUDED.debounce_first_at END,
        debounce_last_at = EXCLUDED.debounce_last_at,
        due_at = least(EXCLUDED.debounce_last_at + $4::bigint * interval '1 millisecond',
                       CASE WHEN i.status IN ('scheduled', 'retrying', 'sending')
                            THEN coalesce(i.debounce_first_at, EXCLUDED.debounce_first_at)
                            ELSE EXCLUDED.debounce_first_at END
                       + $5::bigint * interval '1 millisecond'),
        body = EXCLUDED.body, lane = EXCLUDED.lane,
        reconciled_at = NULL, arrived_at = NULL, updated_at = now()
  WHERE i.status <> 'sent'
    AND (i.debounce_last_at IS NULL OR EXCLUDED.debounce_last_at >= i.debounce_last_at)
 RETURNING i.revision, (extract(epoch FROM i.due_at) * 1000)::bigint AS due_ms)
SELECT 'replaced', revision, due_ms FROM up
UNION ALL
SELECT CASE WHEN p.status = 'sent' THEN 'sent' ELSE 'stale' END, p.revision, 0::bigint
  FROM postie_inbox p WHERE p.key = $1 AND NOT EXISTS (SELECT 1 FROM up)";

impl Inbox {
    /// Records one version of a debounced job (see the module's doc). A row locked
    /// by another statement is waited for; versions of one key are thus ordered.
    pub async fn debounce(&self, version: &Debouncing<'_>) -> Result<Debounced, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(DEBOUNCE).await?;
        let row = client
            .query_opt(
                &stmt,
                &[
                    &version.key,
                    &version.revision,
                    &version.arrival_ms,
                    &version.wait_ms,
                    &version.max_wait_ms,
                    &version.body,
                    &version.lane,
                ],
            )
            .await?;
        // No row at all: the key was inserted by another statement after this one
        // began and this version lost to it; the same as a later version.
        let Some(row) = row else {
            return Ok(Debounced::Stale);
        };
        let outcome: &str = row.get(0);
        Ok(match outcome {
            "replaced" => Debounced::Replaced {
                revision: row.get(1),
                due_ms: row.get(2),
            },
            "sent" => Debounced::AlreadySent,
            _ => Debounced::Stale,
        })
    }
}
