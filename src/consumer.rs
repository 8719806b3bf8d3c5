//! `postie serve`: the supervised consume loops.
//!
//! One connection per session, one publishing channel with confirms, and one
//! consuming channel per role: the **send** role (`<p>.send` → [`Worker`]) and, in
//! ladder mode, the **relay** role (`<p>.intake` → [`relay::decide`]). Each delivery's
//! outcome is mapped here to "publish (confirmed) then ack", so the rule "no ack before
//! the outcome is durable" lives in one place.
//!
//! If the connection, a channel or a consumer is lost, in-flight work finishes or is
//! abandoned unacked (the broker redelivers), and the session is rebuilt with backoff.
//! On stop, consumers are cancelled, in-flight deliveries get the drain timeout to
//! finish, and the connection is closed cleanly.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::acks::Acks;
use crate::amqp::{self, PublishError};
use crate::config::Settings;
use crate::delay::{HEADER_DUE_AT, HEADER_X_DELAY};
use crate::health::Health;
use crate::inbox::Inbox;
use crate::job::readable;
use crate::mailer::Mailer;
use crate::metrics::{
    DeadReason, Dependency, Metrics, PolicyLabel, QueueLabel, RouteLabel, StepLabel,
};
use crate::relay::{self, Decision};
use crate::topology::{self, DelayLayout, Topology, ROUTING_KEY};
use crate::worker::{now_ms, DeadKind, Outcome, Worker};

/// How often queue depths are polled for `/metrics`.
const DEPTH_POLL: Duration = Duration::from_secs(10);
/// How often a consume loop checks that its connection still stands, in case the
/// consumer stream misses the connection's end.
const LIVENESS_POLL: Duration = Duration::from_secs(1);
/// The longest a goodbye (channel or connection close, consumer cancel, ack) may take
/// before the session moves on: a dead socket must not hold up recovery.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the service until `stop` is cancelled. Fails fast (one clear error) if a
/// dependency is unreachable or misconfigured at start-up; after that, outages are
/// ridden out.
pub async fn serve(settings: Settings, stop: CancellationToken) -> anyhow::Result<()> {
    let health = Health::new(Arc::new(Metrics::new()), settings.smtp.breaker_threshold);
    let http_stop = CancellationToken::new();
    let _http_guard = http_stop.clone().drop_guard();
    if let Some(addr) = settings.http.listen {
        crate::http::start(addr, health.clone(), http_stop.clone()).await?;
    }
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    if settings.database.migrate_on_start {
        for applied in inbox.migrate().await? {
            tracing::info!(migration = %applied, "applied migration");
        }
    }
    let mailer = Mailer::new(&settings.smtp)?;
    let topology = resolve_topology(&settings).await?;
    let owner = settings.instance_id();
    let connection =
        amqp::connect(&settings.amqp.url, &owner, settings.amqp.connect_timeout).await?;
    declare(&topology, &connection).await?;

    let hard_stop = CancellationToken::new();
    let worker = Worker::new(
        &settings,
        (inbox, mailer, topology.clone()),
        owner.clone(),
        health.clone(),
        hard_stop.clone(),
    );
    let service = Service {
        worker,
        topology,
        settings: Arc::new(settings),
        owner,
        hard_stop,
    };
    tracing::info!(
        instance = %service.owner,
        delay_mode = service.topology.mode_name(),
        queue = %service.topology.send_queue(),
        "postie serving"
    );
    service.run(connection, stop).await;
    tracing::info!("postie stopped");
    Ok(())
}

/// Resolves `delay.mode` (probing the broker for `auto`) and logs the choice.
pub async fn resolve_topology(settings: &Settings) -> anyhow::Result<Topology> {
    let mode = topology::resolve_mode(
        settings.delay.mode,
        &settings.topology,
        &settings.amqp.url,
        settings.amqp.connect_timeout,
    )
    .await?;
    if mode != settings.delay.mode {
        tracing::info!(
            configured = settings.delay.mode.as_str(),
            chosen = mode.as_str(),
            "delay mode probed"
        );
    }
    Ok(Topology::new(&settings.topology, &settings.delay, mode))
}

/// Why a session with the broker ended.
enum SessionEnd {
    /// A stop was asked for; drained.
    Stopped,
    /// The connection, a channel or a consumer went away.
    Lost(String),
}

/// What a consume loop does with its deliveries.
#[derive(Clone, Copy, Debug)]
enum Role {
    /// `<p>.send`: claim, send, record.
    Send,
    /// `<p>.intake`: route into the ladder.
    Relay,
}

#[derive(Clone)]
struct Service {
    worker: Worker,
    topology: Topology,
    settings: Arc<Settings>,
    owner: String,
    hard_stop: CancellationToken,
}

impl Service {
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
                        self.worker
                            .health()
                            .metrics()
                            .reconnected(Dependency::rabbitmq);
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
            let ended = self.session(&conn, &stop).await;
            self.worker.health().set_broker_up(false);
            match ended {
                Ok(SessionEnd::Stopped) => {
                    bounded(conn.close(200, "postie shutting down".into())).await;
                    return;
                }
                Ok(SessionEnd::Lost(reason)) => {
                    tracing::warn!(%reason, "lost the broker session; reconnecting");
                }
                Err(error) => {
                    tracing::warn!(error = %crate::describe_error(&error), "broker session failed; reconnecting");
                }
            }
            bounded(conn.close(320, "postie reconnecting".into())).await;
            backoff = Duration::from_millis(200);
            sleep_unless(&stop, backoff).await;
        }
    }

    /// One connection's worth of work: every role's consume loop, until one is lost
    /// or a stop is asked for.
    async fn session(
        &self,
        conn: &Connection,
        stop: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let setup = self.settings.amqp.connect_timeout;
        within(
            setup,
            "declaring the topology",
            declare(&self.topology, conn),
        )
        .await?;
        let publish = within(setup, "opening the publishing channel", async {
            Ok(amqp::confirm_channel(conn).await?)
        })
        .await?;
        let session_stop = stop.child_token();
        let lost = CancellationToken::new();
        watch_connection(conn, lost.clone(), session_stop.clone());
        within(
            setup,
            "starting the depth poller",
            self.spawn_depth_poller(conn, session_stop.clone()),
        )
        .await?;
        self.worker.health().set_broker_up(true);
        let send = self.consume_loop(
            conn,
            Role::Send,
            self.topology.send_queue(),
            self.settings.amqp.prefetch,
            self.settings.worker.concurrency,
            &publish,
            (&session_stop, &lost),
        );
        let end = if let DelayLayout::Ladder(_) = self.topology.delay() {
            let concurrency = self.settings.delay.relay_concurrency;
            let relay = self.consume_loop(
                conn,
                Role::Relay,
                self.topology.intake_queue(),
                concurrency,
                concurrency as usize,
                &publish,
                (&session_stop, &lost),
            );
            tokio::pin!(send, relay);
            // When one loop ends, the other ends too: drained if this is a stop,
            // abandoned to redelivery (like the broker's end) if the session is lost.
            let first = tokio::select! {
                end = &mut send => { lost.cancel(); let _ = relay.await; end }
                end = &mut relay => { lost.cancel(); let _ = send.await; end }
            };
            first
        } else {
            send.await
        };
        // Ends the watchdog and the depth poller of this session.
        session_stop.cancel();
        let end = end?;
        bounded(publish.close(200, "done".into())).await;
        Ok(match end {
            SessionEnd::Lost(reason) => SessionEnd::Lost(reason),
            SessionEnd::Stopped if stop.is_cancelled() => SessionEnd::Stopped,
            SessionEnd::Stopped => SessionEnd::Lost("the session ended".into()),
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn consume_loop(
        &self,
        conn: &Connection,
        role: Role,
        queue: String,
        prefetch: u16,
        concurrency: usize,
        publish: &Channel,
        (stop, lost): (&CancellationToken, &CancellationToken),
    ) -> anyhow::Result<SessionEnd> {
        let (channel, mut deliveries) = within(
            self.settings.amqp.connect_timeout,
            "starting a consumer",
            async {
                let channel = conn.create_channel().await?;
                channel
                    .basic_qos(prefetch, BasicQosOptions::default())
                    .await?;
                let deliveries = channel
                    .basic_consume(
                        queue.as_str().into(),
                        format!("postie-{}-{role:?}", self.owner).into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
                Ok((channel, deliveries))
            },
        )
        .await?;
        let health = self.worker.health().clone();
        let (acks, ack_task) = Acks::start(channel.clone());
        let slots = Arc::new(Semaphore::new(concurrency));
        let tracker = TaskTracker::new();

        let end = loop {
            if matches!(role, Role::Send) && health.paused() {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => break SessionEnd::Stopped,
                    _ = lost.cancelled() => break SessionEnd::Lost("the broker session ended".into()),
                    _ = health.wait_dependencies_up() => tracing::info!("dependencies answer again; resuming"),
                }
            }
            let permit = tokio::select! {
                biased;
                _ = stop.cancelled() => break SessionEnd::Stopped,
                _ = lost.cancelled() => break SessionEnd::Lost("the broker session ended".into()),
                permit = slots.clone().acquire_owned() => permit.expect("semaphore is never closed"),
            };
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => break SessionEnd::Stopped,
                _ = lost.cancelled() => break SessionEnd::Lost("the broker session ended".into()),
                next = deliveries.next() => next,
            };
            match next {
                None => {
                    break SessionEnd::Lost(format!("the broker cancelled the consumer on {queue}"))
                }
                Some(Err(error)) => break SessionEnd::Lost(error.to_string()),
                Some(Ok(delivery)) => {
                    let this = self.clone();
                    let publish = publish.clone();
                    let acks = acks.clone();
                    tracker.spawn(async move {
                        match role {
                            Role::Send => this.handle_send(delivery, &publish, &acks).await,
                            Role::Relay => this.handle_relay(delivery, &publish, &acks).await,
                        }
                        drop(permit);
                    });
                }
            }
        };

        if let SessionEnd::Stopped = end {
            health.set_draining();
            // Stop taking work; prefetched but unstarted deliveries go back on close.
            bounded(channel.basic_cancel(deliveries.tag(), BasicCancelOptions::default())).await;
            tracker.close();
            let drain = self.settings.worker.drain_timeout;
            if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
                tracing::warn!("drain timeout: abandoning in-flight deliveries to redelivery");
                self.hard_stop.cancel();
                tracker.wait().await;
            }
        } else {
            // The channel is gone, so in-flight deliveries cannot be acked any more;
            // their outcomes are in the inbox, and the broker redelivers them to be
            // suppressed. Give them a moment to finish, but never let one that hangs
            // on the dead connection hold up the next session.
            tracker.close();
            let drain = self.settings.worker.drain_timeout;
            if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
                tracing::warn!(
                    "in-flight deliveries still running after the broker session ended; \
                     reconnecting without them (the broker redelivers them)"
                );
            }
        }
        // The acks of everything finished go before the channel closes.
        drop(acks);
        ack_task.finish(GOODBYE_TIMEOUT).await;
        bounded(channel.close(200, "done".into())).await;
        Ok(end)
    }

    async fn handle_send(&self, delivery: Delivery, publish: &Channel, acks: &Acks) {
        let attempt =
            amqp::header_int(delivery.properties.headers().as_ref(), amqp::HEADER_ATTEMPT)
                .unwrap_or(0);
        let span = tracing::info_span!(
            "delivery",
            key = tracing::field::Empty,
            attempt,
            outcome = tracing::field::Empty,
            redelivered = delivery.redelivered,
        );
        // Continue the producer's trace, if the job carries one.
        let parent = crate::telemetry::parent_context(delivery.properties.headers().as_ref());
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
        let metrics = self.worker.health().metrics().clone();
        metrics.jobs_received.inc();
        metrics.in_flight.inc();
        let started = std::time::Instant::now();
        async {
            let props = &delivery.properties;
            let headers = props.headers().as_ref();
            let outcome = match self.worker.process(&delivery.data, headers, *props.timestamp()).await {
                Ok(outcome) => outcome,
                Err(interrupted) => {
                    tracing::warn!(%interrupted, "leaving the delivery unacked for redelivery");
                    return;
                }
            };
            log_outcome(&outcome);
            count_outcome(&metrics, &outcome);
            if let Some((exchange, routing_key, headers)) = self.republish_target(&outcome, headers) {
                if let Err(error) = self.publish_retrying(publish, &delivery, &exchange, &routing_key, headers).await {
                    tracing::warn!(%error, "could not publish the outcome; leaving the delivery unacked");
                    return;
                }
            }
            acks.done(delivery.delivery_tag);
            metrics.processing_seconds.observe(started.elapsed().as_secs_f64());
        }
        .instrument(span)
        .await;
        metrics.in_flight.dec();
    }

    async fn handle_relay(&self, delivery: Delivery, publish: &Channel, acks: &Acks) {
        let props = &delivery.properties;
        let headers = props.headers().as_ref();
        let (exchange, routing_key, headers) =
            match relay::decide(&self.topology, headers, *props.timestamp(), now_ms()) {
                Decision::Forward {
                    exchange,
                    routing_key,
                    due_ms,
                } => {
                    if self.settings.delay.track_pending {
                        if let Some((key, revision)) = crate::job::peek_key(&delivery.data) {
                            if self.worker.schedule(&key, revision, due_ms).await.is_err() {
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
                    let label = RouteLabel {
                        route: route.into(),
                    };
                    self.worker
                        .health()
                        .metrics()
                        .relayed
                        .get_or_create(&label)
                        .inc();
                    let mut stamped = amqp::without(headers, &[]);
                    amqp::set_int(&mut stamped, HEADER_DUE_AT, due_ms);
                    (exchange, routing_key, stamped)
                }
                Decision::Invalid(reason) => {
                    tracing::warn!(reason = %readable(&reason, 1_000), "dead-lettered at intake");
                    self.worker.health().metrics().dead(DeadReason::invalid);
                    let headers = dead_letter_headers(headers, DeadKind::Invalid, &reason, 0);
                    (
                        self.topology.dead_exchange(),
                        ROUTING_KEY.to_string(),
                        headers,
                    )
                }
            };
        match self
            .publish_retrying(publish, &delivery, &exchange, &routing_key, headers)
            .await
        {
            Ok(()) => acks.done(delivery.delivery_tag),
            Err(error) => {
                tracing::warn!(%error, "relay publish failed; leaving the intake delivery unacked")
            }
        }
    }

    /// Polls the depth of every queue for `/metrics` until `stop` (or until a queue
    /// is missing, which closes the channel; the next session starts a new poller).
    async fn spawn_depth_poller(
        &self,
        conn: &Connection,
        stop: CancellationToken,
    ) -> anyhow::Result<()> {
        let channel = conn.create_channel().await?;
        let topology = self.topology.clone();
        let metrics = self.worker.health().metrics().clone();
        let track_pending =
            self.settings.delay.track_pending && matches!(topology.delay(), DelayLayout::Ladder(_));
        let inbox = self.worker.inbox().clone();
        tokio::spawn(async move {
            'poll: loop {
                if track_pending {
                    if let Ok((_, total)) = inbox.pending(None, None, 0).await {
                        metrics.pending.set(total);
                    }
                }
                for queue in topology.queues() {
                    let passive = lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    match channel
                        .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                        .await
                    {
                        Ok(q) => metrics
                            .queue_depth
                            .get_or_create(&QueueLabel { queue })
                            .set(i64::from(q.message_count())),
                        Err(error) => {
                            tracing::debug!(%error, "queue depth poller stopped");
                            break 'poll;
                        }
                    };
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(DEPTH_POLL) => {}
                }
            }
            let _ = channel.close(200, "done".into()).await;
        });
        Ok(())
    }

    /// Where an outcome must be published before the ack, if anywhere.
    fn republish_target(
        &self,
        outcome: &Outcome,
        original: Option<&FieldTable>,
    ) -> Option<(String, String, FieldTable)> {
        Some(match outcome {
            Outcome::Sent { .. }
            | Outcome::SentFenceLost { .. }
            | Outcome::Duplicate { .. }
            | Outcome::Cancelled { .. }
            | Outcome::Stale { .. }
            | Outcome::CancelRequest { .. }
            | Outcome::Throttled { until_ms: None, .. } => return None,
            Outcome::Throttled {
                until_ms: Some(until),
                ..
            } => {
                let mut headers = amqp::without(original, &[]);
                amqp::set_int(&mut headers, HEADER_DUE_AT, *until);
                amqp::set_int(&mut headers, HEADER_X_DELAY, (*until - now_ms()).max(0));
                (
                    self.topology.delayed_exchange(),
                    ROUTING_KEY.to_string(),
                    headers,
                )
            }
            Outcome::Deferred { step, .. } => (
                self.topology.retry_exchange(),
                self.topology.retry_queue(*step),
                amqp::without(original, &[]),
            ),
            Outcome::Early {
                due_ms, early_ms, ..
            } => {
                // Back through the delayed exchange: the relay (ladder) reads the due
                // time; the plugin reads x-delay, set to what is left.
                let mut headers = amqp::without(original, &[]);
                amqp::set_int(&mut headers, HEADER_DUE_AT, *due_ms);
                amqp::set_int(&mut headers, HEADER_X_DELAY, *early_ms);
                (
                    self.topology.delayed_exchange(),
                    ROUTING_KEY.to_string(),
                    headers,
                )
            }
            Outcome::Retry {
                step,
                attempt,
                error,
                ..
            } => {
                let mut headers = amqp::without(original, &[]);
                amqp::set_int(&mut headers, amqp::HEADER_ATTEMPT, i64::from(*attempt));
                amqp::set_text(
                    &mut headers,
                    amqp::HEADER_LAST_ERROR,
                    &readable(error, 1_000),
                );
                (
                    self.topology.retry_exchange(),
                    self.topology.retry_queue(*step),
                    headers,
                )
            }
            Outcome::DeadLetter {
                kind,
                reason,
                attempts,
                ..
            } => (
                self.topology.dead_exchange(),
                ROUTING_KEY.to_string(),
                dead_letter_headers(original, *kind, reason, *attempts),
            ),
        })
    }

    /// Publishes a copy of the delivery (confirmed, persistent) with new headers,
    /// retrying while the broker refuses it; gives up only if the channel is gone
    /// (the delivery then returns to its queue by itself) or on hard stop.
    async fn publish_retrying(
        &self,
        publish: &Channel,
        delivery: &Delivery,
        exchange: &str,
        routing_key: &str,
        headers: FieldTable,
    ) -> Result<(), PublishError> {
        let headers = amqp::without(Some(&headers), amqp::BROKER_DEATH_HEADERS);
        let properties: BasicProperties = delivery
            .properties
            .clone()
            .with_delivery_mode(2)
            .with_headers(headers);
        // Plugin mode: the plugin returns a mandatory publish at once and still delivers it later.
        let mandatory = !(exchange == self.topology.delayed_exchange()
            && self.topology.delay() == DelayLayout::Plugin);
        let mut backoff = Duration::from_millis(100);
        loop {
            match amqp::publish_confirmed(
                publish,
                exchange,
                routing_key,
                mandatory,
                &delivery.data,
                properties.clone(),
            )
            .await
            {
                Ok(()) => return Ok(()),
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

/// Headers of a dead letter: the original ones, the reason, and no retry counter
/// (so that a replay starts a fresh cycle).
fn dead_letter_headers(
    original: Option<&FieldTable>,
    kind: DeadKind,
    reason: &str,
    attempts: u32,
) -> FieldTable {
    let mut headers = amqp::without(original, &[amqp::HEADER_ATTEMPT]);
    amqp::set_text(
        &mut headers,
        amqp::HEADER_DEAD_REASON,
        &readable(reason, 1_000),
    );
    amqp::set_text(&mut headers, amqp::HEADER_DEAD_KIND, kind.as_str());
    amqp::set_text(
        &mut headers,
        amqp::HEADER_DEAD_AT,
        &chrono::Utc::now().to_rfc3339(),
    );
    amqp::set_int(
        &mut headers,
        amqp::HEADER_DEAD_ATTEMPTS,
        i64::from(attempts),
    );
    headers
}

fn count_outcome(metrics: &Metrics, outcome: &Outcome) {
    match outcome {
        Outcome::Sent {
            takeover,
            lateness_ms,
            ..
        } => {
            metrics.emails_sent.inc();
            if *takeover {
                metrics.takeovers.inc();
            }
            metrics
                .lateness_seconds
                .observe(*lateness_ms as f64 / 1000.0);
        }
        Outcome::SentFenceLost { .. } => {
            metrics.emails_sent.inc();
        }
        Outcome::Duplicate { .. } => {
            metrics.duplicates_suppressed.inc();
        }
        Outcome::Cancelled { .. } => {
            metrics.cancelled.inc();
        }
        Outcome::Stale { .. } => {
            metrics.stale.inc();
        }
        Outcome::CancelRequest { .. } => {}
        Outcome::Throttled { until_ms, .. } => {
            let policy = if until_ms.is_some() { "defer" } else { "drop" };
            metrics
                .throttled
                .get_or_create(&PolicyLabel {
                    policy: policy.into(),
                })
                .inc();
        }
        Outcome::Deferred { .. } | Outcome::Early { .. } => {
            metrics.deferred.inc();
        }
        Outcome::Retry { step, .. } => {
            metrics
                .retries
                .get_or_create(&StepLabel { step: *step as u32 })
                .inc();
        }
        Outcome::DeadLetter { kind, .. } => metrics.dead(match kind {
            DeadKind::Invalid => DeadReason::invalid,
            DeadKind::Permanent => DeadReason::permanent,
            DeadKind::Exhausted => DeadReason::retries_exhausted,
        }),
    }
}

fn log_outcome(outcome: &Outcome) {
    let span = tracing::Span::current();
    span.record("outcome", outcome.label());
    match outcome {
        Outcome::Sent {
            key,
            takeover,
            lateness_ms,
        } => {
            span.record("key", key.as_str());
            tracing::info!(takeover, lateness_ms, "sent");
        }
        Outcome::SentFenceLost { key } => {
            span.record("key", key.as_str());
            tracing::warn!("sent, but another instance had taken the key over: possible duplicate");
        }
        Outcome::Duplicate { key } => {
            span.record("key", key.as_str());
            tracing::info!("already sent; duplicate suppressed");
        }
        Outcome::Cancelled { key } => {
            span.record("key", key.as_str());
            tracing::info!("cancelled; not sent");
        }
        Outcome::Stale { key } => {
            span.record("key", key.as_str());
            tracing::info!("a newer revision exists; skipped");
        }
        Outcome::CancelRequest { key, cancelled } => {
            span.record("key", key.as_str());
            tracing::info!(prior_status = %cancelled.prior_status, covers = cancelled.covers, "cancel recorded");
        }
        Outcome::Throttled { key, until_ms } => {
            span.record("key", key.as_str());
            tracing::info!(?until_ms, "throttled");
        }
        Outcome::Deferred { key, step } => {
            span.record("key", key.as_str());
            tracing::info!(step, "claimed elsewhere; parked until the lease ends");
        }
        Outcome::Early { key, early_ms, .. } => {
            span.record("key", key.as_str());
            tracing::warn!(early_ms, "arrived before its due time; sent back to wait");
        }
        Outcome::Retry {
            key,
            step,
            attempt,
            error,
        } => {
            span.record("key", key.as_str());
            tracing::warn!(step, attempt, error = %readable(error, 1_000), "transient failure; will retry");
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
            tracing::warn!(kind = kind.as_str(), attempts, reason = %readable(reason, 1_000), "dead-lettered");
        }
    }
}

/// Declares the topology on a channel of its own, closed afterwards.
async fn declare(topology: &Topology, conn: &Connection) -> anyhow::Result<()> {
    let channel = conn.create_channel().await?;
    topology.declare(&channel).await?;
    bounded(channel.close(200, "declared".into())).await;
    Ok(())
}

/// A session step with a deadline: a broker that accepts the connection but never
/// answers (still booting, or a half-dead socket) fails the session, which is then
/// rebuilt with backoff, instead of hanging it.
async fn within<T>(
    limit: Duration,
    what: &str,
    step: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(result) => result,
        Err(_) => Err(anyhow::anyhow!(
            "{what}: no answer from RabbitMQ within {}",
            humantime::format_duration(limit)
        )),
    }
}

/// A goodbye whose result does not matter, given at most [`GOODBYE_TIMEOUT`].
async fn bounded<T>(goodbye: impl std::future::Future<Output = T>) {
    let _ = tokio::time::timeout(GOODBYE_TIMEOUT, goodbye).await;
}

/// Cancels `lost` when the connection no longer stands (checked every
/// [`LIVENESS_POLL`]) or `done` is cancelled: a second way to notice a lost broker,
/// for when a consumer stream is not told.
fn watch_connection(conn: &Connection, lost: CancellationToken, done: CancellationToken) {
    let status = conn.status().clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(LIVENESS_POLL) => {}
            }
            if !status.connected() {
                tracing::debug!("the RabbitMQ connection no longer stands");
                lost.cancel();
                return;
            }
        }
    });
}

async fn sleep_unless(stop: &CancellationToken, wait: Duration) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(wait) => {}
    }
}
