//! Ladder mode's intake relay (DESIGN §4): reads a job's `x-delay` once, fixes its
//! due time, and routes it into the TTL cascade (or straight to work when due).
//! The consumer publishes the decision with a confirm before it acks the intake
//! delivery, so a relay killed mid-stream loses nothing: unacked jobs go back to
//! `<p>.intake`, and the stamped due time keeps a re-relayed job from drifting later.

use lapin::types::FieldTable;

use crate::delay::{self, Route};
use crate::topology::{DelayLayout, Topology, ROUTING_KEY};

/// Where one intake delivery goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
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
pub fn decide(
    topology: &Topology,
    headers: Option<&FieldTable>,
    timestamp_s: Option<u64>,
    now_ms: i64,
) -> Decision {
    let due_ms = match delay::due_at(headers, timestamp_s, now_ms, topology.max_delay()) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DelaySettings, TopologySettings};
    use crate::delay::DelayMode;
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
            delay::HEADER_PUBLISHED_AT.into(),
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
