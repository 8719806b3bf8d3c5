//! Ladder mode's intake relay: reads a job's `x-delay` once, fixes its due time, and
//! routes it into the TTL cascade (or straight to work when due). The decision is
//! published with a confirm before the intake delivery is acked, so a relay killed
//! mid-stream loses nothing: unacked jobs go back to `<p>.intake`, and the stamped
//! due time keeps a re-relayed job from drifting later.

use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::Channel;

use super::Service;
use crate::broker::ladder::Route;
use crate::broker::{Acks, DelayLayout, Topology, ROUTING_KEY};
use crate::contract::{self, readable};
use crate::headers::{self, HEADER_DUE_AT};
use crate::ops::metrics::{DeadReason, RouteLabel};
use crate::work::{dead_letter, now_ms, DeadKind, Disposition, Target};

/// Where one intake delivery goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// Publish to `exchange` with `routing_key`, stamped with `due_ms`.
    Forward {
        /// Target exchange.
        exchange: String,
        /// Routing key (binary delay for the ladder, `email` for work).
        routing_key: String,
        /// Due time, Unix ms.
        due_ms: i64,
    },
    /// A bad `x-delay`: to the dead-letter queue with this reason.
    Invalid(String),
}

/// Decides the route of an intake delivery received at `now_ms`.
pub(super) fn decide(
    topology: &Topology,
    headers: Option<&FieldTable>,
    timestamp_s: Option<u64>,
    now_ms: i64,
) -> Decision {
    let due_ms = match contract::due_at(headers, timestamp_s, now_ms, topology.max_delay()) {
        Ok(due) => due,
        Err(invalid) => return Decision::Invalid(invalid.0),
    };
    let route = match topology.delay() {
        DelayLayout::Ladder(ladder) => ladder.route(due_ms.saturating_sub(now_ms)),
        DelayLayout::Plugin => Route::Now,
    };
    match (route, topology.ladder_entry()) {
        (Route::Ladder { routing_key, .. }, Some(entry)) => Decision::Forward {
            exchange: entry,
            routing_key,
            due_ms,
        },
        _ => Decision::Forward {
            exchange: topology.work_exchange(),
            routing_key: ROUTING_KEY.to_string(),
            due_ms,
        },
    }
}

impl Service {
    /// One delivery of `<p>.intake`: recorded as scheduled (when pending jobs are
    /// tracked), then forwarded into the ladder or to work, or dead-lettered.
    pub(super) async fn handle_relay(&self, delivery: Delivery, publish: &Channel, acks: &Acks) {
        let props = &delivery.properties;
        let headers = props.headers().as_ref();
        let metrics = self.worker.health().metrics();
        let disposition = match decide(&self.topology, headers, *props.timestamp(), now_ms()) {
            Decision::Forward {
                exchange,
                routing_key,
                due_ms,
            } => {
                if self.settings.delay.track_pending {
                    if let Some((key, revision)) = contract::peek_key(&delivery.data) {
                        let body = self.settings.delay.reconcile.then(|| delivery.data.clone());
                        let recorded = self.scheduler.schedule(&key, revision, due_ms, body);
                        if recorded.await.is_err() {
                            tracing::warn!("stopping: leaving the intake delivery unacked");
                            return;
                        }
                    }
                }
                let route = if routing_key == ROUTING_KEY {
                    "now"
                } else {
                    "ladder"
                };
                metrics
                    .relayed
                    .get_or_create(&RouteLabel {
                        route: route.into(),
                    })
                    .inc();
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
                metrics.dead(DeadReason::invalid);
                Disposition::DeadLetter(dead_letter(
                    &self.topology,
                    headers,
                    DeadKind::Invalid,
                    &reason,
                    0,
                ))
            }
        };
        self.dispose(disposition, &delivery, publish, acks).await;
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
        assert_eq!(
            decide(&ladder(), Some(&h), None, 12_000),
            Decision::Forward {
                exchange: "p.delay.5".into(),
                routing_key: "0.0.0.0.1.1.email".into(),
                due_ms: 15_000
            }
        );
    }

    #[test]
    fn due_or_overdue_jobs_go_straight_to_work() {
        for h in [x_delay(0), x_delay(-1), x_delay(999)] {
            match decide(&ladder(), Some(&h), None, 1_000) {
                Decision::Forward { exchange, .. } => assert_eq!(exchange, "p.work"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn too_long_or_garbage_delays_are_invalid() {
        let too_long = x_delay(61_000);
        assert!(
            matches!(decide(&ladder(), Some(&too_long), None, 0), Decision::Invalid(r) if r.contains("over the maximum"))
        );
        let mut garbage = FieldTable::default();
        garbage.insert("x-delay".into(), AMQPValue::LongString("tomorrow".into()));
        assert!(
            matches!(decide(&ladder(), Some(&garbage), None, 0), Decision::Invalid(r) if r.contains("not an integer"))
        );
    }
}
