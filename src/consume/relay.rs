//! Ladder mode's intake relay: reads a job's `x-delay` and `send_at` once, fixes its
//! due time (the later of the two), and
//! routes it into the TTL cascade, or, when it is due now, straight to its lane's
//! send queue, its lane recorded with it. `Service::scheduled_key` is the key a job
//! is scheduled under. The decision is
//! published with a confirm before the intake delivery is acked, so a relay killed
//! mid-stream loses nothing: unacked jobs go back to `<p>.intake`, and the stamped
//! due time keeps a re-relayed job from drifting later.
//!
//! The relay takes its prefetched deliveries earliest due first ([`DueOrder`]): in a
//! burst, a job due in a second is not relayed behind thousands due in an hour. The
//! route is spelled when the job is published, from the time left then, so time spent
//! waiting for a turn or for the pending record is not added to the delay.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use lapin::message::Delivery;
use lapin::types::FieldTable;

use super::publisher::Publisher;
use super::Service;
use crate::broker::Acks;
use crate::contract::{self, readable, IdempotencyKey, ParseRules, Peeked};
use crate::headers::{self, HEADER_DUE_AT};
use crate::ops::metrics::{DeadReason, RelayRoute};
use crate::topology::ladder::Route;
use crate::topology::{DelayLayout, LaneId, Topology};
use crate::work::{dead_letter, now_ms, DeadKind, Disposition, Interrupted, Target};

/// What becomes of one intake delivery, decided when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// Forward it, stamped with its due time (Unix ms); the route is spelled when it
    /// is published ([`route`]).
    Forward {
        /// Due time, Unix ms.
        due_ms: i64,
    },
    /// A bad `x-delay`: to the dead-letter queue with this reason.
    Invalid(String),
}

/// Fixes the due time of an intake delivery received at `now_ms`, its body's
/// clock time (if any) read already ([`contract::peek_relay`]): the later of it and
/// `x-delay`'s (a time postie stamped already holds both).
fn decide(
    topology: &Topology,
    headers: Option<&FieldTable>,
    timestamp_s: Option<u64>,
    now_ms: i64,
    send_at: Option<Result<i64, contract::InvalidJob>>,
) -> Decision {
    let max = topology.max_delay();
    let due = contract::due_at(headers, timestamp_s, now_ms, max).and_then(|due| {
        let send_at = send_at.transpose()?;
        contract::with_send_at(due, send_at, now_ms, max)
    });
    match due {
        Ok(due_ms) => Decision::Forward { due_ms },
        Err(invalid) => Decision::Invalid(invalid.0),
    }
}

/// Where a job due at `due_ms` goes at `now_ms`: the ladder's entry with the time
/// left spelled as the routing key, or the work exchange when it is due.
/// A job due now goes to its lane's queue at once; one routed through the ladder
/// lands in `<p>.send` and is moved to its lane there.
fn route(topology: &Topology, due_ms: i64, now_ms: i64, lane: LaneId) -> (String, String) {
    let route = match topology.delay() {
        DelayLayout::Ladder(ladder) => ladder.route(due_ms.saturating_sub(now_ms)),
        DelayLayout::Plugin => Route::Now,
    };
    match (route, topology.ladder_entry()) {
        (Route::Ladder { routing_key, .. }, Some(entry)) => (entry.to_owned(), routing_key),
        _ => (
            topology.work_exchange().to_owned(),
            topology.lane(lane).routing_key.clone(),
        ),
    }
}

/// How long a delivery may wait in the relay's window before it goes ahead of later
/// arrivals due sooner: a job due far ahead is not starved by a stream of near ones
/// (nor held unacked towards the broker's `consumer_timeout`).
pub(super) const RELAY_WAIT_MAX_MS: i64 = 60_000;

impl Decision {
    /// When the relay should take this delivery, received at `received_ms`: at its
    /// due time, but no later than [`RELAY_WAIT_MAX_MS`] after it arrived; invalid
    /// ones at once (they only need dead-lettering).
    pub(super) fn turn(&self, received_ms: i64) -> i64 {
        match self {
            Decision::Forward { due_ms } => {
                (*due_ms).min(received_ms.saturating_add(RELAY_WAIT_MAX_MS))
            }
            Decision::Invalid(_) => i64::MIN,
        }
    }
}

/// The relay's prefetched deliveries, taken by turn (see [`Decision::turn`]), then
/// in delivery order.
pub(super) struct DueOrder<T> {
    heap: BinaryHeap<Reverse<Waiting<T>>>,
}

/// One waiting item with its place in the order.
struct Waiting<T> {
    turn: i64,
    seq: u64,
    item: T,
}

impl<T> PartialEq for Waiting<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.turn, self.seq) == (other.turn, other.seq)
    }
}
impl<T> Eq for Waiting<T> {}
impl<T> PartialOrd for Waiting<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Waiting<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.turn, self.seq).cmp(&(other.turn, other.seq))
    }
}

impl<T> Default for DueOrder<T> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
        }
    }
}

impl DueOrder<(Delivery, Decision, Option<Peeked>)> {
    /// Takes in an intake delivery received at `now_ms`: its due time is fixed now,
    /// and a body over `rules`' size limit is refused by its length, unread. The body
    /// is read once, for its clock time and for its job's key, revision and lane
    /// (kept with it for the record).
    pub(super) fn arrive(
        &mut self,
        topology: &Topology,
        rules: &ParseRules<'_>,
        delivery: Delivery,
        now_ms: i64,
    ) {
        let props = &delivery.properties;
        let (decision, job) = match rules.check_size(&delivery.data) {
            Err(too_big) => (Decision::Invalid(too_big.0), None),
            Ok(()) => {
                let (clock, job) = contract::peek_relay(&delivery.data);
                let headers = props.headers().as_ref();
                let decision = decide(topology, headers, *props.timestamp(), now_ms, clock);
                (decision, job)
            }
        };
        let (turn, tag) = (decision.turn(now_ms), delivery.delivery_tag);
        self.push(turn, tag, (delivery, decision, job));
    }
}

impl<T> DueOrder<T> {
    /// Adds `item` (its delivery tag `seq`) to be taken at `turn`.
    pub(super) fn push(&mut self, turn: i64, seq: u64, item: T) {
        self.heap.push(Reverse(Waiting { turn, seq, item }));
    }

    /// The item whose turn comes first.
    pub(super) fn pop(&mut self) -> Option<T> {
        self.heap.pop().map(|Reverse(w)| w.item)
    }

    /// Whether nothing waits.
    pub(super) fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// A job as the relay records it: its key (namespaced), revision and lane.
pub(super) struct ScheduledJob {
    key: IdempotencyKey,
    revision: i32,
    lane: LaneId,
}

impl Service {
    /// One delivery of `<p>.intake`, with the decision made when it arrived: recorded
    /// as scheduled (when pending jobs are tracked), then forwarded into the ladder or
    /// to work, or dead-lettered.
    pub(super) async fn handle_relay(
        &self,
        mut delivery: Delivery,
        (decision, job): (Decision, Option<Peeked>),
        publish: &Publisher,
        acks: &Acks,
    ) {
        let mut lane = LaneId::default();
        if let Decision::Forward { due_ms } = decision {
            // The body was read when it arrived, for its due time and its job.
            let peeked = job.and_then(|job| self.scheduled(&delivery, job));
            lane = peeked.as_ref().map_or(lane, |job| job.lane);
            if self
                .record_scheduled(&mut delivery, due_ms, peeked)
                .await
                .is_err()
            {
                tracing::warn!("stopping: leaving the intake delivery unacked");
                return;
            }
        }
        let headers = delivery.properties.headers().as_ref();
        let metrics = self.cx.metrics();
        let disposition = match decision {
            Decision::Forward { due_ms } => {
                let (exchange, routing_key) = route(&self.cx.topology, due_ms, now_ms(), lane);
                let route = if exchange == self.cx.topology.work_exchange() {
                    RelayRoute::Now
                } else {
                    RelayRoute::Ladder
                };
                metrics.relayed.inc(route);
                let mut stamped = headers::without(headers, &[]);
                headers::set_int(&mut stamped, HEADER_DUE_AT, due_ms);
                Disposition::Republish(Target {
                    exchange,
                    routing_key,
                    headers: stamped,
                })
            }
            Decision::Invalid(reason) => {
                tracing::warn!(reason = %readable(&reason, 1_000), "dead-lettered at intake");
                metrics.dead(DeadReason::Invalid);
                Disposition::DeadLetter(dead_letter(
                    &self.cx.topology,
                    headers,
                    DeadKind::Invalid,
                    &reason,
                    0,
                ))
            }
        };
        self.dispose(disposition, &delivery, publish, acks).await;
    }

    /// Records the job as scheduled (when pending jobs are tracked and the body has a
    /// key), its body lent to the record, not copied, when the reconciler keeps bodies.
    /// The key and revision under which a delivery's job is (or would be) recorded as
    /// scheduled, read without parsing the whole body: in its producer's key space
    /// (`worker.key_namespace`); `None` for a job the worker will refuse.
    pub(super) fn scheduled_key(&self, delivery: &Delivery) -> Option<(IdempotencyKey, i32)> {
        let peeked = contract::peek_job(&delivery.data)?;
        self.scheduled(delivery, peeked)
            .map(|job| (job.key, job.revision))
    }

    /// The job `peeked` (read from `delivery`'s body) as it is recorded: its key in
    /// its producer's key space, its revision and its lane.
    fn scheduled(&self, delivery: &Delivery, peeked: Peeked) -> Option<ScheduledJob> {
        let user_id = delivery.properties.user_id().as_ref().map(|u| u.as_str());
        let rules = contract::ParseRules::from_settings(&self.cx.settings).for_user(user_id);
        Some(ScheduledJob {
            key: rules.namespaced(&peeked.key).ok()?,
            revision: peeked.revision,
            lane: self.cx.topology.lane_named(peeked.lane.as_deref()),
        })
    }

    async fn record_scheduled(
        &self,
        delivery: &mut Delivery,
        due_ms: i64,
        job: Option<ScheduledJob>,
    ) -> Result<(), Interrupted> {
        if !self.cx.settings.delay.track_pending {
            return Ok(());
        }
        let Some(ScheduledJob {
            key,
            revision,
            lane,
        }) = job
        else {
            return Ok(());
        };
        let body = self
            .cx
            .settings
            .delay
            .reconcile
            .then(|| std::mem::take(&mut delivery.data));
        let kept = self
            .scheduler
            .schedule(
                &key,
                revision,
                due_ms,
                self.cx.topology.lane_column(lane),
                body,
            )
            .await?;
        if let Some(body) = kept {
            delivery.data = body;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DelayMode;
    use crate::config::{DelaySettings, TopologySettings};
    use lapin::types::AMQPValue;
    use std::time::Duration;

    fn ladder() -> Topology {
        let delay = DelaySettings {
            resolution: Duration::from_secs(1),
            max: Duration::from_secs(60),
            ..DelaySettings::default()
        };
        let settings = TopologySettings {
            prefix: "p".into(),
            ..TopologySettings::default()
        };
        Topology::new(&settings, &delay, DelayMode::Ladder)
    }

    fn x_delay(ms: i64) -> FieldTable {
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongLongInt(ms));
        h
    }

    #[test]
    fn routes_into_the_ladder_from_the_publish_time() {
        // Published at 10.000 s (ms header), received at 12.000 s, delay 5 s → due 15 s,
        // 3 s left → 3 units.
        let mut h = x_delay(5_000);
        h.insert(
            crate::headers::HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(10_000),
        );
        let topology = ladder();
        assert_eq!(
            decide(&topology, Some(&h), None, 12_000, None),
            Decision::Forward { due_ms: 15_000 }
        );
        assert_eq!(
            route(&topology, 15_000, 12_000, LaneId::default()),
            ("p.delay.5".into(), "0.0.0.0.1.1.email".into())
        );
    }

    #[test]
    fn due_or_overdue_jobs_go_straight_to_work() {
        let topology = ladder();
        for h in [x_delay(0), x_delay(-1), x_delay(999)] {
            match decide(&topology, Some(&h), None, 1_000, None) {
                Decision::Forward { due_ms } => {
                    assert_eq!(
                        route(&topology, due_ms, 1_000, LaneId::default()).0,
                        "p.work"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_relay_takes_the_earliest_turn_first_and_ages_far_ones() {
        let received = 1_000_000;
        let far = Decision::Forward {
            due_ms: received + 3_600_000,
        };
        let near = Decision::Forward {
            due_ms: received + 1_000,
        };
        let bad = Decision::Invalid("bad".into());
        assert_eq!(far.turn(received), received + RELAY_WAIT_MAX_MS);
        assert_eq!(near.turn(received), received + 1_000);
        assert_eq!(bad.turn(received), i64::MIN);

        let mut order = DueOrder::default();
        order.push(far.turn(received), 1, "far, first in");
        order.push(near.turn(received + 5), 2, "near");
        order.push(near.turn(received + 5), 3, "near, later tag");
        order.push(bad.turn(received + 9), 4, "invalid");
        // A far job received a minute later still waits behind the first far one.
        order.push(far.turn(received + 60_000), 5, "far, a minute later");
        let taken: Vec<_> = std::iter::from_fn(|| order.pop()).collect();
        assert_eq!(
            taken,
            [
                "invalid",
                "near",
                "near, later tag",
                "far, first in",
                "far, a minute later"
            ]
        );
        assert!(order.is_empty());
    }

    #[test]
    fn send_at_and_x_delay_the_later_fixes_the_due_time() {
        let delayed = x_delay(5_000);
        let forward = |h: &FieldTable, send_at| decide(&ladder(), Some(h), None, 1_000, send_at);
        assert_eq!(
            forward(&delayed, Some(Ok(9_000))),
            Decision::Forward { due_ms: 9_000 }
        );
        assert_eq!(
            forward(&delayed, Some(Ok(2_000))),
            Decision::Forward { due_ms: 6_000 }
        );
        assert_eq!(
            forward(&FieldTable::default(), Some(Ok(-5_000))),
            Decision::Forward { due_ms: 1_000 },
            "a send_at in the past is due now"
        );
        let bad = contract::InvalidJob("send_at \"soon\" is not an RFC 3339 time".into());
        assert!(
            matches!(forward(&delayed, Some(Err(bad))), Decision::Invalid(r) if r.contains("soon"))
        );
        assert!(
            matches!(forward(&delayed, Some(Ok(62_000))), Decision::Invalid(r) if r.contains("send_at is 1m 1s ahead, over the maximum"))
        );
    }

    #[test]
    fn too_long_or_garbage_delays_are_invalid() {
        let too_long = x_delay(61_000);
        assert!(
            matches!(decide(&ladder(), Some(&too_long), None, 0, None), Decision::Invalid(r) if r.contains("over the maximum"))
        );
        let mut garbage = FieldTable::default();
        garbage.insert("x-delay".into(), AMQPValue::LongString("tomorrow".into()));
        assert!(
            matches!(decide(&ladder(), Some(&garbage), None, 0, None), Decision::Invalid(r) if r.contains("not an integer"))
        );
    }
}
