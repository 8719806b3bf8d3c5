//! The session supervisor: connect (any broker address), declare, run every role's
//! consume loop on one connection until it is lost or a stop is asked for, then
//! reconnect with backoff. A consume loop (`stream::Feed`) per lane's send queue, the relay's in
//! ladder mode, and one per `topology.drain_prefixes` queue.

use std::time::Duration;

use std::sync::Arc;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::publisher::Publisher;
use super::stream::Feed;
use super::{Role, Service, SessionEnd, GOODBYE_TIMEOUT};
use crate::broker;
use crate::ops::backoff::Backoff;
use crate::ops::metrics::Dependency;
use crate::topology::{DelayLayout, LaneId, Topology};

/// How often a consume loop checks that its connection still stands, in case the
/// consumer stream misses the connection's end.
const LIVENESS_POLL: Duration = Duration::from_secs(1);

impl Service {
    /// Serves until `stop`: one session after another, reconnecting with backoff.
    pub(super) async fn run(&self, first: broker::Connected, stop: CancellationToken) {
        let mut connection = Some(first);
        // One backoff for dialling and for sessions that fail at once: it resets only
        // after a session that stood for its cap (a broker that accepts connections
        // but refuses the declaration is redialled ever more slowly, not 5 times a second).
        let mut backoff = Backoff::new(
            Duration::from_millis(200),
            self.cx.settings.worker.outage_backoff_max,
        );
        while !stop.is_cancelled() {
            // Each attempt tries every address in turn, starting past the last one used.
            let broker::Connected {
                connection: conn,
                address,
            } = match connection.take() {
                Some(first) => first,
                None => match broker::connect(
                    &self.cx.amqp,
                    &self.cx.owner,
                    self.cx.settings.amqp.connect_timeout,
                )
                .await
                {
                    Ok(connected) => {
                        tracing::info!(broker = %connected.address, "reconnected to RabbitMQ");
                        self.cx.metrics().reconnected(Dependency::Rabbitmq);
                        connected
                    }
                    Err(error) => {
                        let wait = backoff.failed();
                        tracing::warn!(%error, retry_in = ?wait, "RabbitMQ unavailable; retrying");
                        sleep_unless(&stop, wait).await;
                        continue;
                    }
                },
            };
            self.cx.health.set_broker_address(&address);
            let conn = Arc::new(conn);
            let mut up_since = None;
            let ended = self.session(&conn, &stop, &mut up_since).await;
            backoff.ran_for(up_since.map_or(Duration::ZERO, |t: std::time::Instant| t.elapsed()));
            let wait = backoff.failed();
            self.cx.health.set_broker_up(false);
            match ended {
                Ok(SessionEnd::Stopped) => {
                    bounded(conn.close(200, "postie shutting down".into())).await;
                    return;
                }
                Ok(SessionEnd::Lost(reason)) => {
                    tracing::warn!(%reason, broker = %address, retry_in = ?wait, "lost the broker session; reconnecting");
                }
                Err(error) => {
                    tracing::warn!(error = %crate::describe_error(&error), broker = %address, retry_in = ?wait, "broker session failed; reconnecting");
                }
            }
            bounded(conn.close(320, "postie reconnecting".into())).await;
            sleep_unless(&stop, wait).await;
        }
    }

    /// One connection's worth of work: every role's consume loop, until one is lost
    /// or a stop is asked for. `up_since` is set once the topology is declared and the
    /// publishing channel open.
    async fn session(
        &self,
        conn: &Arc<Connection>,
        stop: &CancellationToken,
        up_since: &mut Option<std::time::Instant>,
    ) -> anyhow::Result<SessionEnd> {
        let setup = self.cx.settings.amqp.connect_timeout;
        within(
            setup,
            "declaring the topology",
            declare(&self.cx.topology, conn),
        )
        .await?;
        let publish = within(setup, "opening the publishing channel", async {
            Ok(Publisher::open(conn.clone()).await?)
        })
        .await?;
        *up_since = Some(std::time::Instant::now());
        let session_stop = stop.child_token();
        let lost = CancellationToken::new();
        watch_connection(conn, lost.clone(), session_stop.clone());
        let events = self.spawn_events(publish.clone(), session_stop.clone());
        self.cx.health.set_broker_up(true);
        let feeds = self.feeds(conn).await?;
        // The outbox relays publish on this session's channel from now on.
        self.session_publisher.send_replace(Some(publish.clone()));
        let loops = feeds
            .into_iter()
            .map(|feed| Box::pin(self.consume_loop(conn, feed, &publish, (&session_stop, &lost))));
        // When one loop ends, the others end too: drained if this is a stop,
        // abandoned to redelivery (like the broker's end) if the session is lost.
        let (end, _, rest) = futures_util::future::select_all(loops).await;
        lost.cancel();
        futures_util::future::join_all(rest).await;
        self.session_publisher.send_replace(None);
        // Ends the watchdog and the event publisher of this session.
        session_stop.cancel();
        if let Some(events) = events {
            let abort = events.abort_handle();
            if tokio::time::timeout(GOODBYE_TIMEOUT, events).await.is_err() {
                abort.abort();
            }
        }
        let end = end?;
        publish.close().await;
        Ok(match end {
            SessionEnd::Lost(reason) => SessionEnd::Lost(reason),
            SessionEnd::Stopped if stop.is_cancelled() => SessionEnd::Stopped,
            SessionEnd::Stopped => SessionEnd::Lost("the session ended".into()),
        })
    }
}

impl Service {
    /// The session's consume loops: a send loop per lane (`<p>.send` first) with the
    /// worker's concurrency, in ladder mode a relay loop per lane's intake, and a send
    /// loop per drained queue.
    async fn feeds(&self, conn: &Connection) -> anyhow::Result<Vec<Feed>> {
        let send = |role, queue| Feed {
            role,
            queue,
            prefetch: self.prefetch().send,
            concurrency: self.cx.settings.worker.concurrency,
        };
        let lanes = self.cx.topology.lanes();
        let mut feeds: Vec<Feed> = (lanes.iter().enumerate())
            .map(|(i, lane)| send(Role::Send(LaneId(i)), lane.queue.clone()))
            .collect();
        if let DelayLayout::Ladder(_) = self.cx.topology.delay() {
            feeds.extend(lanes.iter().map(|lane| Feed {
                role: Role::Relay,
                queue: lane.intake.clone(),
                prefetch: self.prefetch().relay,
                concurrency: self.cx.settings.delay.relay_concurrency as usize,
            }));
        }
        for queue in self.drained_queues(conn).await? {
            feeds.push(send(Role::Send(LaneId::default()), queue));
        }
        Ok(feeds)
    }

    /// `<old>.send` of every `topology.drain_prefixes` entry that still exists (a
    /// passive declare each, on a channel of its own); a missing one is skipped, and
    /// said so once per session.
    async fn drained_queues(&self, conn: &Connection) -> anyhow::Result<Vec<String>> {
        let mut queues = Vec::new();
        for old in &self.cx.settings.topology.drain_prefixes {
            let queue = format!("{old}.send");
            let exists = within(
                self.cx.settings.amqp.connect_timeout,
                "checking a drained queue",
                broker::queue_exists(conn, &queue),
            )
            .await?;
            if exists {
                queues.push(queue);
            } else {
                tracing::info!(%queue, "topology.drain_prefixes: the queue is gone (drained and deleted?); not consuming it");
            }
        }
        Ok(queues)
    }
}

/// Declares the topology on channels of its own, closed afterwards (an existing
/// `<p>.dead` without its delivery limit kept, with a warning: `broker::dead`).
pub(super) async fn declare(topology: &Topology, conn: &Connection) -> anyhow::Result<()> {
    topology.declare_on(conn).await?;
    Ok(())
}

/// A session step with a deadline: a broker that accepts the connection but never
/// answers (still booting, or a half-dead socket) fails the session, which is then
/// rebuilt with backoff, instead of hanging it.
pub(super) async fn within<T>(
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
pub(super) async fn bounded<T>(goodbye: impl std::future::Future<Output = T>) {
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
