//! The PostgreSQL inbox: one row per idempotency key, claimed before any email
//! leaves and completed (fenced) before the delivery is acked.
//!
//! Every call is one statement (a batch of claims: one transaction), so a claim is
//! committed before the send starts and a completion is committed before the ack.
//!
//! This file holds the pool. The rest, by what it is for:
//!
//! - the state machine: `machine/`, every statement that writes a row's `status`, one
//!   file per transition (`Claim`, `Completion`, `Scheduled`, `Status`); `batch.rs`
//!   (`Batcher`: one statement for many callers' rows: the claims and completions);
//!   `queries.rs` (status, pending); `reconcile.rs` (ladder mode's
//!   reconciler); `prune.rs` (retention).
//! - around it: `error.rs` (an error's meaning: the job's fault or an outage),
//!   `clock.rs` (the fleet's clock), `rate.rs` (the one rate engine: every GCRA row,
//!   `postie_gcra_take`, and the per-type throttle's window, `postie_window_take`), `sends.rs` (the one count of recent sends, for `postie
//!   status` and the console), `lanes.rs` (the busiest tenants' slots), `events.rs`
//!   (the delivery events' outbox), `migrate.rs`
//!   (the migrations), `header_key.rs` (the fleet's header key).
//! - feedback: `suppression.rs` (the suppression list; `suppression/filter.rs`,
//!   `suppression/bulk.rs`), `reputation.rs` (bounce and complaint rates),
//!   `feedback.rs` (`Inbox::record_feedback`), `replay.rs` (Mailgun's tokens),
//!   `unsubscribe.rs` (a one-click unsubscribe: the suppression and its event).
//! - for the console: `breakers.rs`, `inspect.rs`.
//! - connections: `dial.rs` (`Dialer`, a connection outside the pool), `tls.rs`.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use secrecy::{ExposeSecret, SecretString};
use tokio_postgres::NoTls;

mod batch;
mod breakers;
pub(crate) mod clock;
mod dial;
mod error;
mod events;
mod feedback;
mod header_key;
mod inspect;
mod lanes;
mod machine;
mod migrate;
mod prune;
mod queries;
mod rate;
mod reconcile;
mod replay;
mod reputation;
mod sends;
mod suppression;
mod tls;
mod unsubscribe;

pub(crate) use dial::Dialer;
pub(crate) use error::DbError;
pub use events::record_event;
pub(crate) use events::{Event, OutboxError};
pub(crate) use feedback::{Feedback, FeedbackKind, Recorded};
pub(crate) use inspect::MAINTENANCE_LOCK;
pub(crate) use machine::{Cancelled, Status};
pub use machine::{Claim, Completion, Debounced, Debouncing, Scheduled};
pub(crate) use prune::PrunePlan;
pub(crate) use queries::PendingFilter;
pub(crate) use rate::Throttle;
pub(crate) use reconcile::{LaneRows, Overdue};
pub(crate) use replay::TokenSeen;
pub(crate) use sends::{MinuteSends, RecentSends};
pub(crate) use suppression::{normalise, Entry as SuppressionEntry, Suppress, SuppressionReason};
pub(crate) use unsubscribe::Unsubscribing;

use crate::config::{DatabaseSettings, DbPlan};
use crate::endpoint::redact_url;

/// A pool of connections to the inbox database.
#[derive(Clone)]
pub struct Inbox {
    pool: Pool,
    /// How to open a connection outside the pool (the maintenance lock holder).
    direct: Dialer,
    /// Claims are run in batches (`machine/claim.rs`).
    claimer: machine::Claimer,
    /// Completions are recorded in batches (`machine/complete.rs`).
    completer: machine::Completer,
    /// The suppressed addresses' filter, started by the first check
    /// (`suppression/filter.rs`); its refresh ends once every clone is dropped.
    suppression_filter: std::sync::Arc<std::sync::OnceLock<std::sync::Arc<suppression::Filter>>>,
    /// Sends per job type, added to `postie_send_tally` every few seconds by a task
    /// the first count starts (`reputation.rs`).
    tally: std::sync::Arc<reputation::Tally>,
    /// `events.enabled`: completions and cancels write their delivery events
    /// (`events.rs`). Set before the first completion ([`Inbox::with_events`]).
    events: bool,
}

impl Inbox {
    /// Builds the pool (lazily connected) from `database.url` as validation parsed it
    /// ([`DatabaseSettings::plan`]). TLS follows `sslmode` in the URL (see
    /// [`database_plan`](crate::config::database_plan)): refused without TLS to a host
    /// that is not this machine unless `allow_plaintext`; with TLS, the server's
    /// certificate is always verified.
    pub fn new(plan: &DbPlan, settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let direct = Dialer::new(plan, settings, "postie")?;
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let (pg, tls) = direct.parts();
        let manager = match tls.cloned() {
            None => Manager::from_config(pg.clone(), NoTls, manager_config),
            Some(tls) => Manager::from_config(pg.clone(), tls, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.connect_timeout))
            .runtime(Runtime::Tokio1)
            .build()?;
        Ok(Self {
            pool,
            direct,
            claimer: machine::Claimer::new(settings.statement_timeout),
            completer: machine::Completer::new(settings.statement_timeout),
            suppression_filter: Default::default(),
            tally: Default::default(),
            events: true,
        })
    }

    /// Whether completions and cancels write delivery events (`events.enabled`;
    /// on by default). Set before the first completion: the completion task keeps
    /// what it found.
    pub fn with_events(mut self, enabled: bool) -> Self {
        self.events = enabled;
        self
    }

    /// A connection of its own, outside the pool: what it holds (an advisory lock)
    /// is released when it is dropped or its process dies.
    pub(crate) async fn dedicated(&self) -> Result<tokio_postgres::Client, DbError> {
        self.direct.connect().await
    }

    /// `database.url` parsed, then [`Inbox::new`] and [`Inbox::check`]: a pool known
    /// to reach the database (for the one-shot commands).
    pub async fn connect(settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let inbox = Self::new(&settings.plan()?, settings)?;
        inbox.check(&settings.url).await?;
        Ok(inbox)
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
}
