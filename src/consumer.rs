//! `postie serve`: the supervised consume loop.
//!
//! One connection, one consuming channel (prefetch N, manual ack) and one publishing
//! channel with confirms. Each delivery goes to the [`Worker`]; its [`Outcome`] is
//! mapped here to "publish (confirmed) then ack". If the connection or the consumer
//! is lost, in-flight work finishes or is abandoned unacked (the broker redelivers),
//! and the loop reconnects with backoff. On stop it cancels the consumer, lets
//! in-flight deliveries finish within the drain timeout, and closes cleanly.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::amqp::{self, PublishError};
use crate::config::Settings;
use crate::inbox::Inbox;
use crate::mailer::Mailer;
use crate::topology::{Topology, ROUTING_KEY};
use crate::worker::{Health, Outcome, Worker};

/// How long in-flight deliveries get to finish after a stop is asked for.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the service until `stop` is cancelled. Fails fast (one clear error) if a
/// dependency is unreachable at start-up; after that, outages are ridden out.
pub async fn serve(settings: Settings, stop: CancellationToken) -> anyhow::Result<()> {
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    if settings.database.migrate_on_start {
        for applied in inbox.migrate().await? {
            tracing::info!(migration = %applied, "applied migration");
        }
    }
    let mailer = Mailer::new(&settings.smtp)?;
    let topology = Topology::new(&settings.topology);
    let owner = settings.instance_id();
    let connection =
        amqp::connect(&settings.amqp.url, &owner, settings.amqp.connect_timeout).await?;
    topology
        .declare(&connection.create_channel().await?)
        .await?;

    let hard_stop = CancellationToken::new();
    let worker = Worker::new(
        inbox,
        mailer,
        topology.clone(),
        settings.worker.clone(),
        settings.smtp.default_from.clone(),
        owner.clone(),
        Health::default(),
        hard_stop.clone(),
    );
    let consumer = Consumer {
        worker,
        topology,
        settings: Arc::new(settings),
        owner,
        hard_stop,
    };
    tracing::info!(instance = %consumer.owner, queue = %consumer.topology.send_queue(), "postie serving");
    consumer.run(connection, stop).await;
    tracing::info!("postie stopped");
    Ok(())
}

/// Why a session with the broker ended.
enum SessionEnd {
    /// A stop was asked for; drained.
    Stopped,
    /// The connection, a channel or the consumer went away.
    Lost(String),
}

#[derive(Clone)]
struct Consumer {
    worker: Worker,
    topology: Topology,
    settings: Arc<Settings>,
    owner: String,
    hard_stop: CancellationToken,
}

impl Consumer {
    async fn run(&self, first: Connection, stop: CancellationToken) {
        let mut connection = Some(first);
        let mut backoff = Duration::from_millis(200);
        let max_backoff = self.settings.worker.outage_backoff_max;
        while !stop.is_cancelled() {
            let conn = match connection.take() {
                Some(conn) => conn,
                None => match amqp::connect(
                    &self.settings.amqp.url,
                    &self.owner,
                    self.settings.amqp.connect_timeout,
                )
                .await
                {
                    Ok(conn) => {
                        tracing::info!("reconnected to RabbitMQ");
                        conn
                    }
                    Err(error) => {
                        tracing::warn!(%error, "RabbitMQ unavailable; retrying");
                        sleep_unless(&stop, backoff).await;
                        backoff = (backoff * 2).min(max_backoff);
                        continue;
                    }
                },
            };
            match self.session(&conn, &stop).await {
                Ok(SessionEnd::Stopped) => {
                    let _ = conn.close(200, "postie shutting down".into()).await;
                    return;
                }
                Ok(SessionEnd::Lost(reason)) => {
                    tracing::warn!(%reason, "lost the broker session; reconnecting");
                }
                Err(error) => {
                    tracing::warn!(%error, "broker session failed; reconnecting");
                }
            }
            let _ = conn.close(320, "postie reconnecting".into()).await;
            backoff = Duration::from_millis(200);
            sleep_unless(&stop, backoff).await;
        }
    }

    async fn session(
        &self,
        conn: &Connection,
        stop: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        declare(&self.topology, conn).await?;
        let consume = conn.create_channel().await?;
        consume
            .basic_qos(self.settings.amqp.prefetch, BasicQosOptions::default())
            .await?;
        let publish = amqp::confirm_channel(conn).await?;
        let mut deliveries = consume
            .basic_consume(
                self.topology.send_queue().as_str().into(),
                format!("postie-{}", self.owner).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let health = self.worker.health().clone();
        let slots = Arc::new(Semaphore::new(self.settings.worker.concurrency));
        let tracker = TaskTracker::new();

        let end = loop {
            if !health.database_up() {
                tokio::select! {
                    _ = stop.cancelled() => break SessionEnd::Stopped,
                    _ = health.wait_database_up() => tracing::info!("PostgreSQL answers again; resuming"),
                }
            }
            let permit = tokio::select! {
                _ = stop.cancelled() => break SessionEnd::Stopped,
                permit = slots.clone().acquire_owned() => permit.expect("semaphore is never closed"),
            };
            let next = tokio::select! {
                _ = stop.cancelled() => break SessionEnd::Stopped,
                next = deliveries.next() => next,
            };
            match next {
                None => break SessionEnd::Lost("the broker cancelled the consumer".into()),
                Some(Err(error)) => break SessionEnd::Lost(error.to_string()),
                Some(Ok(delivery)) => {
                    let this = self.clone();
                    let publish = publish.clone();
                    tracker.spawn(async move {
                        this.handle(delivery, &publish).await;
                        drop(permit);
                    });
                }
            }
        };

        if let SessionEnd::Stopped = end {
            // Stop taking work; prefetched but unstarted deliveries go back on close.
            let _ = consume
                .basic_cancel(deliveries.tag(), BasicCancelOptions::default())
                .await;
            tracker.close();
            if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait())
                .await
                .is_err()
            {
                tracing::warn!("drain timeout: abandoning in-flight deliveries to redelivery");
                self.hard_stop.cancel();
                tracker.wait().await;
            }
        } else {
            tracker.close();
            tracker.wait().await;
        }
        let _ = consume.close(200, "done".into()).await;
        let _ = publish.close(200, "done".into()).await;
        Ok(end)
    }

    async fn handle(&self, delivery: Delivery, publish: &Channel) {
        let span = tracing::info_span!(
            "delivery",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
            redelivered = delivery.redelivered,
        );
        async {
            let headers = delivery.properties.headers().as_ref();
            let outcome = match self.worker.process(&delivery.data, headers).await {
                Ok(outcome) => outcome,
                Err(interrupted) => {
                    tracing::warn!(%interrupted, "leaving the delivery unacked for redelivery");
                    return;
                }
            };
            log_outcome(&outcome);
            if let Err(error) = self.settle(&delivery, &outcome, publish).await {
                tracing::warn!(%error, "could not publish the outcome; leaving the delivery unacked");
                return;
            }
            match delivery.acker.ack(BasicAckOptions::default()).await {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    tracing::warn!("ack not delivered (channel gone); the broker will redeliver and the inbox will suppress it")
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Makes the outcome durable on the broker where it needs a new message.
    async fn settle(
        &self,
        delivery: &Delivery,
        outcome: &Outcome,
        publish: &Channel,
    ) -> Result<(), PublishError> {
        let original = delivery.properties.headers().as_ref();
        let (exchange, routing_key, headers) = match outcome {
            Outcome::Sent { .. } | Outcome::SentFenceLost { .. } | Outcome::Duplicate { .. } => {
                return Ok(())
            }
            Outcome::Deferred { step, .. } => (
                String::new(),
                self.topology.retry_queue(*step),
                amqp::without(original, &[]),
            ),
            Outcome::Retry {
                step,
                attempt,
                error,
                ..
            } => {
                let mut headers = amqp::without(original, &[]);
                amqp::set_int(&mut headers, amqp::HEADER_ATTEMPT, i64::from(*attempt));
                amqp::set_text(&mut headers, amqp::HEADER_LAST_ERROR, error);
                (String::new(), self.topology.retry_queue(*step), headers)
            }
            Outcome::DeadLetter {
                kind,
                reason,
                attempts,
                ..
            } => {
                // Without the attempt header, a replayed dead letter starts a fresh cycle.
                let mut headers = amqp::without(original, &[amqp::HEADER_ATTEMPT]);
                amqp::set_text(&mut headers, amqp::HEADER_DEAD_REASON, reason);
                amqp::set_text(&mut headers, amqp::HEADER_DEAD_KIND, kind.as_str());
                amqp::set_text(
                    &mut headers,
                    amqp::HEADER_DEAD_AT,
                    &chrono::Utc::now().to_rfc3339(),
                );
                amqp::set_int(
                    &mut headers,
                    amqp::HEADER_DEAD_ATTEMPTS,
                    i64::from(*attempts),
                );
                (
                    self.topology.dead_exchange(),
                    ROUTING_KEY.to_string(),
                    headers,
                )
            }
        };
        let properties: BasicProperties = delivery
            .properties
            .clone()
            .with_delivery_mode(2)
            .with_headers(headers);
        let mut backoff = Duration::from_millis(100);
        loop {
            match amqp::publish_confirmed(
                publish,
                &exchange,
                &routing_key,
                true,
                &delivery.data,
                properties.clone(),
            )
            .await
            {
                Ok(()) => return Ok(()),
                // The channel is gone: the delivery goes back to the queue by itself.
                Err(PublishError::Broker(e)) => return Err(PublishError::Broker(e)),
                Err(error) => {
                    tracing::warn!(%error, "republish refused; retrying");
                    tokio::select! {
                        _ = self.hard_stop.cancelled() => return Err(error),
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.settings.worker.outage_backoff_max);
                }
            }
        }
    }
}

fn log_outcome(outcome: &Outcome) {
    let span = tracing::Span::current();
    span.record("outcome", outcome.label());
    match outcome {
        Outcome::Sent { key, takeover } => {
            span.record("key", key.as_str());
            tracing::info!(takeover, "sent");
        }
        Outcome::SentFenceLost { key } => {
            span.record("key", key.as_str());
            tracing::warn!("sent, but another instance had taken the key over: possible duplicate");
        }
        Outcome::Duplicate { key } => {
            span.record("key", key.as_str());
            tracing::info!("already sent; duplicate suppressed");
        }
        Outcome::Deferred { key, step } => {
            span.record("key", key.as_str());
            tracing::info!(step, "claimed elsewhere; parked until the lease ends");
        }
        Outcome::Retry {
            key,
            step,
            attempt,
            error,
        } => {
            span.record("key", key.as_str());
            tracing::warn!(step, attempt, %error, "transient failure; will retry");
        }
        Outcome::DeadLetter {
            key,
            kind,
            reason,
            attempts,
        } => {
            if let Some(key) = key {
                span.record("key", key.as_str());
            }
            tracing::warn!(kind = kind.as_str(), attempts, %reason, "dead-lettered");
        }
    }
}

/// Declares the topology on a channel of its own, closed afterwards.
async fn declare(topology: &Topology, conn: &Connection) -> anyhow::Result<()> {
    let channel = conn.create_channel().await?;
    topology.declare(&channel).await?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

async fn sleep_unless(stop: &CancellationToken, wait: Duration) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(wait) => {}
    }
}
