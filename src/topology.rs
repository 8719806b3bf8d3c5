//! The broker objects (DESIGN §2), named from one prefix and declared idempotently.
//!
//! ```text
//! producers ──▶ <p>.delayed ──email──▶ <p>.send ◀──email── <p>.work ◀─ TTL ─ <p>.retry.<n>
//!                                         │ (delivery limit)                     ▲
//!                                         ▼                                      │ republish
//!                                     <p>.dlx ──▶ <p>.dead ◀── dead letters ── postie
//! ```

use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::config::TopologySettings;

/// The routing key of the contract: producers publish with it and every internal
/// hop keeps it.
pub const ROUTING_KEY: &str = "email";

/// Names and arguments of every exchange and queue, derived from the settings.
#[derive(Debug, Clone)]
pub struct Topology {
    prefix: String,
    retry_steps: Vec<Duration>,
    delivery_limit: u32,
}

/// A declaration the broker refused, with the fix spelled out.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// An object exists with other arguments (406 PRECONDITION_FAILED).
    #[error(
        "{what} already exists on the broker with different settings ({detail}); \
         delete it (after moving its messages) or change topology.prefix"
    )]
    Mismatch {
        /// The object that clashed.
        what: String,
        /// The broker's text.
        detail: String,
    },
    /// Anything else the broker or the connection said.
    #[error("declaring {what}: {source}")]
    Broker {
        /// The object being declared.
        what: String,
        /// The cause.
        #[source]
        source: lapin::Error,
    },
}

impl Topology {
    /// Builds the names from the settings.
    pub fn new(settings: &TopologySettings) -> Self {
        Self {
            prefix: settings.prefix.clone(),
            retry_steps: settings.retry_steps.clone(),
            delivery_limit: settings.delivery_limit,
        }
    }

    /// The producers' entry exchange.
    pub fn delayed_exchange(&self) -> String {
        format!("{}.delayed", self.prefix)
    }

    /// Where due jobs and retries re-enter.
    pub fn work_exchange(&self) -> String {
        format!("{}.work", self.prefix)
    }

    /// The queue the consumers compete on.
    pub fn send_queue(&self) -> String {
        format!("{}.send", self.prefix)
    }

    /// Retry queue for backoff step `n` (0-based).
    pub fn retry_queue(&self, n: usize) -> String {
        format!("{}.retry.{n}", self.prefix)
    }

    /// The dead-letter exchange.
    pub fn dead_exchange(&self) -> String {
        format!("{}.dlx", self.prefix)
    }

    /// The dead-letter queue operators replay from.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// The backoff steps.
    pub fn retry_steps(&self) -> &[Duration] {
        &self.retry_steps
    }

    /// Every queue, for status and clean-up.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.send_queue(), self.dead_queue()];
        queues.extend((0..self.retry_steps.len()).map(|n| self.retry_queue(n)));
        queues
    }

    /// Every exchange, for clean-up.
    pub fn exchanges(&self) -> Vec<String> {
        vec![
            self.delayed_exchange(),
            self.work_exchange(),
            self.dead_exchange(),
        ]
    }

    /// The smallest retry step that is at least `wait`, or the largest one.
    pub fn step_at_least(&self, wait: Duration) -> usize {
        self.retry_steps
            .iter()
            .position(|step| *step >= wait)
            .unwrap_or(self.retry_steps.len().saturating_sub(1))
    }

    /// Declares everything; safe to run any number of times, from any instance.
    pub async fn declare(&self, channel: &Channel) -> Result<(), TopologyError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for (name, kind) in [
            (self.delayed_exchange(), ExchangeKind::Direct),
            (self.work_exchange(), ExchangeKind::Direct),
            (self.dead_exchange(), ExchangeKind::Fanout),
        ] {
            channel
                .exchange_declare(name.as_str().into(), kind, durable, FieldTable::default())
                .await
                .map_err(|e| classify(format!("exchange {name}"), e))?;
        }

        let mut send_args = quorum_args();
        dead_letter_to(&mut send_args, &self.dead_exchange());
        insert(
            &mut send_args,
            "x-delivery-limit",
            AMQPValue::LongInt(self.delivery_limit as i32),
        );
        self.declare_queue(channel, &self.send_queue(), send_args)
            .await?;
        for exchange in [self.work_exchange(), self.delayed_exchange()] {
            self.bind(channel, &self.send_queue(), &exchange).await?;
        }

        for (n, step) in self.retry_steps.iter().enumerate() {
            let mut args = quorum_args();
            dead_letter_to(&mut args, &self.work_exchange());
            insert(&mut args, "x-dead-letter-routing-key", string(ROUTING_KEY));
            insert(
                &mut args,
                "x-message-ttl",
                AMQPValue::LongLongInt(step.as_millis() as i64),
            );
            self.declare_queue(channel, &self.retry_queue(n), args)
                .await?;
        }

        self.declare_queue(channel, &self.dead_queue(), quorum_args())
            .await?;
        self.bind(channel, &self.dead_queue(), &self.dead_exchange())
            .await
    }

    async fn declare_queue(
        &self,
        channel: &Channel,
        name: &str,
        args: FieldTable,
    ) -> Result<(), TopologyError> {
        let options = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(name.into(), options, args)
            .await
            .map(|_| ())
            .map_err(|e| classify(format!("queue {name}"), e))
    }

    async fn bind(
        &self,
        channel: &Channel,
        queue: &str,
        exchange: &str,
    ) -> Result<(), TopologyError> {
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                ROUTING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(format!("binding {exchange} → {queue}"), e))
    }

    /// Deletes every queue and exchange (tests and `postie topology --delete`).
    pub async fn delete(&self, channel: &Channel) -> Result<(), lapin::Error> {
        for queue in self.queues() {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for exchange in self.exchanges() {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Arguments shared by every queue that carries jobs: replicated quorum queues whose
/// dead-letter hops are at-least-once (which needs `reject-publish` overflow).
fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    insert(&mut args, "x-queue-type", string("quorum"));
    args
}

fn dead_letter_to(args: &mut FieldTable, exchange: &str) {
    insert(args, "x-dead-letter-exchange", string(exchange));
    insert(args, "x-dead-letter-strategy", string("at-least-once"));
    insert(args, "x-overflow", string("reject-publish"));
}

fn insert(args: &mut FieldTable, key: &str, value: AMQPValue) {
    args.insert(ShortString::from(key), value);
}

fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

fn classify(what: String, source: lapin::Error) -> TopologyError {
    if let lapin::ErrorKind::ProtocolError(amqp) = source.kind() {
        if amqp.get_id() == 406 {
            return TopologyError::Mismatch {
                what,
                detail: amqp.get_message().to_string(),
            };
        }
    }
    TopologyError::Broker { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(steps: &[u64]) -> Topology {
        Topology::new(&TopologySettings {
            prefix: "p".into(),
            retry_steps: steps.iter().map(|s| Duration::from_secs(*s)).collect(),
            delivery_limit: 5,
        })
    }

    #[test]
    fn names_follow_the_prefix() {
        let t = topology(&[5, 30]);
        assert_eq!(t.send_queue(), "p.send");
        assert_eq!(t.retry_queue(1), "p.retry.1");
        assert_eq!(t.queues(), ["p.send", "p.dead", "p.retry.0", "p.retry.1"]);
        assert_eq!(t.exchanges(), ["p.delayed", "p.work", "p.dlx"]);
    }

    #[test]
    fn picks_the_smallest_step_covering_a_wait() {
        let t = topology(&[5, 30, 120]);
        assert_eq!(t.step_at_least(Duration::from_secs(1)), 0);
        assert_eq!(t.step_at_least(Duration::from_secs(5)), 0);
        assert_eq!(t.step_at_least(Duration::from_secs(6)), 1);
        assert_eq!(t.step_at_least(Duration::from_secs(1000)), 2);
    }
}
