//! What an instance of `postie serve` shares: built once at start-up
//! (`consume::serve`) and held behind one [`Arc`] by the consume loops, the
//! maintenance tasks and the [`Worker`](super::Worker).
//!
//! Before it, the service and the worker each carried settings, topology, owner and
//! the stop token, and the consume loops reached the inbox and the metrics through
//! the worker. Now there is one place: a loop or a task that needs the inbox, the
//! mailer, the health or the metrics asks the context.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{AmqpAddresses, Settings};
use crate::headers::Seal;
use crate::inbox::Inbox;
use crate::mail::Mailer;
use crate::ops::health::Health;
use crate::ops::metrics::SharedMetrics;
use crate::topology::Topology;

/// Everything an instance shares, for as long as it serves. Read-only after start-up
/// (its parts share their own state: the inbox's pool, the mailer's connections,
/// the health flags).
pub(crate) struct Context {
    /// Everything configured (validated).
    pub(crate) settings: Settings,
    /// The broker objects' names, with the delay mode resolved.
    pub(crate) topology: Topology,
    /// This instance's name (connection names, the inbox `owner` column).
    pub(crate) owner: String,
    /// The broker's addresses (`amqp.url`), parsed at start-up.
    pub(crate) amqp: AmqpAddresses,
    /// The inbox database.
    pub(crate) inbox: Inbox,
    /// The mail transport and its connection slots.
    pub(crate) mailer: Mailer,
    /// Dependency health (readiness, pausing, the circuit breaker), and through it the
    /// metrics.
    pub(crate) health: Health,
    /// The fleet's seal on postie's own headers: checked on every delivery at intake,
    /// put on every copy postie publishes.
    pub(crate) seal: Seal,
    /// Cancelled when the drain timeout runs out: ends every wait for a dependency,
    /// so in-flight work gives up and its deliveries return to the queue unacked.
    pub(crate) hard_stop: CancellationToken,
}

/// The shared handle.
pub(crate) type SharedContext = Arc<Context>;

impl Context {
    /// The metrics every part reports into.
    pub(crate) fn metrics(&self) -> &SharedMetrics {
        self.health.metrics()
    }
}
