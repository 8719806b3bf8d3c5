//! Unit tests of `topology.rs`.

use std::time::Duration;

use super::*;
use crate::config::{DelayMode, DelaySettings, TopologySettings};
use crate::contract::PLUGIN_MAX_DELAY;
use crate::topology::*;

fn topology(steps: &[u64]) -> Topology {
    Topology::new(
        &TopologySettings {
            prefix: "p".into(),
            retry_steps: steps.iter().map(|s| Duration::from_secs(*s)).collect(),
            delivery_limit: 5,
            ..TopologySettings::default()
        },
        &DelaySettings::default(),
        DelayMode::Plugin,
    )
}

#[test]
fn the_quorum_group_size_is_set_only_when_configured() {
    let t = topology(&[5]);
    let args = t.quorum_args();
    assert!(args.inner().get("x-quorum-initial-group-size").is_none());
    let settings = TopologySettings {
        quorum_initial_group_size: Some(3),
        ..TopologySettings::default()
    };
    let t = Topology::new(&settings, &DelaySettings::default(), DelayMode::Ladder);
    assert_eq!(
        t.quorum_args().inner().get("x-quorum-initial-group-size"),
        Some(&AMQPValue::LongInt(3))
    );
}

#[test]
fn plugin_mode_declares_an_x_delayed_message_exchange_of_direct_type() {
    let t = topology(&[5]);
    let (kind, args) = t.delayed_exchange_spec();
    assert_eq!(kind, ExchangeKind::Custom("x-delayed-message".into()));
    assert_eq!(
        args.inner().get("x-delayed-type"),
        Some(&AMQPValue::LongString("direct".into()))
    );
    assert_eq!(t.max_delay(), PLUGIN_MAX_DELAY);
    assert_eq!(t.ladder_entry(), None);
    assert!(!t.queues().iter().any(|q| q.contains("intake")));
}

#[test]
fn broker_errors_map_to_messages_naming_the_fix() {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};
    let missing = lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
        AMQPErrorKind::Hard(AMQPHardError::COMMANDINVALID),
        "COMMAND_INVALID - unknown exchange type 'x-delayed-message'".into(),
    )));
    let text = classify("exchange p.delayed".into(), missing).to_string();
    assert!(
        text.contains("rabbitmq_delayed_message_exchange") && text.contains("delay.mode = ladder"),
        "{text}"
    );
    // RabbitMQ 4.3 refuses the unknown type with 406, the code of a real conflict.
    let missing_on_4 = lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
        "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'".into(),
    )));
    assert!(
        matches!(
            classify("exchange p.delayed".into(), missing_on_4),
            TopologyError::PluginMissing { .. }
        ),
        "4.3's 406 for an unknown type is not a conflicting declaration"
    );
    let mismatch = lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
        "PRECONDITION_FAILED - inequivalent arg 'type'".into(),
    )));
    let text = classify("queue p.retry.0".into(), mismatch).to_string();
    assert!(
        text.contains("p.retry.0") && text.contains("different settings"),
        "{text}"
    );
}

#[test]
fn ladder_mode_adds_the_intake_and_one_level_per_bit() {
    let delay = DelaySettings {
        resolution: Duration::from_secs(1),
        max: Duration::from_secs(7),
        ..DelaySettings::default()
    };
    let t = Topology::new(
        &TopologySettings {
            prefix: "p".into(),
            ..Default::default()
        },
        &delay,
        DelayMode::Ladder,
    );
    assert!(t.queues().contains(&"p.intake".to_string()));
    assert!(t.queues().contains(&"p.delay.2".to_string()));
    assert!(!t.queues().contains(&"p.delay.3".to_string()));
    assert_eq!(t.ladder_entry(), Some("p.delay.2"));
    assert_eq!(t.mode_name(), "ladder");
}

#[test]
fn names_follow_the_prefix() {
    let t = topology(&[5, 30]);
    assert_eq!(t.send_queue(), "p.send");
    assert_eq!(t.retry_queue(1), "p.retry.1");
    assert_eq!(t.queues(), ["p.send", "p.dead", "p.retry.0", "p.retry.1"]);
    assert_eq!(
        t.exchanges(),
        ["p.delayed", "p.work", "p.retry", "p.dlx", "p.events"]
    );
}

#[test]
fn pc_the_routing_names_are_spelled_once_and_lent() {
    let t = topology(&[5, 30]);
    // The same text every time: no name is formatted per call.
    for name in [
        Topology::work_exchange,
        Topology::send_queue,
        Topology::delayed_exchange,
        Topology::retry_exchange,
        Topology::dead_exchange,
        Topology::dead_queue,
        Topology::intake_queue,
    ] {
        assert!(std::ptr::eq(name(&t), name(&t)));
    }
    assert!(std::ptr::eq(t.retry_queue(0), t.retry_queue(0)));
    assert_eq!(
        [t.intake_queue(), t.dead_exchange(), t.retry_exchange()],
        ["p.intake", "p.dlx", "p.retry"]
    );
    assert_eq!(t.ladder_entry(), None);
    // delay_level is still spelled for any level (declarations and tests ask).
    assert_eq!(t.delay_level(9), "p.delay.9");
}
