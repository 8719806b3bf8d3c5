//! One consumer on one queue (`relay_loop`, `send_loop`, and the `drain` they share):
//! bounded concurrency, a pause while a dependency is
//! down, and on stop a drain (consumer cancelled, in-flight work given the drain
//! timeout). Deliveries go to the role's handler: the send role's in delivery order
//! (in ladder mode, one held unclaimed too long is marked as arrived: `arrivals.rs`),
//! the relay's earliest due first from its prefetch window (`relay::DueOrder`). Each
//! loop's prefetch is cut to the byte budget (`config::Prefetch`). Every delivery is
//! admitted as it is read: its `postie-*` headers without postie's seal dropped
//! (`Service::admit`), whichever door it came through.

use std::collections::VecDeque;
use std::sync::Arc;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::arrivals::ARRIVAL_AFTER;
use super::publisher::Publisher;
use super::relay::{Decision, DueOrder};
use super::session::{bounded, within};
use super::{Role, Service, SessionEnd, GOODBYE_TIMEOUT};
use crate::broker::Acks;
use crate::config::Prefetch;
use crate::contract::ParseRules;
use crate::contract::Peeked;
use crate::topology::{DelayLayout, LaneId};
use crate::work::now_ms;

/// A delivery to handle in a slot of its loop.
enum Work {
    /// A send queue's delivery, when to mark it as arrived if still unclaimed
    /// (`None`: marked already, or marks are off), and the queue's lane.
    Send(Delivery, Option<Instant>, LaneId),
    /// An intake delivery, with the decision made when it arrived and its job as
    /// read then.
    Relay(Delivery, Decision, Option<Peeked>),
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
pub(super) struct Feed {
    /// What the loop does with its deliveries.
    pub(super) role: Role,
    /// The queue it consumes.
    pub(super) queue: String,
    /// Unacked deliveries the broker may push to it.
    pub(super) prefetch: u16,
    /// Deliveries handled at the same time.
    pub(super) concurrency: usize,
}

/// One running consume loop: its consumer, its slots and in-flight work, and where
/// its dispositions go.
struct Consumer<'a> {
    deliveries: lapin::Consumer,
    queue: String,
    prefetch: u16,
    /// `concurrency` slots: deliveries handled at the same time.
    slots: Arc<Semaphore>,
    /// The deliveries being handled.
    tracker: TaskTracker,
    publish: &'a Publisher,
    acks: Acks,
    /// Ends the loop with a drain.
    stop: &'a CancellationToken,
    /// Ends the loop with in-flight work abandoned to redelivery.
    lost: &'a CancellationToken,
}

impl Consumer<'_> {
    /// The next delivery off the consumer, or how the loop ends if there is none.
    fn received(
        &self,
        next: Option<Result<Delivery, lapin::Error>>,
    ) -> Result<Delivery, SessionEnd> {
        match next {
            Some(Ok(delivery)) => Ok(delivery),
            Some(Err(error)) => Err(SessionEnd::Lost(error.to_string())),
            None => Err(SessionEnd::Lost(format!(
                "the broker cancelled the consumer on {}",
                self.queue
            ))),
        }
    }
}

impl Service {
    /// Each consume loop's prefetch, as `worker.inflight_bytes` allows (`config::memory`).
    pub(super) fn prefetch(&self) -> Prefetch {
        let ladder = matches!(self.cx.topology.delay(), DelayLayout::Ladder(_));
        self.cx.settings.prefetch(ladder)
    }

    /// Consumes `feed.queue` until `stop` (then drains) or `lost` (then abandons
    /// in-flight work to redelivery after at most the drain timeout).
    pub(super) async fn consume_loop(
        &self,
        conn: &Connection,
        feed: Feed,
        publish: &Publisher,
        (stop, lost): (&CancellationToken, &CancellationToken),
    ) -> anyhow::Result<SessionEnd> {
        let (channel, deliveries) = self.start_consumer(conn, &feed).await?;
        let (acks, ack_task) = Acks::start(channel.clone());
        let mut consumer = Consumer {
            deliveries,
            queue: feed.queue,
            prefetch: feed.prefetch,
            slots: Arc::new(Semaphore::new(feed.concurrency)),
            tracker: TaskTracker::new(),
            publish,
            acks,
            stop,
            lost,
        };
        let end = match feed.role {
            Role::Relay => self.relay_loop(&mut consumer).await,
            Role::Send(lane) => self.send_loop(&mut consumer, lane).await,
        };
        self.drain(&end, &channel, &consumer).await;
        // The acks of everything finished go before the channel closes; the consumer
        // itself is dropped last, as before the split.
        let Consumer {
            deliveries, acks, ..
        } = consumer;
        drop(acks);
        ack_task.finish(GOODBYE_TIMEOUT).await;
        bounded(channel.close(200, "done".into())).await;
        drop(deliveries);
        Ok(end)
    }

    /// A channel with the feed's prefetch, and its consumer on its queue.
    async fn start_consumer(
        &self,
        conn: &Connection,
        feed: &Feed,
    ) -> anyhow::Result<(Channel, lapin::Consumer)> {
        let step = async {
            let channel = conn.create_channel().await?;
            channel
                .basic_qos(feed.prefetch, BasicQosOptions::default())
                .await?;
            let deliveries = channel
                .basic_consume(
                    feed.queue.as_str().into(),
                    format!("postie-{}-{:?}", self.cx.owner, feed.role).into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok((channel, deliveries))
        };
        within(
            self.cx.settings.amqp.connect_timeout,
            "starting a consumer",
            step,
        )
        .await
    }

    /// The relay's loop: its prefetched deliveries wait in a window and are taken
    /// earliest due first (`relay::DueOrder`).
    async fn relay_loop(&self, c: &mut Consumer<'_>) -> SessionEnd {
        let rules = ParseRules::from_settings(&self.cx.settings);
        let mut waiting: DueOrder<(Delivery, Decision, Option<Peeked>)> = DueOrder::default();
        loop {
            tokio::select! {
                biased;
                _ = c.stop.cancelled() => return SessionEnd::Stopped,
                _ = c.lost.cancelled() => return SessionEnd::Lost("the broker session ended".into()),
                permit = c.slots.clone().acquire_owned(), if !waiting.is_empty() => {
                    let permit = permit.expect("semaphore is never closed");
                    let (delivery, decision, job) = waiting.pop().expect("not empty");
                    self.dispatch(c, permit, Work::Relay(delivery, decision, job));
                }
                next = c.deliveries.next() => match c.received(next) {
                    Ok(delivery) => waiting.arrive(&self.cx.topology, &rules, self.admit(delivery), now_ms()),
                    Err(end) => return end,
                },
            }
        }
    }

    /// The send role's loop: deliveries are read as the broker pushes them (at most
    /// the prefetch) and wait here for a slot, in delivery order, so that one held too
    /// long without a claim can be marked as arrived (`arrivals.rs`); no slot is given
    /// while a dependency is down.
    async fn send_loop(&self, c: &mut Consumer<'_>, lane: LaneId) -> SessionEnd {
        let health = self.cx.health.clone();
        // The first `marked` are marked as arrived.
        let mut held: VecDeque<Held> = VecDeque::new();
        let mut marked = 0usize;
        loop {
            let paused = health.paused();
            let mark_at = held
                .get(marked)
                .filter(|_| self.arrivals.enabled())
                .map(|h| h.received + ARRIVAL_AFTER);
            tokio::select! {
                biased;
                _ = c.stop.cancelled() => return SessionEnd::Stopped,
                _ = c.lost.cancelled() => return SessionEnd::Lost("the broker session ended".into()),
                _ = health.wait_dependencies_up(), if paused => {
                    tracing::info!("dependencies answer again; resuming")
                }
                permit = c.slots.clone().acquire_owned(), if !paused && !held.is_empty() => {
                    let permit = permit.expect("semaphore is never closed");
                    let next = held.pop_front().expect("not empty");
                    let mark_at = (marked == 0).then_some(next.received + ARRIVAL_AFTER);
                    marked = marked.saturating_sub(1);
                    self.dispatch(c, permit, Work::Send(next.delivery, mark_at, lane));
                }
                _ = sleep_until_some(mark_at) => {
                    let now = Instant::now();
                    while let Some(h) = held.get(marked).filter(|h| h.received + ARRIVAL_AFTER <= now) {
                        let scheduled = self.scheduled_key(&h.delivery);
                        self.arrivals.note(scheduled.as_ref().map(|(key, _)| key));
                        marked += 1;
                    }
                }
                next = c.deliveries.next(), if held.len() < usize::from(c.prefetch) => {
                    match c.received(next) {
                        Ok(delivery) => held.push_back(Held { delivery: self.admit(delivery), received: Instant::now() }),
                        Err(end) => return end,
                    }
                }
            }
        }
    }

    /// After a loop ends: on a stop, the consumer is cancelled and in-flight work gets
    /// the drain timeout (then the hard stop); on a lost session, in-flight work gets
    /// a moment and is otherwise left to redelivery.
    async fn drain(&self, end: &SessionEnd, channel: &Channel, c: &Consumer<'_>) {
        let drain = self.cx.settings.worker.drain_timeout;
        c.tracker.close();
        if let SessionEnd::Stopped = end {
            self.cx.health.set_draining();
            // Stop taking work; prefetched but unstarted deliveries (the relay's waiting
            // ones too) go back on close.
            bounded(channel.basic_cancel(c.deliveries.tag(), BasicCancelOptions::default())).await;
            if tokio::time::timeout(drain, c.tracker.wait()).await.is_err() {
                tracing::warn!("drain timeout: abandoning in-flight deliveries to redelivery");
                self.cx.hard_stop.cancel();
                c.tracker.wait().await;
            }
        } else {
            // The channel is gone, so in-flight deliveries cannot be acked any more;
            // their outcomes are in the inbox, and the broker redelivers them to be
            // suppressed. Give them a moment to finish, but never let one that hangs
            // on the dead connection hold up the next session.
            if tokio::time::timeout(drain, c.tracker.wait()).await.is_err() {
                tracing::warn!(
                    "in-flight deliveries still running after the broker session ended; \
                     reconnecting without them (the broker redelivers them)"
                );
            }
        }
    }

    /// Runs `work` on the loop's tracker, holding its slot until it is done.
    fn dispatch(&self, c: &Consumer<'_>, slot: OwnedSemaphorePermit, work: Work) {
        let (this, publish, acks) = (self.clone(), c.publish.clone(), c.acks.clone());
        c.tracker.spawn(async move {
            match work {
                Work::Send(delivery, mark_at, lane) => {
                    this.handle_send(delivery, (mark_at, lane), &publish, &acks)
                        .await
                }
                Work::Relay(delivery, decision, job) => {
                    this.handle_relay(delivery, (decision, job), &publish, &acks)
                        .await
                }
            }
            drop(slot);
        });
    }
}
