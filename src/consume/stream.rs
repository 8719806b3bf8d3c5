//! One consumer on one queue: bounded concurrency, a pause while a dependency is
//! down, and on stop a drain (consumer cancelled, in-flight work given the drain
//! timeout). Deliveries go to the role's handler: the send role's in delivery order
//! (in ladder mode, one held unclaimed too long is marked as arrived: `arrivals.rs`),
//! the relay's earliest due first from its prefetch window (`relay::DueOrder`). Each
//! lane's prefetch is cut to the byte budget (`config::Prefetch`).

use std::collections::VecDeque;
use std::sync::Arc;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::arrivals::ARRIVAL_AFTER;
use super::publisher::Publisher;
use super::relay::{Decision, DueOrder};
use super::session::{bounded, within};
use super::{Role, Service, SessionEnd, GOODBYE_TIMEOUT};
use crate::broker::{Acks, DelayLayout};
use crate::config::Prefetch;
use crate::contract::ParseRules;
use crate::work::now_ms;

/// A delivery to handle in a slot of its loop.
enum Work {
    /// A `<p>.send` delivery, and when to mark it as arrived if still unclaimed
    /// (`None`: marked already, or marks are off).
    Send(Delivery, Option<Instant>),
    /// An intake delivery, with the decision made when it arrived.
    Relay(Delivery, Decision),
}

/// A `<p>.send` delivery waiting for a slot.
struct Held {
    delivery: Delivery,
    /// When it was read off the consumer.
    received: Instant,
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One consume loop's queue and limits.
pub(super) struct Lane {
    /// What the loop does with its deliveries.
    pub(super) role: Role,
    /// The queue it consumes.
    pub(super) queue: String,
    /// Unacked deliveries the broker may push to it.
    pub(super) prefetch: u16,
    /// Deliveries handled at the same time.
    pub(super) concurrency: usize,
}

impl Service {
    /// Each lane's prefetch, as `worker.inflight_bytes` allows (`config::memory`).
    pub(super) fn prefetch(&self) -> Prefetch {
        let ladder = matches!(self.cx.topology.delay(), DelayLayout::Ladder(_));
        self.cx.settings.prefetch(ladder)
    }

    /// Consumes `lane.queue` until `stop` (then drains) or `lost` (then abandons
    /// in-flight work to redelivery after at most the drain timeout).
    pub(super) async fn consume_loop(
        &self,
        conn: &Connection,
        lane: Lane,
        publish: &Publisher,
        (stop, lost): (&CancellationToken, &CancellationToken),
    ) -> anyhow::Result<SessionEnd> {
        let Lane {
            role,
            queue,
            prefetch,
            concurrency,
        } = lane;
        let (channel, mut deliveries) = within(
            self.cx.settings.amqp.connect_timeout,
            "starting a consumer",
            async {
                let channel = conn.create_channel().await?;
                channel
                    .basic_qos(prefetch, BasicQosOptions::default())
                    .await?;
                let deliveries = channel
                    .basic_consume(
                        queue.as_str().into(),
                        format!("postie-{}-{role:?}", self.cx.owner).into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
                Ok((channel, deliveries))
            },
        )
        .await?;
        let health = self.cx.health.clone();
        let (acks, ack_task) = Acks::start(channel.clone());
        let slots = Arc::new(Semaphore::new(concurrency));
        let tracker = TaskTracker::new();

        let rules = ParseRules::from_settings(&self.cx.settings);
        // The relay's prefetched deliveries wait here, taken earliest due first.
        let mut waiting: DueOrder<(Delivery, Decision)> = DueOrder::default();
        // The send role's, in delivery order; the first `marked` are marked as arrived.
        let mut held: VecDeque<Held> = VecDeque::new();
        let mut marked = 0usize;

        let end = loop {
            if let Role::Relay = role {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => break SessionEnd::Stopped,
                    _ = lost.cancelled() => break SessionEnd::Lost("the broker session ended".into()),
                    permit = slots.clone().acquire_owned(), if !waiting.is_empty() => {
                        let permit = permit.expect("semaphore is never closed");
                        let (delivery, decision) = waiting.pop().expect("not empty");
                        self.dispatch(&tracker, permit, Work::Relay(delivery, decision), publish, &acks);
                    }
                    next = deliveries.next() => match next {
                        None => break SessionEnd::Lost(format!("the broker cancelled the consumer on {queue}")),
                        Some(Err(error)) => break SessionEnd::Lost(error.to_string()),
                        Some(Ok(delivery)) => waiting.arrive(&self.cx.topology, &rules, delivery, now_ms()),
                    },
                }
                continue;
            }
            // Send role: deliveries are read as the broker pushes them (at most the
            // prefetch) and wait here for a slot, so that one held too long without a
            // claim can be marked as arrived (`arrivals.rs`).
            let paused = health.paused();
            let mark_at = held
                .get(marked)
                .filter(|_| self.arrivals.enabled())
                .map(|h| h.received + ARRIVAL_AFTER);
            tokio::select! {
                biased;
                _ = stop.cancelled() => break SessionEnd::Stopped,
                _ = lost.cancelled() => break SessionEnd::Lost("the broker session ended".into()),
                _ = health.wait_dependencies_up(), if paused => {
                    tracing::info!("dependencies answer again; resuming")
                }
                permit = slots.clone().acquire_owned(), if !paused && !held.is_empty() => {
                    let permit = permit.expect("semaphore is never closed");
                    let next = held.pop_front().expect("not empty");
                    let mark_at = (marked == 0).then_some(next.received + ARRIVAL_AFTER);
                    marked = marked.saturating_sub(1);
                    self.dispatch(&tracker, permit, Work::Send(next.delivery, mark_at), publish, &acks);
                }
                _ = sleep_until_some(mark_at) => {
                    let now = Instant::now();
                    while let Some(h) = held.get(marked).filter(|h| h.received + ARRIVAL_AFTER <= now) {
                        let scheduled = self.scheduled_key(&h.delivery);
                        self.arrivals.note(scheduled.as_ref().map(|(key, _)| key));
                        marked += 1;
                    }
                }
                next = deliveries.next(), if held.len() < usize::from(prefetch) => match next {
                    None => {
                        break SessionEnd::Lost(format!("the broker cancelled the consumer on {queue}"))
                    }
                    Some(Err(error)) => break SessionEnd::Lost(error.to_string()),
                    Some(Ok(delivery)) => held.push_back(Held {
                        delivery,
                        received: Instant::now(),
                    }),
                },
            }
        };

        if let SessionEnd::Stopped = end {
            health.set_draining();
            // Stop taking work; prefetched but unstarted deliveries (the relay's waiting
            // ones too) go back on close.
            bounded(channel.basic_cancel(deliveries.tag(), BasicCancelOptions::default())).await;
            tracker.close();
            let drain = self.cx.settings.worker.drain_timeout;
            if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
                tracing::warn!("drain timeout: abandoning in-flight deliveries to redelivery");
                self.cx.hard_stop.cancel();
                tracker.wait().await;
            }
        } else {
            // The channel is gone, so in-flight deliveries cannot be acked any more;
            // their outcomes are in the inbox, and the broker redelivers them to be
            // suppressed. Give them a moment to finish, but never let one that hangs
            // on the dead connection hold up the next session.
            tracker.close();
            let drain = self.cx.settings.worker.drain_timeout;
            if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
                tracing::warn!(
                    "in-flight deliveries still running after the broker session ended; \
                     reconnecting without them (the broker redelivers them)"
                );
            }
        }
        // The acks of everything finished go before the channel closes.
        drop(acks);
        ack_task.finish(GOODBYE_TIMEOUT).await;
        bounded(channel.close(200, "done".into())).await;
        Ok(end)
    }

    /// Runs `work` on the tracker, holding its slot until it is done.
    fn dispatch(
        &self,
        tracker: &TaskTracker,
        slot: OwnedSemaphorePermit,
        work: Work,
        publish: &Publisher,
        acks: &Acks,
    ) {
        let (this, publish, acks) = (self.clone(), publish.clone(), acks.clone());
        tracker.spawn(async move {
            match work {
                Work::Send(delivery, mark_at) => {
                    this.handle_send(delivery, mark_at, &publish, &acks).await
                }
                Work::Relay(delivery, decision) => {
                    this.handle_relay(delivery, decision, &publish, &acks).await
                }
            }
            drop(slot);
        });
    }
}
