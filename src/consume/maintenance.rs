//! Singleton maintenance: retention (`inbox::prune`), the queue-depth poller and the
//! pending gauge run on exactly one instance at a time.
//!
//! The instance that holds a PostgreSQL advisory lock leads. The lock is taken on a
//! connection of its own, outside the pool, and held for as long as that connection
//! lives: when the instance dies (even by SIGKILL) the server ends the session and
//! releases the lock, and another instance, trying every [`TRY_EVERY`], takes over.
//! Two leaders at once (a lock connection lost while a pass runs) are harmless:
//! every prune statement re-checks its rows, and polling is read-only.

use std::time::{Duration, Instant};

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::pollers::{Warned, DEPTH_POLL, RATE_POLL};
use super::session::bounded;
use super::Service;
use crate::broker;
use crate::inbox::{PrunePlan, MAINTENANCE_LOCK};
use crate::ops::backoff::Backoff;
use crate::ops::metrics::Pruned;

/// How often a standby instance tries the lock (backing off from there, up to
/// `worker.outage_backoff_max`, while PostgreSQL does not answer).
const TRY_EVERY: Duration = Duration::from_secs(2);
/// How often the leader checks that its lock connection still stands.
const TICK: Duration = Duration::from_secs(1);

impl Service {
    /// Runs maintenance whenever this instance holds the lock, until `stop`.
    pub(super) fn spawn_maintenance(&self, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            let mut standby: Option<tokio_postgres::Client> = None;
            let max = service.cx.settings.worker.outage_backoff_max.max(TRY_EVERY);
            let mut backoff = Backoff::new(TRY_EVERY, max);
            while !stop.is_cancelled() {
                let mut wait = TRY_EVERY;
                match service.try_lead(&mut standby).await {
                    Ok(Some(client)) => {
                        let why = service.lead(&client, &stop).await;
                        service.step_down(why);
                        backoff.succeeded();
                        // Dropping the client closes its session: the lock is released.
                    }
                    Ok(None) => backoff.succeeded(),
                    Err(error) => {
                        tracing::debug!(%error, "maintenance lock not tried");
                        standby = None;
                        wait = backoff.failed();
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        })
    }

    /// Tries the lock on the standby connection (opened if needed); the connection,
    /// if the lock was granted.
    async fn try_lead(
        &self,
        standby: &mut Option<tokio_postgres::Client>,
    ) -> Result<Option<tokio_postgres::Client>, crate::inbox::DbError> {
        let client = match standby.take() {
            Some(client) if !client.is_closed() => client,
            _ => self.cx.inbox.dedicated().await?,
        };
        let granted: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&MAINTENANCE_LOCK])
            .await?
            .get(0);
        if granted {
            return Ok(Some(client));
        }
        *standby = Some(client);
        Ok(None)
    }

    /// Leads until `stop` or until the lock connection is lost; why it ended.
    async fn lead(&self, lock: &tokio_postgres::Client, stop: &CancellationToken) -> String {
        let metrics = self.cx.metrics().clone();
        metrics.maintenance_leader.set(1);
        tracing::info!(instance = %self.cx.owner, "running maintenance (pruning, the reconciler, queue depths)");
        if let Ok(false) = self.cx.inbox.autovacuum_on().await {
            tracing::warn!(
                "PostgreSQL's autovacuum is off: pruned rows leave dead space that nothing \
                 reclaims, and postie_inbox grows without bound; turn autovacuum on, or run \
                 VACUUM postie_inbox regularly"
            );
        }
        let interval = self.cx.settings.inbox.prune_interval;
        let (mut next_prune, mut next_poll) = (Instant::now(), Instant::now());
        let mut next_reconcile = Instant::now();
        let (mut next_rates, mut warned) = (Instant::now(), Warned::new());
        let mut amqp: Option<Connection> = None;
        loop {
            if lock.is_closed() || lock.simple_query("SELECT 1").await.is_err() {
                bounded(close(amqp)).await;
                return "lost the maintenance lock connection".into();
            }
            if Instant::now() >= next_poll {
                next_poll = Instant::now() + DEPTH_POLL;
                amqp = self.poll(amqp).await;
            }
            if Instant::now() >= next_rates {
                next_rates = Instant::now() + RATE_POLL;
                self.poll_rates(&mut warned).await;
            }
            if Instant::now() >= next_prune {
                self.prune_pass().await;
                next_prune = Instant::now() + interval;
            }
            if Instant::now() >= next_reconcile {
                next_reconcile = Instant::now() + self.reconcile_every();
                amqp = self.reconcile(amqp).await;
            }
            tokio::select! {
                _ = stop.cancelled() => {
                    bounded(close(amqp)).await;
                    return "stopping".into();
                }
                _ = tokio::time::sleep(TICK) => {}
            }
        }
    }

    /// Clears what only the leader reports, so that a sum over instances stays right.
    fn step_down(&self, why: String) {
        let metrics = self.cx.metrics();
        metrics.maintenance_leader.set(0);
        metrics.queue_depth.clear();
        metrics.pending.set(0);
        metrics.inbox_rows.set(0);
        metrics.feedback_rate.clear();
        tracing::info!(reason = %why, "maintenance handed over");
    }

    /// The maintenance task's own broker connection: `conn` if it still stands, else a
    /// new one (None, logged with `what`, if the broker does not answer).
    pub(super) async fn maintenance_connection(
        &self,
        conn: Option<Connection>,
        what: &str,
    ) -> Option<Connection> {
        if let Some(conn) = conn.filter(|c| c.status().connected()) {
            return Some(conn);
        }
        let name = format!("{}-maintenance", self.cx.owner);
        let timeout = self.cx.settings.amqp.connect_timeout;
        match broker::connect(&self.cx.amqp, &name, timeout).await {
            Ok(connected) => Some(connected.connection),
            Err(error) => {
                tracing::debug!(%error, "{what}");
                None
            }
        }
    }

    /// One poll of queue depths and the pending gauge on a broker connection of the
    /// maintenance task's own (opened as needed, dropped on error).
    async fn poll(&self, conn: Option<Connection>) -> Option<Connection> {
        let conn = self
            .maintenance_connection(conn, "queue depths not polled")
            .await?;
        let polled = async {
            let channel = conn.create_channel().await?;
            let result = self.poll_depths(&channel).await;
            if result.is_ok() {
                bounded(channel.close(200, "polled".into())).await;
            }
            result
        };
        match tokio::time::timeout(self.cx.settings.amqp.connect_timeout, polled).await {
            Ok(Ok(())) => Some(conn),
            Ok(Err(error)) => {
                // A missing queue closes the channel, not the connection.
                tracing::debug!(%error, "queue depth poll failed");
                Some(conn)
            }
            Err(_) => {
                bounded(close(Some(conn))).await;
                None
            }
        }
    }

    /// One prune pass, counted and timed.
    async fn prune_pass(&self) {
        let metrics = self.cx.metrics();
        let inbox = &self.cx.inbox;
        let plan = PrunePlan::from_settings(&self.cx.settings, false);
        match inbox.prune(&plan).await {
            Ok(pruned) => {
                for (kind, n) in [
                    (Pruned::Finished, pruned.finished),
                    (Pruned::Tombstone, pruned.tombstones),
                    (Pruned::Throttle, pruned.throttle),
                    (Pruned::Feedback, pruned.feedback),
                ] {
                    metrics.pruned.inc_by(kind, n);
                }
                metrics.prune_seconds.observe(pruned.took.as_secs_f64());
                let total = pruned.finished + pruned.tombstones + pruned.throttle;
                if total > 0 {
                    tracing::info!(
                        finished = pruned.finished,
                        tombstones = pruned.tombstones,
                        throttle = pruned.throttle,
                        seconds = pruned.took.as_secs_f64(),
                        "pruned expired rows"
                    );
                }
            }
            Err(error) => tracing::warn!(%error, "prune failed; trying again next interval"),
        }
        if let Ok(rows) = inbox.rows_estimate().await {
            metrics.inbox_rows.set(rows);
        }
    }
}

async fn close(conn: Option<Connection>) {
    if let Some(conn) = conn {
        let _ = conn.close(200, "maintenance done".into()).await;
    }
}
