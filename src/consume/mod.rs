//! `postie serve`: the supervised consume loops.
//!
//! One connection per session, one publishing channel with confirms, and one
//! consuming channel per role: the **send** role (`<p>.send` → [`Worker`]) and, in
//! ladder mode, the **relay** role (`<p>.intake` → the ladder). Each delivery ends in
//! a [`Disposition`](crate::work::Disposition), carried out in one place
//! (`send.rs`): "publish (confirmed) then ack", "ack", or "leave unacked".
//!
//! - this file: start-up, which builds the `work::Context` once; `Service`, the
//!   context plus the worker and ladder mode's batch writers.
//! - `session.rs`: the supervisor (connect, declare, run the roles, reconnect).
//! - `stream.rs`: one consumer on one queue, with bounded concurrency and draining.
//! - `send.rs`: the send role's handler, and dispositions carried out.
//! - `publisher.rs`: the session's confirm channel, replaced when the broker closes it.
//! - `relay.rs`: the relay role (ladder mode); `scheduler.rs` batches its pending records.
//! - `arrivals.rs`: ladder mode's marks on send deliveries that wait unclaimed.
//! - `pollers.rs`: queue depths and the pending gauge for `/metrics`.
//! - `maintenance.rs`: pruning, the reconciler (`reconcile.rs`) and the pollers, on
//!   one instance (advisory lock on a dedicated connection).
//! - `events.rs`: the delivery events' outbox published to `<p>.events`, on every
//!   instance (`FOR UPDATE SKIP LOCKED`), on the session's confirm channel.
//! - `outbox.rs`: the producers' transactional outboxes (`outbox.sources`) relayed
//!   to `<p>.delayed`, a task per source for the life of `serve`, on the current
//!   session's confirm channel.
//!
//! If the connection, a channel or a consumer is lost, in-flight work finishes or is
//! abandoned unacked (the broker redelivers), and the session is rebuilt with backoff.
//! On stop, consumers are cancelled, in-flight deliveries get the drain timeout to
//! finish, and the connection is closed cleanly.

mod arrivals;
mod events;
mod maintenance;
mod outbox;
mod pollers;
mod publisher;
mod reconcile;
mod relay;
mod scheduler;
mod send;
mod session;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::broker;
use crate::config::Settings;
use crate::headers::Seal;
use crate::inbox::Inbox;
use crate::mail::Mailer;
use crate::ops::health::Health;
use crate::ops::metrics::{LaneLabel, Metrics};
use crate::topology::LaneId;
use crate::work::{Context, SharedContext, Worker};

/// The longest a goodbye (channel or connection close, consumer cancel, ack) may take
/// before the session moves on: a dead socket must not hold up recovery.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the service until `stop` is cancelled. Fails fast (one clear error) if a
/// dependency is unreachable or misconfigured at start-up; after that, outages are
/// ridden out.
pub async fn serve(settings: Settings, stop: CancellationToken) -> anyhow::Result<()> {
    let health = Health::new(Arc::new(Metrics::new()));
    let http_stop = CancellationToken::new();
    let _http_guard = http_stop.clone().drop_guard();
    if let Some(addr) = settings.http.listen {
        crate::ops::http::start(&settings.http, addr, health.clone(), http_stop.clone()).await?;
    }
    let parsed = settings.validate()?;
    let inbox =
        Inbox::new(&parsed.database, &settings.database)?.with_events(settings.events.enabled);
    inbox.check(&settings.database.url).await?;
    if settings.database.migrate_on_start {
        for applied in inbox.migrate().await? {
            tracing::info!(migration = %applied, "applied migration");
        }
    } else {
        inbox.check_schema().await?;
    }
    // Due times are read on PostgreSQL's clock: measured before the first is read.
    let mut clock_warned = None;
    if let Err(error) = inbox.sync_clock(&mut clock_warned).await {
        tracing::warn!(%error, "could not measure this instance's clock against PostgreSQL's; using it as is until the next try");
    }
    let clock = tokio::spawn({
        let (inbox, stop) = (inbox.clone(), stop.child_token());
        async move { inbox.discipline_clock(clock_warned, stop).await }
    });
    if let Some(addr) = settings.feedback.listen {
        let metrics = health.metrics().clone();
        crate::feedback::start(&settings, addr, inbox.clone(), metrics, http_stop.clone()).await?;
    }
    let outbox = parsed
        .outbox
        .iter()
        .map(|source| crate::outbox::Source::new(source, &settings.database))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let trust_unsealed = settings.worker.trust_unsealed_headers;
    if trust_unsealed {
        tracing::warn!("worker.trust_unsealed_headers = true: postie-* headers without this fleet's seal are obeyed, a producer's too; turn it off once the copies of the postie before the upgrade are through");
    }
    let seal = Seal::new(&inbox.header_key().await?, trust_unsealed);
    let mailer = Mailer::with_routes(&parsed.providers, &settings, health.metrics())?;
    let topology = broker::resolve_topology(&settings).await?;
    let owner = settings.instance_id();
    let amqp = parsed.amqp;
    let connection = broker::connect(&amqp, &owner, settings.amqp.connect_timeout).await?;
    session::declare(&topology, &connection.connection).await?;

    let cx = Arc::new(Context {
        settings,
        topology,
        owner,
        amqp,
        inbox,
        mailer,
        health,
        seal,
        hard_stop: CancellationToken::new(),
    });
    let inbox = cx.inbox.clone();
    let service = Service::new(cx, outbox);
    service.announce(&connection.address);
    let maintenance = service.spawn_maintenance(stop.child_token());
    let relays = service.spawn_outbox(&stop.child_token());
    service.run(connection, stop).await;
    // `stop` is cancelled by now: maintenance ends and releases its lock, and the
    // outbox relays finish their pass.
    let _ = tokio::time::timeout(GOODBYE_TIMEOUT, maintenance).await;
    for relay in relays {
        let abort = relay.abort_handle();
        if tokio::time::timeout(GOODBYE_TIMEOUT, relay).await.is_err() {
            abort.abort();
        }
    }
    inbox.flush_sends().await;
    clock.abort();
    tracing::info!("postie stopped");
    Ok(())
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
    /// A lane's send queue (`<p>.send`, `<p>.send.<lane>`): claim, send, record.
    Send(LaneId),
    /// `<p>.intake`: route into the ladder.
    Relay,
}

/// What every consume loop of this instance shares; cheap to clone.
#[derive(Clone)]
struct Service {
    /// The instance's context: settings, topology, owner, inbox, mailer, health,
    /// hard stop.
    cx: SharedContext,
    /// The unit of work.
    worker: Worker,
    /// Ladder mode: records scheduled jobs in batches.
    scheduler: scheduler::Scheduler,
    /// Ladder mode: marks waiting send deliveries as arrived, in batches.
    arrivals: arrivals::Arrivals,
    /// The producers' outboxes this instance relays (`outbox.sources`).
    outbox: Arc<Vec<crate::outbox::Source>>,
    /// The current broker session's confirm channel (None between sessions), for
    /// the outbox relays, which outlive sessions.
    session_publisher: Arc<tokio::sync::watch::Sender<Option<publisher::Publisher>>>,
    /// Each lane's metric label, in lane order, spelled once.
    lane_labels: Arc<[LaneLabel]>,
}

impl Service {
    /// The consume side over `cx`: the worker, ladder mode's batch writers, and the
    /// outbox sources to relay.
    fn new(cx: SharedContext, outbox: Vec<crate::outbox::Source>) -> Self {
        let worker = Worker::new(cx.clone());
        let marks = cx.settings.delay.track_pending
            && cx.settings.delay.reconcile
            && matches!(cx.topology.delay(), crate::topology::DelayLayout::Ladder(_));
        Self {
            arrivals: arrivals::Arrivals::start(cx.inbox.clone(), marks),
            scheduler: scheduler::Scheduler::start(worker.clone()),
            worker,
            cx: cx.clone(),
            outbox: Arc::new(outbox),
            session_publisher: Arc::new(tokio::sync::watch::channel(None).0),
            lane_labels: (cx.topology.lanes().iter())
                .map(|lane| LaneLabel {
                    lane: lane.name.clone(),
                })
                .collect(),
        }
    }

    /// Says what this instance serves, and the in-flight bound it keeps.
    fn announce(&self, broker: &str) {
        tracing::info!(
            instance = %self.cx.owner,
            delay_mode = self.cx.topology.mode_name(),
            queue = %self.cx.topology.send_queue(),
            lanes = %self.cx.topology.lanes().iter().map(|l| format!("{}={}", l.name, l.weight)).collect::<Vec<_>>().join(","),
            broker = %broker,
            "postie serving"
        );
        let prefetch = self.prefetch();
        tracing::info!(
            send_prefetch = prefetch.send,
            relay_prefetch = prefetch.relay,
            inflight_bytes = self.cx.settings.worker.inflight_bytes,
            max_body_bytes = self.cx.settings.worker.max_body_bytes,
            "in-flight bodies bounded: each lane's prefetch × max_body_bytes fits inflight_bytes"
        );
    }
}
