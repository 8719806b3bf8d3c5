//! Delivery events (issue 30): the outbox (`postie_events`, `inbox::events`)
//! published to the topic exchange `<p>.events` on the session's confirm channel;
//! here too each event's routing key (`email.<outcome>.<type>`) and JSON body.
//!
//! Every instance runs this loop in its session, not the maintenance leader alone:
//! each pass takes the oldest events no other instance is publishing (`FOR UPDATE
//! SKIP LOCKED`), publishes them with their confirms awaited together, and deletes
//! them in the same transaction, so the events of a busy fleet go out as fast as
//! the fleet records outcomes, no instance waits for a leader's hand-over after a
//! crash (a killed instance's transaction ends with its connection and its rows are
//! taken by the next pass elsewhere), and the publish rides the session's channel and
//! reconnects. A pass that finds fewer than `events.batch` rows sleeps
//! `events.poll_interval`; a full one is followed at once. A failure (broker refusal
//! or outage, PostgreSQL) leaves the rows where they are, and the loop backs off
//! (`ops::backoff`).
//!
//! At least once: a batch whose confirms arrived but whose delete did not commit (a
//! crash, a lost database) is published again. Each event's id (the row's) is its
//! AMQP `message_id` and its body's `id`, for consumers to dedupe by.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::types::ShortString;
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use super::publisher::Publisher;
use super::Service;
use crate::broker::PublishError;
use crate::contract::message_id_of;
use crate::inbox::{Event, OutboxError};
use crate::ops::backoff::Backoff;

impl Service {
    /// Starts this session's event publisher (None: `events.enabled = false`); it
    /// ends with `stop`.
    pub(super) fn spawn_events(
        &self,
        publisher: Publisher,
        stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if !self.cx.settings.events.enabled {
            return None;
        }
        let service = self.clone();
        Some(tokio::spawn(async move {
            service.publish_events(&publisher, &stop).await;
        }))
    }

    /// Publishes the outbox, pass after pass, until `stop`.
    async fn publish_events(&self, publisher: &Publisher, stop: &CancellationToken) {
        let settings = &self.cx.settings;
        let poll = settings.events.poll_interval;
        let mut backoff = Backoff::new(poll, settings.worker.outage_backoff_max.max(poll));
        // A pass's deadline: the database's and the broker's.
        let deadline = settings.database.statement_timeout + settings.amqp.connect_timeout;
        let mut failing = false;
        while !stop.is_cancelled() {
            let pass = tokio::time::timeout(deadline, self.events_pass(publisher)).await;
            let wait = match pass {
                Ok(Ok(published)) => {
                    if failing {
                        tracing::info!("publishing delivery events again");
                        failing = false;
                    }
                    backoff.succeeded();
                    if published >= settings.events.batch as usize {
                        Duration::ZERO
                    } else {
                        poll
                    }
                }
                failed => {
                    let error = match failed {
                        Ok(Err(error)) => error.to_string(),
                        _ => format!("no answer within {}", humantime::format_duration(deadline)),
                    };
                    if !failing {
                        tracing::warn!(%error, "could not publish delivery events; they stay in the outbox and are tried again");
                    }
                    failing = true;
                    backoff.failed()
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One batch: taken, published (confirms awaited together), deleted.
    async fn events_pass(&self, publisher: &Publisher) -> Result<usize, OutboxError<PublishError>> {
        let exchange = self.cx.topology.events_exchange();
        let metrics = self.cx.metrics();
        let limit = i64::from(self.cx.settings.events.batch);
        let domain = self.cx.settings.transport.message_id_domain.as_str();
        let published = self
            .cx
            .inbox
            .publish_events(limit, |mut events: Vec<Event>| async move {
                let now = Utc::now();
                for event in &mut events {
                    if event.message_id.is_none() {
                        event.message_id = Some(message_id_of(&event.key, domain));
                    }
                }
                if let Some(oldest) = events.iter().map(|e| e.occurred_at).min() {
                    let age = (now - oldest).num_milliseconds().max(0) as f64 / 1000.0;
                    metrics.events_backlog_seconds.set(age);
                }
                let publishes = events.iter().map(|event| async move {
                    let (key, body) = (routing_key(event), body(event, now));
                    // Not mandatory: an event no consumer has bound a queue for is
                    // dropped by the broker, as a topic exchange does.
                    let properties = properties(event, now);
                    publisher
                        .publish(exchange, &key, false, &body, properties)
                        .await
                });
                futures_util::future::try_join_all(publishes).await?;
                for event in &events {
                    metrics.events_published.inc(event.outcome);
                }
                Ok(())
            })
            .await?;
        if published == 0 {
            metrics.events_backlog_seconds.set(0.0);
        }
        Ok(published)
    }
}

/// `email.<outcome>.<type>`: the type with each `.` written `_` (one word of the
/// routing key), `none` when the job had none.
pub(crate) fn routing_key(event: &Event) -> String {
    let kind = match event.kind.as_deref() {
        Some(kind) if !kind.is_empty() => kind.replace('.', "_"),
        _ => "none".to_owned(),
    };
    format!("email.{}.{kind}", event.outcome.as_str())
}

/// The event's JSON body (`schema/email-event.v1.json`).
fn body(event: &Event, published_at: DateTime<Utc>) -> Vec<u8> {
    let time = |t: DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::Millis, true);
    let json = serde_json::json!({
        "version": 1,
        "id": event.id.to_string(),
        "outcome": event.outcome.as_str(),
        "key": event.key,
        "type": event.kind,
        "message_id": event.message_id,
        "provider": event.provider,
        "provider_message_id": event.provider_message_id,
        "reason": event.reason,
        "attempts": event.attempts,
        "occurred_at": time(event.occurred_at),
        "published_at": time(published_at),
    });
    serde_json::to_vec(&json).expect("a JSON value serialises")
}

/// Persistent JSON, its id as `message_id`, the publish's time as `timestamp`.
fn properties(event: &Event, published_at: DateTime<Utc>) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"))
        .with_message_id(ShortString::from(event.id.to_string()))
        .with_type(ShortString::from("email-event.v1"))
        .with_app_id(ShortString::from("postie"))
        .with_timestamp(published_at.timestamp().max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::metrics::EventOutcome;

    fn event(kind: Option<&str>) -> Event {
        Event {
            id: 7,
            key: "order-1:receipt".into(),
            outcome: EventOutcome::Dead,
            kind: kind.map(str::to_owned),
            message_id: Some("<m@x>".into()),
            provider: None,
            provider_message_id: None,
            reason: Some("550 5.7.1 no".into()),
            attempts: 1,
            occurred_at: DateTime::from_timestamp_millis(1_700_000_000_123).unwrap(),
        }
    }

    #[test]
    fn the_routing_key_names_outcome_and_type_in_three_words() {
        assert_eq!(routing_key(&event(Some("receipt"))), "email.dead.receipt");
        assert_eq!(routing_key(&event(Some("a.b"))), "email.dead.a_b");
        assert_eq!(routing_key(&event(None)), "email.dead.none");
    }

    #[test]
    fn the_body_carries_the_id_as_text_and_both_times() {
        let now = DateTime::from_timestamp_millis(1_700_000_001_000).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body(&event(None), now)).unwrap();
        assert_eq!(body["id"], "7");
        assert_eq!(body["type"], serde_json::Value::Null);
        assert_eq!(body["occurred_at"], "2023-11-14T22:13:20.123Z");
        assert_eq!(body["published_at"], "2023-11-14T22:13:21.000Z");
        let props = properties(&event(None), now);
        assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("7"));
    }
}
