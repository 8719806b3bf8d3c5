//! `complete`: out of `sending`, fenced by the claim's token (only the claim's holder
//! may record), the lease released, in one statement (`COMPLETE`) with the delivery
//! event of a terminal row. Completions run in batches (`batch.rs`): every worker's
//! [`Inbox::complete`] joins a queue, and one task records whatever has queued with
//! one statement, then the next batch; a completion alone is a batch of one.
//!
//! Why: a completion was a round trip and a commit of its own, an email's second
//! statement (the claim is the first), and most of postie's CPU per email was system
//! calls and wake-ups. The batch is the same fenced `UPDATE` as one completion, joined
//! with `unnest` of its rows, so each row keeps its meaning: recorded only while its
//! fence holds.

use std::collections::HashSet;

use deadpool_postgres::Pool;

use super::super::batch::{Batcher, Running, Statement};
use super::super::{DbError, Inbox};
use super::Status;

/// What the holder of a claim records when it lets go of it: the transitions out of
/// `sending`, each a row of the fenced statement (`COMPLETE`).
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

/// The parameters of `COMPLETE` for one completion.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::inbox) struct CompletionRow<'a> {
    pub(in crate::inbox) status: Status,
    /// SMTP attempts to add: 1 if one was made.
    pub(in crate::inbox) attempt: i32,
    pub(in crate::inbox) error: Option<&'a str>,
    pub(in crate::inbox) drops_body: bool,
    pub(in crate::inbox) message_id: Option<&'a str>,
    pub(in crate::inbox) due_ms: Option<i64>,
    pub(in crate::inbox) provider: Option<&'a str>,
    pub(in crate::inbox) provider_message_id: Option<&'a str>,
}

impl<'a> Completion<'a> {
    /// The status the row takes.
    #[cfg(test)]
    pub(crate) fn status(&self) -> Status {
        self.row().status
    }

    pub(in crate::inbox) fn row(&self) -> CompletionRow<'a> {
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

/// One completion waiting for its batch.
pub(in crate::inbox) struct Pending {
    key: String,
    fence: i64,
    row: OwnedRow,
}

/// [`CompletionRow`], owned (it outlives the caller's borrow in the queue).
struct OwnedRow {
    /// The job's type.
    kind: Option<String>,
    status: &'static str,
    attempt: i32,
    error: Option<String>,
    drops_body: bool,
    message_id: Option<String>,
    due_ms: Option<i64>,
    provider: Option<String>,
    provider_message_id: Option<String>,
    /// A send's recipients, one a line (`postie_inbox.recipients`).
    recipients: Option<String>,
}

impl OwnedRow {
    fn new(kind: Option<&str>, row: CompletionRow<'_>, recipients: &[String]) -> Self {
        let sent = row.status == Status::Sent && !recipients.is_empty();
        Self {
            recipients: sent.then(|| recipients.join("\n")),
            kind: kind.map(str::to_owned),
            status: row.status.as_str(),
            attempt: row.attempt,
            error: row.error.map(str::to_owned),
            drops_body: row.drops_body,
            message_id: row.message_id.map(str::to_owned),
            due_ms: row.due_ms,
            provider: row.provider.map(str::to_owned),
            provider_message_id: row.provider_message_id.map(str::to_owned),
        }
    }
}

/// Completions' statement: `events.enabled` (terminal rows write their events).
pub(in crate::inbox) struct Completing {
    events: bool,
}

/// The completions' batching task.
pub(in crate::inbox) type Completer = Batcher<Completing>;

impl Statement for Completing {
    type Row = Pending;
    type Answer = bool;

    fn key(row: &Pending) -> &str {
        &row.key
    }

    fn many<'a>(&'a self, pool: &'a Pool, rows: &'a [Pending]) -> Running<'a, Vec<bool>> {
        Box::pin(record(pool, rows, self.events))
    }

    fn one<'a>(&'a self, pool: &'a Pool, row: &'a Pending) -> Running<'a, bool> {
        Box::pin(record_one(pool, row, self.events))
    }
}

/// `complete` for a batch: the rows as arrays, joined with `unnest`; each row's key
/// and fence come back when it was recorded (its fence held: `fence = c.fence`), the
/// lease released. A send also sets `message_id`, `due_at`, `sent_at`, `provider`,
/// `provider_message_id` and `recipients` (`$13`, one address a line; the other
/// completions keep theirs); `$11` is the job's type (kept if NULL). A terminal status
/// writes its delivery event in the same statement when `$12` (`events.enabled`) is
/// true (`inbox::events`).
///
/// A row the relay `rescheduled` while it was sending (a newer revision recorded,
/// `schedule`, sql/0017) ends `scheduled` unless the send succeeded: the newer
/// revision waits with its due time and body, for its own delivery or the reconciler,
/// and the older one, now stale, gets no terminal status and no event.
const COMPLETE: &str = concat!(
    "WITH done AS (
  UPDATE postie_inbox AS i
    SET status = CASE WHEN i.rescheduled AND c.status <> 'sent' THEN 'scheduled'
                      ELSE c.status END,
        attempts = i.attempts + c.attempt, last_error = c.error,
        body = CASE WHEN c.drops_body AND NOT (i.rescheduled AND c.status <> 'sent') THEN NULL
                    ELSE i.body END,
        rescheduled = false,
        message_id = coalesce(c.message_id, i.message_id),
        due_at = coalesce(to_timestamp(c.due_ms / 1000.0), i.due_at),
        provider = coalesce(c.provider, i.provider),
        provider_message_id = CASE WHEN c.status = 'sent' THEN c.provider_message_id
                                   ELSE i.provider_message_id END,
        recipients = CASE WHEN c.status = 'sent' THEN string_to_array(c.recipients, E'\n')
                          ELSE i.recipients END,
        sent_at = CASE WHEN c.status = 'sent' THEN clock_timestamp() ELSE i.sent_at END,
        type = coalesce(c.kind, i.type),
        announced = CASE WHEN c.status IN ('sent', 'dead', 'suppressed', 'throttled')
                              AND NOT (i.rescheduled AND c.status <> 'sent')
                         THEN c.status ELSE i.announced END,
        owner = NULL, lease_until = NULL, updated_at = now()
   FROM unnest($1::text[], $2::bigint[], $3::text[], $4::int[], $5::text[], $6::bool[],
               $7::text[], $8::bigint[], $9::text[], $10::text[], $11::text[], $13::text[])
        AS c(key, fence, status, attempt, error, drops_body, message_id, due_ms, provider,
             provider_message_id, kind, recipients)
  WHERE i.key = c.key AND i.fence = c.fence
  RETURNING i.key, i.fence, i.status, i.type, i.message_id, i.provider,
            i.provider_message_id, i.last_error, i.attempts, i.sent_at,
            (SELECT o.announced FROM postie_inbox o WHERE o.key = i.key) AS was_announced),
",
    super::super::events::events_of_done!("$12"),
    "
SELECT key, fence FROM done"
);

impl Inbox {
    /// Records what became of the claim `fence` on `key` (see [`Completion`]), in a
    /// batch with the other completions queued meanwhile. `false` means the fence
    /// moved: another instance took the key over meanwhile (for a send, counted as a
    /// possible duplicate), and nothing was recorded.
    ///
    /// `kind`: the job's type, kept on the row and named by its delivery event.
    pub async fn complete(
        &self,
        key: &str,
        fence: i64,
        kind: Option<&str>,
        completion: Completion<'_>,
    ) -> Result<bool, DbError> {
        self.complete_to(key, fence, kind, completion, &[]).await
    }

    /// [`Inbox::complete`], a send recording the addresses its email went to
    /// (`postie_inbox.recipients`, each normalised as the suppression list compares
    /// them; none: not known), so that feedback about an address is matched only to
    /// an email sent to it (issue 45). Other completions ignore `recipients`.
    pub(crate) async fn complete_to(
        &self,
        key: &str,
        fence: i64,
        kind: Option<&str>,
        completion: Completion<'_>,
        recipients: &[String],
    ) -> Result<bool, DbError> {
        let pending = Pending {
            key: key.to_owned(),
            fence,
            row: OwnedRow::new(kind, completion.row(), recipients),
        };
        let events = self.events;
        self.completer
            .run(&self.pool, || Completing { events }, pending)
            .await
    }
}

/// The batch in one statement: whether each row was recorded (its fence held).
async fn record(pool: &Pool, batch: &[Pending], events: bool) -> Result<Vec<bool>, DbError> {
    let client = pool.get().await?;
    let stmt = client.prepare_cached(COMPLETE).await?;
    let column = |f: fn(&Pending) -> Option<String>| batch.iter().map(f).collect::<Vec<_>>();
    let keys: Vec<&str> = batch.iter().map(|p| p.key.as_str()).collect();
    let fences: Vec<i64> = batch.iter().map(|p| p.fence).collect();
    let statuses: Vec<&str> = batch.iter().map(|p| p.row.status).collect();
    let attempts: Vec<i32> = batch.iter().map(|p| p.row.attempt).collect();
    let errors = column(|p| p.row.error.clone());
    let drops: Vec<bool> = batch.iter().map(|p| p.row.drops_body).collect();
    let message_ids = column(|p| p.row.message_id.clone());
    let dues: Vec<Option<i64>> = batch.iter().map(|p| p.row.due_ms).collect();
    let providers = column(|p| p.row.provider.clone());
    let provider_ids = column(|p| p.row.provider_message_id.clone());
    let kinds = column(|p| p.row.kind.clone());
    let recipients = column(|p| p.row.recipients.clone());
    let rows = client
        .query(
            &stmt,
            &[
                &keys,
                &fences,
                &statuses,
                &attempts,
                &errors,
                &drops,
                &message_ids,
                &dues,
                &providers,
                &provider_ids,
                &kinds,
                &events,
                &recipients,
            ],
        )
        .await?;
    let mut recorded = HashSet::with_capacity(rows.len());
    for row in &rows {
        let (key, fence): (&str, i64) = (row.try_get(0)?, row.try_get(1)?);
        recorded.insert((key, fence));
    }
    Ok(batch
        .iter()
        .map(|p| recorded.contains(&(p.key.as_str(), p.fence)))
        .collect())
}

/// One completion alone: a batch of one.
async fn record_one(pool: &Pool, pending: &Pending, events: bool) -> Result<bool, DbError> {
    let recorded = record(pool, std::slice::from_ref(pending), events).await?;
    Ok(recorded.first() == Some(&true))
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
