//! `events.*`: the delivery events published to `<p>.events` (issue 30).

use std::time::Duration;

use serde::Deserialize;

use super::de::duration;

/// Delivery events: one per outcome of a job (sent, dead, suppressed, throttled,
/// cancelled; bounced and complained from the feedback), written to the
/// `postie_events` outbox with the outcome and published to the topic exchange
/// `<p>.events` with publisher confirms, at least once (the event's id is its AMQP
/// `message_id`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSettings {
    /// Write and publish events. Off: no outbox row is written (the exchange is
    /// still declared).
    pub enabled: bool,
    /// The most events one publish takes from the outbox (one transaction, their
    /// confirms awaited together); 1 to 10,000. Also bounds what an instance holds.
    pub batch: u32,
    /// How often each instance looks for events to publish when the last look found
    /// fewer than `batch` (a full batch is followed at once).
    #[serde(deserialize_with = "duration")]
    pub poll_interval: Duration,
}

impl Default for EventsSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            batch: 256,
            poll_interval: Duration::from_millis(200),
        }
    }
}
