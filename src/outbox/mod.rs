//! The producers' side of exactly once (issue 31): a transactional outbox in each
//! producer's own PostgreSQL database.
//!
//! - `install.rs`: `postie outbox install`: the schema `postie`, its table
//!   `postie.outbox` and the function `postie.enqueue` (`sql/outbox/`), versioned in
//!   `postie.outbox_version` apart from postie's own migrations, and the grants.
//! - this file: a source (`Source`: one producer's database, by its `name=`, with its
//!   `Dialer` and its LISTEN connection); a batch (`relay_batch`: `postie.take`,
//!   `FOR UPDATE SKIP LOCKED`, handed to the caller's publish), deleted only after
//!   its publish succeeded, in one transaction, the rows its publish refused for good
//!   moved to `postie.outbox_rejected` (`postie.reject`) in the same transaction,
//!   committed only if it succeeded; `version`; and the lag `postie status` shows,
//!   with the rows set aside.
//!
//! The relay that publishes the batches runs in `postie serve`'s session
//! (`consume::outbox`), on the session's confirm channel.

mod install;

use std::future::Future;

use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::config::{DatabaseSettings, OutboxSource};
use crate::inbox::{DbError, Dialer, OutboxError};

pub(crate) use install::{install, Grants};

/// The channel `postie.enqueue` notifies at each enqueue (delivered at commit).
pub(crate) const CHANNEL: &str = "postie_outbox";

/// One producer's database; cheap to clone.
#[derive(Clone)]
pub(crate) struct Source {
    /// Its name (`name=`, else `source<n>`): logs, metrics, `/readyz`, status.
    pub(crate) name: String,
    /// Its URL redacted, for the log lines of its outages.
    pub(crate) shown: String,
    dialer: Dialer,
}

impl Source {
    /// The source validation parsed, connected as `database.*` says (timeouts, TLS).
    pub(crate) fn new(parsed: &OutboxSource, settings: &DatabaseSettings) -> anyhow::Result<Self> {
        Ok(Self {
            name: parsed.name.clone(),
            shown: parsed.shown.clone(),
            dialer: Dialer::new(&parsed.plan, settings, "postie-outbox")?,
        })
    }

    /// A connection for batches and the lag.
    pub(crate) async fn connect(&self) -> Result<Client, DbError> {
        self.dialer.connect().await
    }

    /// A connection that listens on [`CHANNEL`]: each notification puts a token in
    /// `wake`, whose receiver sees `None` once the connection is gone.
    pub(crate) async fn listen(&self, wake: mpsc::Sender<()>) -> Result<Client, DbError> {
        let client = self.dialer.connect_listening(wake).await?;
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        Ok(client)
    }
}

/// The outbox version from which a source has `postie.reject` and
/// `postie.outbox_rejected` (`sql/outbox/0003_refusals.sql`).
pub(crate) const REJECTS_FROM: i32 = 3;

/// One row of `postie.outbox`, as the relay publishes it.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// The row's id (the order rows are taken in).
    pub(crate) id: i64,
    /// The job, as JSON text.
    pub(crate) body: Vec<u8>,
    /// When `postie.enqueue` was called, in ms since the epoch: the job's
    /// `postie-published-at`, so its delay counts from the producer's enqueue.
    /// `None`: a time `postie.take` could not compute (not finite).
    pub(crate) enqueued_ms: Option<i64>,
    /// Due minus enqueued, in ms (≤ 0: at once): the job's `x-delay`; `None` as above
    /// (a row due at `'infinity'`, enqueued before version 3 refused it).
    pub(crate) delay_ms: Option<i64>,
}

/// A row its publish refused for good, and why: moved to `postie.outbox_rejected`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused {
    /// The row's id.
    pub(crate) id: i64,
    /// Why, for a person (the broker's words, or postie's).
    pub(crate) reason: String,
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Batch {
    /// Rows published and deleted.
    pub(crate) rows: usize,
    /// Rows refused for good and moved to `postie.outbox_rejected`.
    pub(crate) rejected: usize,
    /// Age of the oldest row taken, in seconds (0 when none).
    pub(crate) oldest_seconds: f64,
}

/// Takes up to `limit` rows, oldest first, that no other relay holds (`postie.take`:
/// `FOR UPDATE SKIP LOCKED`), hands them to `publish`, and, if it succeeded (every
/// publish confirmed but those it names as refused for good), deletes the published
/// ones and moves the refused ones to `postie.outbox_rejected` (`postie.reject`), in
/// one transaction: a failed publish, a lost connection or a killed instance leaves
/// them all to the next pass (at least once).
pub(crate) async fn relay_batch<E, F, Fut>(
    client: &mut Client,
    limit: i32,
    publish: F,
) -> Result<Batch, OutboxError<E>>
where
    E: std::error::Error + 'static,
    F: FnOnce(Vec<Row>) -> Fut,
    Fut: Future<Output = Result<Vec<Refused>, E>>,
{
    let tx = client.transaction().await.map_err(DbError::from)?;
    let found = tx
        .query("SELECT * FROM postie.take($1)", &[&limit])
        .await
        .map_err(DbError::from)?;
    let mut rows = Vec::with_capacity(found.len());
    let mut oldest_seconds = 0f64;
    for row in &found {
        let body: String = row.try_get(1).map_err(DbError::from)?;
        oldest_seconds = oldest_seconds.max(row.try_get(4).map_err(DbError::from)?);
        rows.push(Row {
            id: row.try_get(0).map_err(DbError::from)?,
            body: body.into_bytes(),
            enqueued_ms: row.try_get(2).map_err(DbError::from)?,
            delay_ms: row.try_get(3).map_err(DbError::from)?,
        });
    }
    if rows.is_empty() {
        return Ok(Batch::default());
    }
    let taken: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let refused = publish(rows).await.map_err(OutboxError::Publish)?;
    let published: Vec<i64> = (taken.iter().copied())
        .filter(|id| !refused.iter().any(|r| r.id == *id))
        .collect();
    tx.execute(
        "DELETE FROM postie.outbox WHERE id = ANY($1)",
        &[&published],
    )
    .await
    .map_err(DbError::from)?;
    for Refused { id, reason } in &refused {
        tx.execute("SELECT postie.reject($1, $2)", &[id, reason])
            .await
            .map_err(DbError::from)?;
    }
    tx.commit().await.map_err(DbError::from)?;
    Ok(Batch {
        rows: published.len(),
        rejected: refused.len(),
        oldest_seconds,
    })
}

/// The source's outbox version (`postie.outbox_version`): below [`REJECTS_FROM`], a
/// refused row cannot be set aside.
pub(crate) async fn version(client: &Client) -> Result<i32, DbError> {
    let row = client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM postie.outbox_version",
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// The age in seconds of the source's oldest row by id (0 when none): one index
/// probe, for the gauge while rows cannot be published.
pub(crate) async fn oldest_seconds(client: &Client) -> Result<f64, DbError> {
    let row = client
        .query_opt(
            "SELECT extract(epoch FROM clock_timestamp() - enqueued_at)::float8
               FROM postie.outbox ORDER BY id LIMIT 1",
            &[],
        )
        .await?;
    Ok(match row {
        Some(row) => row.try_get(0)?,
        None => 0.0,
    })
}

/// What waits in a source's outbox.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Lag {
    /// Rows not yet relayed.
    pub(crate) rows: i64,
    /// Age of the oldest, in seconds (0 when none).
    pub(crate) oldest_seconds: f64,
    /// Rows set aside in `postie.outbox_rejected` (0 before version 3).
    pub(crate) rejected: i64,
}

/// The source's lag: rows waiting, the oldest one's age, and the rows set aside.
pub(crate) async fn lag(client: &Client) -> Result<Lag, DbError> {
    let row = client
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM clock_timestamp() - min(enqueued_at)), 0)::float8,
                    to_regclass('postie.outbox_rejected') IS NOT NULL
               FROM postie.outbox",
            &[],
        )
        .await?;
    let rejected = match row.try_get(2)? {
        true => {
            let count = "SELECT count(*) FROM postie.outbox_rejected";
            client.query_one(count, &[]).await?.try_get(0)?
        }
        false => 0,
    };
    Ok(Lag {
        rows: row.try_get(0)?,
        oldest_seconds: row.try_get(1)?,
        rejected,
    })
}
