//! The producers' side of exactly once (issue 31): a transactional outbox in each
//! producer's own PostgreSQL database.
//!
//! - `install.rs`: `postie outbox install`: the schema `postie`, its table
//!   `postie.outbox` and the function `postie.enqueue` (`sql/outbox/`), versioned in
//!   `postie.outbox_version` apart from postie's own migrations, and the grants.
//! - this file: a source (one producer's database, by its `name=`), a batch taken
//!   `FOR UPDATE SKIP LOCKED` and deleted only after its publish succeeded, in one
//!   transaction, and the lag `postie status` shows.
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

/// One row of `postie.outbox`, as the relay publishes it.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// The row's id (the order rows are taken in).
    pub(crate) id: i64,
    /// The job, as JSON text.
    pub(crate) body: Vec<u8>,
    /// When `postie.enqueue` was called, in ms since the epoch: the job's
    /// `postie-published-at`, so its delay counts from the producer's enqueue.
    pub(crate) enqueued_ms: i64,
    /// Due minus enqueued, in ms (≤ 0: at once): the job's `x-delay`.
    pub(crate) delay_ms: i64,
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Batch {
    /// Rows published and deleted.
    pub(crate) rows: usize,
    /// Age of the oldest row taken, in seconds (0 when none).
    pub(crate) oldest_seconds: f64,
}

/// Takes up to `limit` rows, oldest first, that no other relay holds (`postie.take`:
/// `FOR UPDATE SKIP LOCKED`), hands them to `publish`, and deletes them only if it succeeded
/// (every publish confirmed), in one transaction: a failed publish, a lost
/// connection or a killed instance leaves them to the next pass (at least once).
pub(crate) async fn relay_batch<E, F, Fut>(
    client: &mut Client,
    limit: i32,
    publish: F,
) -> Result<Batch, OutboxError<E>>
where
    E: std::error::Error + 'static,
    F: FnOnce(Vec<Row>) -> Fut,
    Fut: Future<Output = Result<(), E>>,
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
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    publish(rows).await.map_err(OutboxError::Publish)?;
    tx.execute("DELETE FROM postie.outbox WHERE id = ANY($1)", &[&ids])
        .await
        .map_err(DbError::from)?;
    tx.commit().await.map_err(DbError::from)?;
    Ok(Batch {
        rows: ids.len(),
        oldest_seconds,
    })
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
}

/// The source's lag: rows waiting, and the oldest one's age.
pub(crate) async fn lag(client: &Client) -> Result<Lag, DbError> {
    let row = client
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM clock_timestamp() - min(enqueued_at)), 0)::float8
               FROM postie.outbox",
            &[],
        )
        .await?;
    Ok(Lag {
        rows: row.try_get(0)?,
        oldest_seconds: row.try_get(1)?,
    })
}
