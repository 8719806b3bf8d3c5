//! The PostgreSQL inbox: one row per idempotency key, claimed before any email
//! leaves and completed (fenced) before the delivery is acked.
//!
//! Every call is a single statement in its own implicit transaction, so a claim is
//! committed before the send starts and a completion is committed before the ack.

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use secrecy::{ExposeSecret, SecretString};
use tokio_postgres::NoTls;

use crate::config::{redact_url, DatabaseSettings};

/// The migrations in `sql/`, applied in order, each once.
const MIGRATIONS: &[(i32, &str, &str)] = &[(1, "inbox", include_str!("../sql/0001_inbox.sql"))];

/// Arbitrary constant for `pg_advisory_lock`, so concurrent start-ups migrate one at a time.
const MIGRATION_LOCK: i64 = 0x706f_7374_6965; // "postie"

/// PostgreSQL could not be reached or refused a statement. Never the job's fault.
#[derive(Debug, thiserror::Error)]
#[error("database: {0}")]
pub struct DbError(String);

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        // The Display of a db error carries the server message; of an io error, the cause.
        Self(match e.as_db_error() {
            Some(db) => format!("{}: {}", db.code().code(), db.message()),
            None => match std::error::Error::source(&e) {
                Some(cause) => format!("{e}: {cause}"),
                None => e.to_string(),
            },
        })
    }
}

impl From<deadpool_postgres::PoolError> for DbError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => Self(other.to_string()),
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
}

/// Counts for `postie status`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct InboxCounts {
    /// Rows by status, sorted by status.
    pub by_status: Vec<(String, i64)>,
    /// Suppressed duplicate deliveries, summed.
    pub duplicates: i64,
    /// Expired leases taken over, summed.
    pub takeovers: i64,
}

/// A pool of connections to the inbox database.
#[derive(Clone)]
pub struct Inbox {
    pool: Pool,
}

impl Inbox {
    /// Builds the pool (lazily connected).
    pub fn new(settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let url = settings.url.expose_secret();
        let mut pg = tokio_postgres::Config::from_str(url)
            .map_err(|e| anyhow::anyhow!("database.url {} is not valid: {e}", redact_url(url)))?;
        pg.connect_timeout(settings.connect_timeout);
        pg.application_name("postie");
        let manager = Manager::from_config(
            pg,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.connect_timeout))
            .runtime(Runtime::Tokio1)
            .build()?;
        Ok(Self { pool })
    }

    /// Connects once and fails with a line naming the (redacted) URL.
    pub async fn check(&self, url: &SecretString) -> anyhow::Result<()> {
        let client = self.pool.get().await.map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to PostgreSQL at {}: {}",
                redact_url(url.expose_secret()),
                DbError::from(e)
            )
        })?;
        client.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Applies pending migrations under an advisory lock.
    pub async fn migrate(&self) -> Result<Vec<String>, DbError> {
        let mut client = self.pool.get().await?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        let result = async {
            client
                .batch_execute(
                    "CREATE TABLE IF NOT EXISTS postie_migrations (
                        version integer PRIMARY KEY,
                        name text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT now())",
                )
                .await?;
            let mut applied = Vec::new();
            for (version, name, sql) in MIGRATIONS {
                let done = client
                    .query_opt(
                        "SELECT 1 FROM postie_migrations WHERE version = $1",
                        &[version],
                    )
                    .await?
                    .is_some();
                if done {
                    continue;
                }
                let tx = client.transaction().await?;
                tx.batch_execute(sql).await?;
                tx.execute(
                    "INSERT INTO postie_migrations (version, name) VALUES ($1, $2)",
                    &[version, name],
                )
                .await?;
                tx.commit().await?;
                applied.push(format!("{version:04}_{name}"));
            }
            Ok::<_, DbError>(applied)
        }
        .await;
        client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await?;
        result
    }

    /// Claims `key` for `owner` for `lease` (see `postie_claim` in `sql/0001_inbox.sql`).
    pub async fn claim(&self, key: &str, owner: &str, lease: Duration) -> Result<Claim, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached("SELECT outcome, fence, attempts, prior_status, wait_ms FROM postie_claim($1, $2, $3)")
            .await?;
        let lease_ms = lease.as_millis() as i64;
        let row = client.query_one(&stmt, &[&key, &owner, &lease_ms]).await?;
        let outcome: &str = row.get(0);
        Ok(match outcome {
            "claimed" => Claim::Claimed {
                fence: row.get(1),
                attempts: row.get(2),
                takeover: row.get::<_, &str>(3) == "sending",
            },
            "done" => Claim::AlreadySent,
            _ => Claim::Busy {
                remaining: Duration::from_millis(row.get::<_, i64>(4).max(1) as u64),
            },
        })
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
                "UPDATE postie_inbox SET status = 'sent', sent_at = clock_timestamp(),
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

    /// Records a transient failure; the job goes to a retry queue.
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

    /// Gives a claim back without counting an attempt (the relay was unreachable
    /// and the job is held until it answers).
    pub async fn release(&self, key: &str, fence: i64, error: &str) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'retrying', updated_at = now(),
                    owner = NULL, lease_until = NULL, last_error = $3
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
            "UPDATE postie_inbox SET status = 'dead', updated_at = now(),
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

    /// Counts by status, and the duplicate and takeover totals.
    pub async fn counts(&self) -> Result<InboxCounts, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint,
                        coalesce(sum(takeovers), 0)::bigint
                   FROM postie_inbox GROUP BY status ORDER BY status",
                &[],
            )
            .await?;
        let mut counts = InboxCounts::default();
        for row in rows {
            counts.by_status.push((row.get(0), row.get(1)));
            counts.duplicates += row.get::<_, i64>(2);
            counts.takeovers += row.get::<_, i64>(3);
        }
        Ok(counts)
    }

    /// The pool, for tests and tools that need plain SQL.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}
