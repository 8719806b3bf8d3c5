//! Completions in batches (`batch.rs`): every worker's [`Inbox::complete`] joins a
//! queue, and one task records whatever has queued with one statement, then the next
//! batch.
//!
//! Why: a completion was a round trip and a commit of its own, an email's second
//! statement (the claim is the first), and most of postie's CPU per email was system
//! calls and wake-ups. The batch is the same fenced `UPDATE` as one completion, joined
//! with `unnest` of its rows, so each row keeps its meaning: recorded only while its
//! fence holds. A row that ends in a terminal status gets its delivery event inserted
//! by the same statement (`events.rs`).
//!
//! `Inbox::complete_to` records a send with the recipients its email went to, kept as
//! the row's `recipients` for the feedback's matching (`feedback.rs`).

use std::collections::HashSet;

use deadpool_postgres::Pool;

use super::batch::{Batcher, Running, Statement};
use super::claim::{CompletionRow, COMPLETE};
use super::{Completion, DbError, Inbox};

/// One completion waiting for its batch.
pub(super) struct Pending {
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
        let sent = row.status == super::Status::Sent && !recipients.is_empty();
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
pub(super) struct Completing {
    events: bool,
}

/// The completions' batching task.
pub(super) type Completer = Batcher<Completing>;

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

/// `COMPLETE` over a batch: the rows as arrays, joined with `unnest`; each row's key
/// and fence come back when it was recorded. Terminal rows write their events in the
/// same statement (`$12`: `events.enabled`), and a `rescheduled` row that was not sent
/// ends `scheduled`, as `COMPLETE` does.
const COMPLETE_MANY: &str = concat!(
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
    super::events::events_of_done!("$12"),
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
    pub async fn complete_to(
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
    let stmt = client.prepare_cached(COMPLETE_MANY).await?;
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

/// One completion alone (`COMPLETE`).
async fn record_one(pool: &Pool, pending: &Pending, events: bool) -> Result<bool, DbError> {
    let client = pool.get().await?;
    let stmt = client.prepare_cached(COMPLETE).await?;
    let row = &pending.row;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 13] = [
        &pending.key,
        &pending.fence,
        &row.status,
        &row.attempt,
        &row.error,
        &row.drops_body,
        &row.message_id,
        &row.due_ms,
        &row.provider,
        &row.provider_message_id,
        &row.kind,
        &events,
        &row.recipients,
    ];
    Ok(client.execute(&stmt, &params).await? == 1)
}
