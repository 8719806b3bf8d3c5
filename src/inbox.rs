//! The PostgreSQL inbox: one row per idempotency key, claimed before any email
//! leaves and completed (fenced) before the delivery is acked.
//!
//! Every call is a single statement in its own implicit transaction, so a claim is
//! committed before the send starts and a completion is committed before the ack.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use secrecy::{ExposeSecret, SecretString};
use tokio_postgres::NoTls;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::{database_plan, redact_url, DatabaseSettings, DbTls};

/// The migrations in `sql/`, applied in order, each once.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "inbox", include_str!("../sql/0001_inbox.sql")),
    (
        2,
        "cancel_throttle_pending",
        include_str!("../sql/0002_cancel_throttle_pending.sql"),
    ),
    (
        3,
        "drop_status_index",
        include_str!("../sql/0003_drop_status_index.sql"),
    ),
];

/// Arbitrary constant for `pg_advisory_lock`, so concurrent start-ups migrate one at a time.
const MIGRATION_LOCK: i64 = 0x706f_7374_6965; // "postie"

/// PostgreSQL could not be reached, or refused a statement.
#[derive(Debug, thiserror::Error)]
#[error("database: {message}")]
pub struct DbError {
    message: String,
    /// The SQLSTATE class (first two characters), when the server answered.
    class: Option<String>,
}

impl DbError {
    /// True when the database itself is unavailable (no answer, connection errors,
    /// shutdown, resource exhaustion, serialization conflicts): not the job's fault,
    /// so wait and retry. False when the server refused the statement for what it
    /// carried (e.g. class 22, a value out of range), which no retry can fix.
    pub fn is_outage(&self) -> bool {
        match self.class.as_deref() {
            None => true,
            Some(class) => matches!(class, "08" | "40" | "53" | "55" | "57" | "58" | "XX"),
        }
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        // The Display of a db error carries the server message; of an io error, the cause.
        match e.as_db_error() {
            Some(db) => Self {
                message: format!("{}: {}", db.code().code(), db.message()),
                class: Some(db.code().code().chars().take(2).collect()),
            },
            None => Self {
                message: match std::error::Error::source(&e) {
                    Some(cause) => format!("{e}: {cause}"),
                    None => e.to_string(),
                },
                class: None,
            },
        }
    }
}

impl From<deadpool_postgres::PoolError> for DbError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => Self {
                message: other.to_string(),
                class: None,
            },
        }
    }
}

/// The rustls client configuration for `tls` (ring; TLS 1.2 and 1.3).
fn tls_config(tls: DbTls, ca_file: Option<&Path>) -> anyhow::Result<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| anyhow::anyhow!("database.ca_file {}: {e}", path.display()))?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            anyhow::bail!(
                "database.ca_file {} holds no usable certificate",
                path.display()
            );
        }
    }
    if tls == DbTls::VerifyFull {
        let native = rustls_native_certs::load_native_certs();
        for error in &native.errors {
            tracing::debug!(%error, "loading the system's root certificates");
        }
        roots.add_parsable_certificates(native.certs);
    }
    if roots.is_empty() {
        anyhow::bail!(
            "no root certificates to verify PostgreSQL's certificate: the system has none; \
             set database.ca_file"
        );
    }
    let verifier =
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let builder =
        ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    Ok(match tls {
        DbTls::VerifyCa => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly(verifier)))
            .with_no_client_auth(),
        _ => builder.with_webpki_verifier(verifier).with_no_client_auth(),
    })
}

/// `sslmode=verify-ca`: the full WebPKI check (chain to `database.ca_file`, validity,
/// usage), except that a certificate issued for another name is accepted. webpki
/// checks the name last, so that error means everything else passed.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
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
    /// A cancel covers this revision.
    Cancelled,
    /// A newer revision of the key has been seen.
    Stale,
}

/// What `postie cancel` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// The key's status before the cancel (`new` if unknown: a tombstone now).
    pub prior_status: String,
    /// The highest revision the cancel covers.
    pub covers: i32,
}

/// The throttle's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Throttle {
    /// Under the limit; the send is counted.
    Allowed,
    /// Over the limit until `next_ms` (Unix ms).
    Limited {
        /// When the window allows the next one.
        next_ms: i64,
    },
}

/// One scheduled job (ladder mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    /// The key.
    pub key: String,
    /// Its revision.
    pub revision: i32,
    /// Due time, Unix ms.
    pub due_ms: i64,
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
    /// Builds the pool (lazily connected). TLS follows `sslmode` in the URL (see
    /// [`database_plan`]): refused without TLS to a host that is not this machine unless
    /// `allow_plaintext`; with TLS, the server's certificate is always verified.
    pub fn new(settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let plan = database_plan(
            settings.url.expose_secret(),
            settings.allow_plaintext,
            settings.ca_file(),
        )?;
        let mut pg = plan.config;
        pg.connect_timeout(settings.connect_timeout);
        pg.application_name("postie");
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match plan.tls {
            DbTls::Off => Manager::from_config(pg, NoTls, manager_config),
            tls => Manager::from_config(
                pg,
                MakeRustlsConnect::new(tls_config(tls, settings.ca_file())?),
                manager_config,
            ),
        };
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

    /// Claims revision `revision` of `key` for `owner` for `lease` (see `postie_claim`
    /// in `sql/0002_cancel_throttle_pending.sql`).
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

    /// Cancels `key` up to `revision` (None: the newest seen); a tombstone if unknown.
    pub async fn cancel(&self, key: &str, revision: Option<i32>) -> Result<Cancelled, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached("SELECT prior_status, covers FROM postie_cancel($1, $2)")
            .await?;
        let row = client.query_one(&stmt, &[&key, &revision]).await?;
        Ok(Cancelled {
            prior_status: row.get(0),
            covers: row.get(1),
        })
    }

    /// Ladder mode: records a job the relay scheduled (pending visibility).
    pub async fn schedule(&self, key: &str, revision: i32, due_ms: i64) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached("SELECT postie_schedule($1, $2, $3)")
            .await?;
        client.execute(&stmt, &[&key, &revision, &due_ms]).await?;
        Ok(())
    }

    /// Takes one send of `kind` to `recipient` under `limit` per `window`, in one
    /// atomic statement (the row lock of `ON CONFLICT DO UPDATE` serialises
    /// instances): the update happens only if the window has room.
    pub async fn throttle(
        &self,
        kind: &str,
        recipient: &str,
        limit: u32,
        window: Duration,
    ) -> Result<Throttle, DbError> {
        let client = self.pool.get().await?;
        let window_ms = window.as_millis() as i64;
        let limit = i64::from(limit);
        let take = client
            .prepare_cached(
                "INSERT INTO postie_throttle AS t (kind, recipient, sends)
                 VALUES ($1, $2, ARRAY[clock_timestamp()])
                 ON CONFLICT (kind, recipient) DO UPDATE
                    SET sends = ARRAY(SELECT s FROM unnest(t.sends) s
                                       WHERE s > clock_timestamp() - $3::bigint * interval '1 millisecond')
                                || clock_timestamp()
                  WHERE (SELECT count(*) FROM unnest(t.sends) s
                          WHERE s > clock_timestamp() - $3::bigint * interval '1 millisecond') < $4
                 RETURNING 1",
            )
            .await?;
        if client
            .query_opt(&take, &[&kind, &recipient, &window_ms, &limit])
            .await?
            .is_some()
        {
            return Ok(Throttle::Allowed);
        }
        let next = client
            .prepare_cached(
                "SELECT (extract(epoch FROM min(s)) * 1000)::bigint + $3::bigint
                   FROM postie_throttle t, unnest(t.sends) s
                  WHERE t.kind = $1 AND t.recipient = $2
                    AND s > clock_timestamp() - $3 * interval '1 millisecond'",
            )
            .await?;
        let row = client
            .query_one(&next, &[&kind, &recipient, &window_ms])
            .await?;
        let next_ms: Option<i64> = row.get(0);
        Ok(Throttle::Limited {
            next_ms: next_ms.unwrap_or_else(|| chrono::Utc::now().timestamp_millis()),
        })
    }

    /// Records a job dropped by the throttle.
    pub async fn mark_throttled(&self, key: &str, fence: i64) -> Result<bool, DbError> {
        self.complete(
            "UPDATE postie_inbox SET status = 'throttled', updated_at = now(),
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

    /// Scheduled jobs (ladder mode), soonest first.
    pub async fn pending(
        &self,
        due_before_ms: Option<i64>,
        key: Option<&str>,
        limit: i64,
    ) -> Result<(Vec<PendingJob>, i64), DbError> {
        let client = self.pool.get().await?;
        let filter = "status = 'scheduled'
                      AND ($1::bigint IS NULL OR due_at < to_timestamp($1::bigint / 1000.0))
                      AND ($2::text IS NULL OR key = $2)";
        let rows = client
            .query(
                &format!(
                    "SELECT key, revision, (extract(epoch FROM due_at) * 1000)::bigint
                       FROM postie_inbox WHERE {filter} ORDER BY due_at, key LIMIT $3"
                ),
                &[&due_before_ms, &key, &limit],
            )
            .await?;
        let total: i64 = client
            .query_one(
                &format!("SELECT count(*) FROM postie_inbox WHERE {filter}"),
                &[&due_before_ms, &key],
            )
            .await?
            .get(0);
        let jobs = rows
            .iter()
            .map(|r| PendingJob {
                key: r.get(0),
                revision: r.get(1),
                due_ms: r.get(2),
            })
            .collect();
        Ok((jobs, total))
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

    /// Gives a claim back when the relay was unreachable and the job is held until
    /// it answers. The SMTP attempt is recorded (the relay may have accepted it), but
    /// the job's retry cycle is not charged for it.
    pub async fn release(&self, key: &str, fence: i64, error: &str) -> Result<bool, DbError> {
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
