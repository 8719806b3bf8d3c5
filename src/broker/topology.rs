//! The broker objects, named from one prefix and declared idempotently.
//!
//! ```text
//! plugin:  producers ─▶ <p>.delayed (x-delayed-message) ─────────────────────┐
//! ladder:  producers ─▶ <p>.delayed (direct) ─▶ <p>.intake ─▶ relay ─▶ <p>.delay.<k> cascade
//!                                                                 │        │
//!                                                                 ▼        ▼
//!          <p>.retry.<n> ── TTL ──▶ <p>.work ──email──▶ <p>.send ◀──────────┘
//!                                                    │ (delivery limit)
//!                                                    ▼
//!                               <p>.dlx ──▶ <p>.dead ◀── dead letters (with reasons)
//! ```

use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

use super::ladder::Ladder;
use crate::config::DelayMode;
use crate::config::{DelaySettings, TopologySettings};
use crate::contract::PLUGIN_MAX_DELAY;

/// How `<p>.delayed` holds jobs until due: the resolved delay mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelayLayout {
    /// The broker's delayed-message plugin.
    Plugin,
    /// postie's intake relay and TTL cascade.
    Ladder(Ladder),
}

/// The routing key of the contract: producers publish with it and every internal
/// hop keeps it.
pub const ROUTING_KEY: &str = "email";

/// Names and arguments of every exchange and queue, derived from the settings.
#[derive(Debug, Clone)]
pub struct Topology {
    prefix: String,
    retry_steps: Vec<Duration>,
    delivery_limit: u32,
    quorum_group: Option<u32>,
    delay: DelayLayout,
    max_delay: Duration,
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
    /// `<p>.delayed` exists with the other mode's exchange type.
    #[error(
        "exchange {exchange} already exists with another type, so it was declared for the other \
         delay mode ({detail}); set delay.mode to match it, or switch modes deliberately: stop \
         publishers, let pending delayed jobs drain, delete {exchange}, then start postie"
    )]
    ModeMismatch {
        /// The exchange.
        exchange: String,
        /// The broker's text.
        detail: String,
    },
    /// Plugin mode on a broker without the plugin (503 unknown exchange type).
    #[error(
        "delay.mode = plugin, but the broker has no delayed-message plugin ({detail}); enable \
         rabbitmq_delayed_message_exchange on the broker, or set delay.mode = ladder (or auto)"
    )]
    PluginMissing {
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
    /// Builds the names from the settings, for a resolved delay mode (`Auto` is
    /// resolved by [`resolve_mode`] first; here it is taken as `Ladder`).
    pub fn new(settings: &TopologySettings, delay: &DelaySettings, mode: DelayMode) -> Self {
        let (layout, max_delay) = match mode {
            DelayMode::Plugin => (DelayLayout::Plugin, PLUGIN_MAX_DELAY),
            DelayMode::Ladder | DelayMode::Auto => (
                DelayLayout::Ladder(Ladder::new(delay.resolution, delay.max)),
                delay.max,
            ),
        };
        Self {
            prefix: settings.prefix.clone(),
            retry_steps: settings.retry_steps.clone(),
            delivery_limit: settings.delivery_limit,
            quorum_group: settings.quorum_initial_group_size,
            delay: layout,
            max_delay,
        }
    }

    /// The resolved delay layout.
    pub fn delay(&self) -> DelayLayout {
        self.delay
    }

    /// The resolved mode's name.
    pub fn mode_name(&self) -> &'static str {
        match self.delay {
            DelayLayout::Plugin => "plugin",
            DelayLayout::Ladder(_) => "ladder",
        }
    }

    /// The longest accepted `x-delay`.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// Ladder mode: the queue the intake relay consumes.
    pub fn intake_queue(&self) -> String {
        format!("{}.intake", self.prefix)
    }

    /// Ladder mode: level `k`'s exchange and queue (same name, different kinds).
    pub fn delay_level(&self, k: u32) -> String {
        format!("{}.delay.{k}", self.prefix)
    }

    /// Ladder mode: where the relay enters the cascade (the top level's exchange).
    pub fn ladder_entry(&self) -> Option<String> {
        match self.delay {
            DelayLayout::Ladder(ladder) => Some(self.delay_level(ladder.levels() - 1)),
            DelayLayout::Plugin => None,
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

    /// The exchange postie republishes retries through (so that it never needs
    /// the default exchange, and a least-privilege user suffices).
    pub fn retry_exchange(&self) -> String {
        format!("{}.retry", self.prefix)
    }

    /// Retry queue for backoff step `n` (0-based); also its routing key on
    /// [`Topology::retry_exchange`].
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
        if let DelayLayout::Ladder(ladder) = self.delay {
            queues.push(self.intake_queue());
            queues.extend((0..ladder.levels()).map(|k| self.delay_level(k)));
        }
        queues
    }

    /// Every exchange, for clean-up.
    pub fn exchanges(&self) -> Vec<String> {
        let mut exchanges = vec![
            self.delayed_exchange(),
            self.work_exchange(),
            self.retry_exchange(),
            self.dead_exchange(),
        ];
        if let DelayLayout::Ladder(ladder) = self.delay {
            exchanges.extend((0..ladder.levels()).map(|k| self.delay_level(k)));
        }
        exchanges
    }

    /// Declares everything; safe to run any number of times, from any instance.
    pub async fn declare(&self, channel: &Channel) -> Result<(), TopologyError> {
        self.declare_delayed_exchange(channel).await?;
        for (name, kind) in [
            (self.work_exchange(), ExchangeKind::Direct),
            (self.retry_exchange(), ExchangeKind::Direct),
            (self.dead_exchange(), ExchangeKind::Fanout),
        ] {
            self.declare_exchange(channel, &name, kind, FieldTable::default())
                .await?;
        }

        let mut send_args = self.quorum_args();
        dead_letter_to(&mut send_args, &self.dead_exchange());
        insert(
            &mut send_args,
            "x-delivery-limit",
            AMQPValue::LongInt(self.delivery_limit as i32),
        );
        self.declare_queue(channel, &self.send_queue(), send_args)
            .await?;
        self.bind(
            channel,
            &self.send_queue(),
            &self.work_exchange(),
            ROUTING_KEY,
        )
        .await?;

        for (n, step) in self.retry_steps.iter().enumerate() {
            let mut args = self.quorum_args();
            dead_letter_to(&mut args, &self.work_exchange());
            insert(&mut args, "x-dead-letter-routing-key", string(ROUTING_KEY));
            insert(
                &mut args,
                "x-message-ttl",
                AMQPValue::LongLongInt(step.as_millis() as i64),
            );
            let queue = self.retry_queue(n);
            self.declare_queue(channel, &queue, args).await?;
            self.bind(channel, &queue, &self.retry_exchange(), &queue)
                .await?;
        }

        self.declare_queue(channel, &self.dead_queue(), self.quorum_args())
            .await?;
        self.bind(
            channel,
            &self.dead_queue(),
            &self.dead_exchange(),
            ROUTING_KEY,
        )
        .await?;

        match self.delay {
            DelayLayout::Plugin => {
                self.bind(
                    channel,
                    &self.send_queue(),
                    &self.delayed_exchange(),
                    ROUTING_KEY,
                )
                .await
            }
            DelayLayout::Ladder(ladder) => self.declare_ladder(channel, ladder).await,
        }
    }

    /// The entry exchange's type and arguments in the resolved mode.
    pub fn delayed_exchange_spec(&self) -> (ExchangeKind, FieldTable) {
        match self.delay {
            DelayLayout::Plugin => {
                let mut args = FieldTable::default();
                insert(&mut args, "x-delayed-type", string("direct"));
                (ExchangeKind::Custom("x-delayed-message".into()), args)
            }
            DelayLayout::Ladder(_) => (ExchangeKind::Direct, FieldTable::default()),
        }
    }

    async fn declare_delayed_exchange(&self, channel: &Channel) -> Result<(), TopologyError> {
        let name = self.delayed_exchange();
        let (kind, args) = self.delayed_exchange_spec();
        match self.declare_exchange(channel, &name, kind, args).await {
            Err(TopologyError::Mismatch { detail, .. }) => Err(TopologyError::ModeMismatch {
                exchange: name,
                detail,
            }),
            other => other,
        }
    }

    /// The intake queue and the cascade: see the `delay` module for the shape.
    async fn declare_ladder(&self, channel: &Channel, ladder: Ladder) -> Result<(), TopologyError> {
        let mut intake_args = self.quorum_args();
        dead_letter_to(&mut intake_args, &self.dead_exchange());
        insert(
            &mut intake_args,
            "x-delivery-limit",
            AMQPValue::LongInt(self.delivery_limit as i32),
        );
        self.declare_queue(channel, &self.intake_queue(), intake_args)
            .await?;
        self.bind(
            channel,
            &self.intake_queue(),
            &self.delayed_exchange(),
            ROUTING_KEY,
        )
        .await?;

        for k in 0..ladder.levels() {
            let name = self.delay_level(k);
            self.declare_exchange(channel, &name, ExchangeKind::Topic, FieldTable::default())
                .await?;
            let mut args = self.quorum_args();
            insert(
                &mut args,
                "x-message-ttl",
                AMQPValue::LongLongInt(ladder.ttl(k).as_millis() as i64),
            );
            if k == 0 {
                dead_letter_to(&mut args, &self.work_exchange());
                insert(&mut args, "x-dead-letter-routing-key", string(ROUTING_KEY));
            } else {
                // Keep the binary routing key: the next level reads its own bit.
                dead_letter_to(&mut args, &self.delay_level(k - 1));
            }
            self.declare_queue(channel, &name, args).await?;
            self.bind(channel, &name, &name, &ladder.pattern(k, true))
                .await?;
        }
        // Zero bits skip a level without waiting; below level 0 is the send queue.
        for k in 0..ladder.levels() {
            let zero = ladder.pattern(k, false);
            if k == 0 {
                self.bind(channel, &self.send_queue(), &self.delay_level(0), &zero)
                    .await?;
            } else {
                let (source, destination) = (self.delay_level(k), self.delay_level(k - 1));
                channel
                    .exchange_bind(
                        destination.as_str().into(),
                        source.as_str().into(),
                        zero.as_str().into(),
                        ExchangeBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| classify(format!("binding {source} → {destination}"), e))?;
            }
        }
        Ok(())
    }

    async fn declare_exchange(
        &self,
        channel: &Channel,
        name: &str,
        kind: ExchangeKind,
        args: FieldTable,
    ) -> Result<(), TopologyError> {
        let options = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .exchange_declare(name.into(), kind, options, args)
            .await
            .map_err(|e| classify(format!("exchange {name}"), e))
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
        routing_key: &str,
    ) -> Result<(), TopologyError> {
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(format!("binding {exchange} → {queue}"), e))
    }

    /// Arguments shared by every queue that carries jobs: replicated quorum queues
    /// (whose dead-letter hops are at-least-once, which needs `reject-publish`
    /// overflow), on `topology.quorum_initial_group_size` nodes if set (the broker's
    /// default otherwise: every cluster node).
    pub fn quorum_args(&self) -> FieldTable {
        let mut args = FieldTable::default();
        insert(&mut args, "x-queue-type", string("quorum"));
        if let Some(size) = self.quorum_group {
            insert(
                &mut args,
                "x-quorum-initial-group-size",
                AMQPValue::LongInt(size.min(i32::MAX as u32) as i32),
            );
        }
        args
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

fn dead_letter_to(args: &mut FieldTable, exchange: &str) {
    insert(args, "x-dead-letter-exchange", string(exchange));
    insert(args, "x-dead-letter-strategy", string("at-least-once"));
    insert(args, "x-overflow", string("reject-publish"));
}

pub(super) fn insert(args: &mut FieldTable, key: &str, value: AMQPValue) {
    args.insert(ShortString::from(key), value);
}

pub(super) fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

pub(super) fn classify(what: String, source: lapin::Error) -> TopologyError {
    if let lapin::ErrorKind::ProtocolError(amqp) = source.kind() {
        let detail = amqp.get_message().to_string();
        // RabbitMQ 3.x refuses an unknown exchange type with 503 COMMAND_INVALID (and
        // closes the connection), 4.3 with 406 PRECONDITION_FAILED, the code a
        // conflicting redeclaration also gets: only the text tells them apart.
        if unknown_exchange_type(&detail) {
            return TopologyError::PluginMissing { detail };
        }
        if amqp.get_id() == 406 {
            return TopologyError::Mismatch { what, detail };
        }
    }
    TopologyError::Broker { what, source }
}

/// Whether a broker's refusal says it does not know the `x-delayed-message` exchange
/// type, however it words it (`unknown exchange type 'x-delayed-message'` on 3.10
/// and 4.3).
pub(super) fn unknown_exchange_type(detail: &str) -> bool {
    let detail = detail.to_ascii_lowercase();
    detail.contains("x-delayed-message")
        && (detail.contains("unknown exchange type") || detail.contains("invalid exchange type"))
}

#[cfg(test)]
mod tests;
