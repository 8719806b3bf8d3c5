//! Declaring and deleting the topology [`Topology`] names (`<p>.events` among
//! them), and what the broker's refusals mean, in words. Also `queue_depths`: passive
//! declares, for `postie status` and the console.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::topology::{insert, string, DelayLayout, Ladder, Topology, ROUTING_KEY};

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
    /// Declares everything; safe to run any number of times, from any instance. A
    /// `<p>.dead` declared by an older postie (without its delivery limit) is refused
    /// with 406 here; [`Topology::declare_on`] keeps it instead, as start-up does.
    pub async fn declare(&self, channel: &Channel) -> Result<(), TopologyError> {
        self.declare_with(channel, false).await
    }

    /// [`Topology::declare`], `<p>.dead` with its arguments as an older postie
    /// declared them if `legacy_dead`.
    pub(in crate::broker) async fn declare_with(
        &self,
        channel: &Channel,
        legacy_dead: bool,
    ) -> Result<(), TopologyError> {
        self.declare_delayed_exchange(channel).await?;
        for (name, kind) in [
            (self.work_exchange(), ExchangeKind::Direct),
            (self.retry_exchange(), ExchangeKind::Direct),
            (self.dead_exchange(), ExchangeKind::Fanout),
            (self.events_exchange(), ExchangeKind::Topic),
        ] {
            self.declare_exchange(channel, name, kind, FieldTable::default())
                .await?;
        }

        let mut send_args = self.quorum_args();
        dead_letter_to(&mut send_args, self.dead_exchange());
        insert(
            &mut send_args,
            "x-delivery-limit",
            AMQPValue::LongInt(self.delivery_limit as i32),
        );
        // Each lane's send queue (the default lane's is `<p>.send`, routed `email`,
        // and with lanes also `email.<default>`).
        for lane in self.lanes() {
            self.declare_queue(channel, &lane.queue, send_args.clone())
                .await?;
            for key in lane.keys() {
                self.bind(channel, &lane.queue, self.work_exchange(), key)
                    .await?;
            }
        }

        for (n, step) in self.retry_steps.iter().enumerate() {
            let mut args = self.quorum_args();
            dead_letter_to(&mut args, self.work_exchange());
            insert(&mut args, "x-dead-letter-routing-key", string(ROUTING_KEY));
            insert(
                &mut args,
                "x-message-ttl",
                AMQPValue::LongLongInt(step.as_millis() as i64),
            );
            let queue = self.retry_queue(n);
            self.declare_queue(channel, queue, args).await?;
            self.bind(channel, queue, self.retry_exchange(), queue)
                .await?;
        }

        // Looking at a dead letter must never drop it: a limit no number of looks
        // reaches (topology::DEAD_DELIVERY_LIMIT; RabbitMQ 4.x's default is 20).
        self.declare_queue(
            channel,
            self.dead_queue(),
            self.dead_queue_args(legacy_dead),
        )
        .await?;
        self.bind(
            channel,
            self.dead_queue(),
            self.dead_exchange(),
            ROUTING_KEY,
        )
        .await?;

        match self.delay {
            DelayLayout::Plugin => {
                // A lane's routing key on the plugin's exchange reaches its queue.
                for lane in self.lanes() {
                    for key in lane.keys() {
                        self.bind(channel, &lane.queue, self.delayed_exchange(), key)
                            .await?;
                    }
                }
                Ok(())
            }
            DelayLayout::Ladder(ladder) => self.declare_ladder(channel, ladder).await,
        }
    }

    async fn declare_delayed_exchange(&self, channel: &Channel) -> Result<(), TopologyError> {
        let name = self.delayed_exchange();
        let (kind, args) = self.delayed_exchange_spec();
        match self.declare_exchange(channel, name, kind, args).await {
            Err(TopologyError::Mismatch { detail, .. }) => Err(TopologyError::ModeMismatch {
                exchange: name.to_owned(),
                detail,
            }),
            other => other,
        }
    }

    /// The intake queue and the cascade: see the `delay` module for the shape.
    async fn declare_ladder(&self, channel: &Channel, ladder: Ladder) -> Result<(), TopologyError> {
        let mut intake_args = self.quorum_args();
        dead_letter_to(&mut intake_args, self.dead_exchange());
        insert(
            &mut intake_args,
            "x-delivery-limit",
            AMQPValue::LongInt(self.delivery_limit as i32),
        );
        // An intake per lane (the default lane's is `<p>.intake`, routed `email`).
        for lane in self.lanes() {
            self.declare_queue(channel, &lane.intake, intake_args.clone())
                .await?;
            for key in lane.keys() {
                self.bind(channel, &lane.intake, self.delayed_exchange(), key)
                    .await?;
            }
        }

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
                dead_letter_to(&mut args, self.work_exchange());
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
                self.bind(channel, self.send_queue(), &self.delay_level(0), &zero)
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

pub(in crate::broker) fn classify(what: String, source: lapin::Error) -> TopologyError {
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
fn unknown_exchange_type(detail: &str) -> bool {
    let detail = detail.to_ascii_lowercase();
    detail.contains("x-delayed-message")
        && (detail.contains("unknown exchange type") || detail.contains("invalid exchange type"))
}

#[cfg(test)]
mod tests;

/// Ready messages and consumers of one queue (a passive declare), or `None` if the
/// queue is missing.
pub(crate) type QueueDepth = (String, Option<(u32, u32)>);

/// The depth of each queue in `queues`, by passive declares on channels of `conn`
/// (a missing queue closes its channel; the next one gets a new channel).
pub(crate) async fn queue_depths(
    conn: &lapin::Connection,
    queues: &[String],
) -> Result<Vec<QueueDepth>, lapin::Error> {
    let mut depths = Vec::with_capacity(queues.len());
    let mut channel = conn.create_channel().await?;
    for queue in queues {
        let options = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match channel
            .queue_declare(queue.as_str().into(), options, FieldTable::default())
            .await
        {
            Ok(q) => depths.push((queue.clone(), Some((q.message_count(), q.consumer_count())))),
            Err(_) => {
                depths.push((queue.clone(), None));
                // A failed passive declare closes the channel.
                channel = conn.create_channel().await?;
            }
        }
    }
    let _ = channel.close(200, "done".into()).await;
    Ok(depths)
}
