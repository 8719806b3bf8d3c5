//! A consumer of `<p>.events`, as a producer's would be: every delivery event a test's
//! postie publishes, collected, and the event schema to check them against.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Connection;
use serde_json::Value;

use super::{eventually, TestEnv};

/// One event as a consumer received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub routing_key: String,
    /// The AMQP `message_id`.
    pub amqp_id: Option<String>,
    pub body: Value,
    /// When the test received it (Unix ms).
    pub at_ms: i64,
}

/// A consumer of `<p>.events`: an exclusive queue (deleted with its connection)
/// bound with `#`, collecting every event.
pub struct Tap {
    _conn: Connection,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Tap {
    pub async fn new(env: &TestEnv) -> Self {
        let addresses = postie::config::AmqpAddresses::parse(&secrecy::SecretString::from(
            env.amqp_url.clone(),
        ))
        .unwrap();
        let conn =
            postie::testing::broker::connect(&addresses, "events-tap", Duration::from_secs(10))
                .await
                .expect("RabbitMQ for tests")
                .connection;
        let channel = conn.create_channel().await.unwrap();
        let queue = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.name().clone(),
                env.topology.events_exchange().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut consumer = channel
            .basic_consume(
                queue.name().clone(),
                "events-tap".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let body: Value = serde_json::from_slice(&delivery.data).expect("JSON event");
                sink.lock().unwrap().push(Received {
                    routing_key: delivery.routing_key.to_string(),
                    amqp_id: delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|m| m.to_string()),
                    body,
                    at_ms: chrono::Utc::now().timestamp_millis(),
                });
                let _ = delivery.ack(BasicAckOptions::default()).await;
            }
        });
        Self { _conn: conn, got }
    }

    pub fn events(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until every (key, outcome) of `expected` has an event.
    pub async fn wait_for(&self, expected: &BTreeSet<(String, String)>, timeout: Duration) {
        let tap = &self;
        eventually("every expected event", timeout, || async move {
            let seen: BTreeSet<(String, String)> = tap.events().iter().map(key_outcome).collect();
            expected.is_subset(&seen).then_some(())
        })
        .await;
    }
}

pub fn key_outcome(event: &Received) -> (String, String) {
    (
        event.body["key"].as_str().unwrap_or_default().to_owned(),
        event.body["outcome"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// The delivery event's JSON Schema, compiled.
pub fn validator() -> jsonschema::Validator {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema/email-event.v1.json");
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::meta::validate(&schema).expect("a valid JSON Schema");
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .expect("the event schema compiles")
}

/// Checks what every event must be: schema-valid, its routing key its outcome and
/// type, its AMQP message_id its id.
pub fn check_each(events: &[Received]) {
    let validator = validator();
    for event in events {
        let errors: Vec<String> = validator
            .iter_errors(&event.body)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{}: {errors:?}", event.body);
        let kind = event.body["type"]
            .as_str()
            .unwrap_or("none")
            .replace('.', "_");
        let outcome = event.body["outcome"].as_str().unwrap();
        assert_eq!(event.routing_key, format!("email.{outcome}.{kind}"));
        assert_eq!(event.amqp_id.as_deref(), event.body["id"].as_str());
    }
}
