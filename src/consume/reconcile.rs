//! Ladder mode's reconciler: PostgreSQL is the schedule of record, the ladder the
//! transport. A job the relay recorded as scheduled that is overdue by more than
//! `delay.reconcile_grace` and that no worker has received (RabbitMQ 3.10–4.x can
//! strand expired messages in a lost node's at-least-once dead-letter process) is
//! published again, straight to the send path, stamped with its due time (its
//! `postie-due-at` sealed). Never early:
//! only overdue jobs are re-published, and the worker still checks the due time. The
//! inbox claim keeps the later arrival of the original from sending twice.
//!
//! Only what the broker lost is re-published. `<p>.send` is a quorum queue: what it
//! accepted it keeps, so a job in it is waiting, not lost. A job is left alone when
//! - a worker holds it, waiting its turn (marked as arrived: `arrivals.rs`), or
//! - the send queue has ready messages and the job is not behind the frontier: the
//!   latest due time among jobs workers hold, less the grace. The send queue is
//!   consumed in the order jobs fell due, so a job due a grace before one that workers
//!   already hold would have reached them had it been in the queue.
//!
//! Each lane is judged on its own (its send queue, its frontier). While the queue has
//! ready messages but no worker holds a waiting job, the queue is flowing and the
//! grace alone decides; but a lane with a tenant cap and ready messages yet no
//! frontier loses none (its jobs are passed over fast, their excess deferred unmarked,
//! so they may be in its queue). A pass lets the marks of deliveries in flight
//! settle, judges again, and re-publishes only rows that are still scheduled and
//! unmarked. Each re-publish is counted in the row (`reconciled`) and in
//! `postie_reconciled_total`. A job that ended without a claim (dead-lettered as
//! invalid, cancelled) has its scheduled row finished ([`Service::finish_unclaimed`]),
//! so no pass picks it again.
//!
//! A pass runs on the maintenance instance (one at a time) every half grace period,
//! between 1 and 30 s.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use super::arrivals::ARRIVAL_AFTER;
use super::Service;
use crate::broker;
use crate::config::KeyNamespace;
use crate::contract::{self, IdempotencyKey};
use crate::headers::{self, HEADER_DUE_AT, HEADER_REVISION};
use crate::inbox::{LaneRows, Overdue, Status};
use crate::ops::metrics::Metrics;
use crate::topology::{DelayLayout, LaneId};
use crate::work::{now_ms, DeadKind, Outcome};

/// Jobs re-published per pass at most.
const PASS_LIMIT: i64 = 1_000;

/// How long a pass that found the send queue empty waits for the arrival marks of
/// deliveries on their way to a worker before it re-publishes anything.
const SETTLE: Duration = Duration::from_millis(ARRIVAL_AFTER.as_millis() as u64 * 3);

impl Service {
    /// How often the maintenance instance runs a pass.
    pub(super) fn reconcile_every(&self) -> Duration {
        (self.cx.settings.delay.reconcile_grace / 2)
            .clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    /// Whether the reconciler runs: ladder mode, pending jobs tracked, bodies kept.
    fn reconciling(&self) -> bool {
        self.cx.settings.delay.reconcile
            && self.cx.settings.delay.track_pending
            && matches!(self.cx.topology.delay(), DelayLayout::Ladder(_))
    }

    /// A pass on the maintenance connection (opened if needed); the connection, if it
    /// still stands.
    pub(super) async fn reconcile(&self, conn: Option<Connection>) -> Option<Connection> {
        if !self.reconciling() {
            return conn;
        }
        let conn = self
            .maintenance_connection(conn, "reconciler pass skipped")
            .await?;
        if let Err(error) = self.reconcile_pass(&conn).await {
            tracing::warn!(error = %crate::describe_error(&error), "reconciler pass failed; trying again next time");
        }
        Some(conn)
    }

    /// Ready messages in `queue` (a passive declare on `channel`).
    async fn ready(&self, channel: &Channel, queue: &str) -> anyhow::Result<u32> {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await?;
        Ok(declared.message_count())
    }

    /// The due time (Unix ms) before which an unmarked scheduled job of `lane` is
    /// lost: a grace ago, or, while the lane's queue has ready messages and workers
    /// hold jobs of it waiting their turn, a grace before the latest due time among
    /// those (the lane's frontier). With ready messages but nothing waiting, the
    /// queue is flowing: a job in it reaches a worker within moments, so the grace
    /// alone decides. Each lane is consumed at its own pace, so each has its own.
    async fn lost_before(
        &self,
        channel: &Channel,
        lane: LaneId,
        rows: LaneRows<'_>,
    ) -> anyhow::Result<(i64, u32)> {
        let grace_ms = self.cx.settings.delay.reconcile_grace.as_millis() as i64;
        let ready = self
            .ready(channel, &self.cx.topology.lane(lane).queue)
            .await?;
        let mut due_before = now_ms() - grace_ms;
        if ready > 0 {
            match self.cx.inbox.arrived_frontier(rows).await? {
                Some(frontier) => due_before = due_before.min(frontier - grace_ms),
                // A lane with a tenant cap is passed over fast (its excess deferred at
                // once, unmarked) however deep its queue: while it has ready
                // messages, its jobs may be in it, so none is judged lost.
                None if self.cx.topology.lane(lane).tenant_rate_limit.is_some() => {
                    due_before = i64::MIN
                }
                None => {}
            }
        }
        Ok((due_before, ready))
    }

    /// One reconciler pass on `conn`, lane by lane; the number of jobs re-published.
    async fn reconcile_pass(&self, conn: &Connection) -> anyhow::Result<usize> {
        let channel = broker::confirm_channel(conn).await?;
        let lanes = self.cx.topology.lanes();
        let others: Vec<&str> = lanes[1..].iter().map(|l| l.name.as_str()).collect();
        let mut published = 0;
        for id in (0..lanes.len()).map(LaneId) {
            let rows = LaneRows {
                lane: self.cx.topology.lane_column(id),
                others: &others,
            };
            match self.reconcile_lane(&channel, id, rows).await {
                Ok(n) => published += n,
                Err(error) => {
                    let _ = channel.close(200, "reconciled".into()).await;
                    return Err(error);
                }
            }
        }
        let _ = channel.close(200, "reconciled".into()).await;
        Ok(published)
    }

    /// One lane's share of a pass.
    async fn reconcile_lane(
        &self,
        channel: &Channel,
        lane: LaneId,
        rows: LaneRows<'_>,
    ) -> anyhow::Result<usize> {
        let inbox = &self.cx.inbox;
        let grace = self.cx.settings.delay.reconcile_grace;
        let (due_before, _) = self.lost_before(channel, lane, rows).await?;
        let overdue = inbox.overdue(rows, due_before, grace, PASS_LIMIT).await?;
        if overdue.is_empty() {
            return Ok(0);
        }
        // Deliveries on their way to a worker: let their marks land, then judge again.
        tokio::time::sleep(SETTLE).await;
        let (due_before, ready) = self.lost_before(channel, lane, rows).await?;
        let overdue: Vec<String> = overdue
            .into_iter()
            .filter(|(_, due_ms)| *due_ms < due_before)
            .map(|(key, _)| key)
            .collect();
        // Marked before they are published: a re-published job is claimed and sent
        // within moments, and then no longer `scheduled` for a mark to find. If a
        // publish fails, the rest stay marked and are tried again a grace later.
        // Bodies are read a chunk at a time, so a pass holds at most
        // `delay.relay_concurrency` of them.
        let chunk = usize::from(self.cx.settings.delay.relay_concurrency).max(1);
        let mut published = 0;
        let mut oldest_due_ms = None;
        for keys in overdue.chunks(chunk) {
            let lost = inbox.mark_reconciled(keys).await?;
            oldest_due_ms = oldest_due_ms.or(lost.first().map(|job| job.due_ms));
            let sent = self.republish(channel, lane, &lost).await;
            let n = match &sent {
                Ok(n) => *n,
                Err(partial) => partial.published,
            };
            count(self.cx.metrics(), n);
            published += n;
            sent?;
        }
        if published > 0 {
            tracing::warn!(
                jobs = published,
                lane = %self.cx.topology.lane(lane).name,
                send_queue_ready = ready,
                oldest_due_ms,
                "re-published scheduled jobs the ladder had not delivered (overdue past the grace, in no queue a worker reads)"
            );
        }
        Ok(published)
    }

    /// Publishes `jobs` to the work exchange, to `lane`'s queue, confirmed, stamped
    /// with their due time; how many went out (an error after some: those are
    /// counted by the caller).
    async fn republish(
        &self,
        channel: &Channel,
        lane: LaneId,
        jobs: &[Overdue],
    ) -> Result<usize, Partial> {
        let exchange = self.cx.topology.work_exchange();
        let routing_key = &self.cx.topology.lane(lane).routing_key;
        for (published, job) in jobs.iter().enumerate() {
            let mut table = FieldTable::default();
            headers::set_int(&mut table, HEADER_DUE_AT, job.due_ms);
            // A debounced job's version is claimed by the revision postie gave it.
            if let Some(revision) = job.debounced {
                headers::set_int(&mut table, HEADER_REVISION, i64::from(revision));
            }
            self.cx.seal.seal(&mut table, &job.body);
            let mut properties = broker::job_properties().with_headers(table);
            // Per-producer keys: the job goes back under the user_id it came with.
            if self.cx.settings.worker.key_namespace == KeyNamespace::UserId {
                if let Some(owner) = contract::key_owner(&job.key) {
                    properties = properties.with_user_id(owner.as_str().into());
                }
            }
            broker::publish_confirmed(channel, exchange, routing_key, true, &job.body, properties)
                .await
                .map_err(|error| Partial { published, error })?;
        }
        Ok(jobs.len())
    }

    /// Finishes the scheduled row of a job that ended without a claim (dead-lettered
    /// as invalid, cancelled), fenced by its revision, so that no reconciler pass
    /// picks it again. A failure is logged: the row then stays scheduled, and a later
    /// re-publish ends the same way.
    pub(super) async fn finish_unclaimed(
        &self,
        outcome: &Outcome,
        scheduled: impl FnOnce() -> Option<(IdempotencyKey, i32)>,
    ) {
        let status = match outcome {
            Outcome::DeadLetter {
                kind: DeadKind::Invalid,
                ..
            } => Status::Dead,
            Outcome::Cancelled { .. } => Status::Cancelled,
            _ => return,
        };
        if !self.reconciling() {
            return;
        }
        let Some((key, revision)) = scheduled() else {
            return;
        };
        let inbox = &self.cx.inbox;
        if let Err(error) = inbox.finish_unclaimed(key.as_str(), revision, status).await {
            tracing::warn!(%error, key = %key, "could not finish the scheduled row of a job that ended unclaimed");
        }
    }
}

/// A re-publish that stopped part way.
#[derive(Debug, thiserror::Error)]
#[error("re-published {published}, then: {error}")]
struct Partial {
    published: usize,
    #[source]
    error: broker::PublishError,
}

fn count(metrics: &Metrics, n: usize) {
    metrics.reconciled.inc_by(n as u64);
}
