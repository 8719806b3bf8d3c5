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
//!                               <p>.dlx ──▶ <p>.dead ◀── dead letters (with reasons;
//!                                                        a limit of 2^31 − 1 looks)
//!
//! outcomes (postie_events) ─▶ <p>.events (topic: email.<outcome>.<type>) ─▶ producers' queues
//! ```
//!
//! Data and arithmetic without I/O (`broker::declare` declares them), so that the
//! unit of work can name a target without touching the broker. Here: `Topology`,
//! every name spelled once in `Topology::new` and lent as `&str`; `DelayLayout`; the
//! queues' arguments (`<p>.dead`'s with `DEAD_DELIVERY_LIMIT`). `lanes.rs`: `Lane`
//! and `LaneId`, each lane's send queue, intake, routing keys (`Lane::keys`: the
//! default lane's alias `email.<default>` too), weight and caps; the default lane
//! first; `Topology::lane_named`, and `Topology::lane_column`, a lane as the inbox
//! records it. `ladder.rs`: the TTL cascade, a delay spelled in binary as a route
//! through the levels.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::config::DelayMode;
use crate::config::{DelaySettings, TopologySettings};
use crate::contract::PLUGIN_MAX_DELAY;

pub(crate) mod ladder;
mod lanes;

pub use ladder::Ladder;
pub(crate) use lanes::{Lane, LaneId};

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

/// Names and arguments of every exchange and queue, derived from the settings. The
/// names a message is routed by are spelled once, here, and lent out: routing a job
/// formats nothing.
#[derive(Debug, Clone)]
pub struct Topology {
    prefix: String,
    pub(crate) retry_steps: Vec<Duration>,
    pub(crate) delivery_limit: u32,
    quorum_group: Option<u32>,
    pub(crate) delay: DelayLayout,
    max_delay: Duration,
    names: Names,
    /// The lanes, the default first (`<p>.send`).
    lanes: Vec<Lane>,
}

/// The names, spelled once from the prefix.
#[derive(Debug, Clone)]
struct Names {
    intake: String,
    delayed: String,
    work: String,
    send: String,
    retry: String,
    /// `<p>.retry.<n>`, one per backoff step.
    retry_queues: Vec<String>,
    dead_exchange: String,
    dead_queue: String,
    /// `<p>.events`: the delivery events (issue 30).
    events: String,
    /// Ladder mode: the top level's exchange, where the relay enters the cascade.
    ladder_entry: Option<String>,
}

impl Names {
    fn new(prefix: &str, retry_steps: usize, delay: DelayLayout) -> Self {
        Self {
            intake: format!("{prefix}.intake"),
            delayed: format!("{prefix}.delayed"),
            work: format!("{prefix}.work"),
            send: format!("{prefix}.send"),
            retry: format!("{prefix}.retry"),
            retry_queues: (0..retry_steps)
                .map(|n| format!("{prefix}.retry.{n}"))
                .collect(),
            dead_exchange: format!("{prefix}.dlx"),
            dead_queue: format!("{prefix}.dead"),
            events: format!("{prefix}.events"),
            ladder_entry: match delay {
                DelayLayout::Ladder(ladder) => Some(delay_level(prefix, ladder.levels() - 1)),
                DelayLayout::Plugin => None,
            },
        }
    }
}

/// Ladder level `k`'s name under `prefix`.
fn delay_level(prefix: &str, k: u32) -> String {
    format!("{prefix}.delay.{k}")
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
            lanes: lanes::lanes(
                settings,
                &format!("{}.send", settings.prefix),
                &format!("{}.intake", settings.prefix),
            ),
            names: Names::new(&settings.prefix, settings.retry_steps.len(), layout),
        }
    }

    /// The resolved delay layout.
    pub fn delay(&self) -> DelayLayout {
        self.delay
    }

    /// The resolved mode's name.
    pub(crate) fn mode_name(&self) -> &'static str {
        match self.delay {
            DelayLayout::Plugin => "plugin",
            DelayLayout::Ladder(_) => "ladder",
        }
    }

    /// The longest accepted `x-delay`.
    pub(crate) fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// Ladder mode: the queue the intake relay consumes.
    pub fn intake_queue(&self) -> &str {
        &self.names.intake
    }

    /// Ladder mode: level `k`'s exchange and queue (same name, different kinds).
    /// Spelled when asked: only declarations and tests ask.
    pub fn delay_level(&self, k: u32) -> String {
        delay_level(&self.prefix, k)
    }

    /// Ladder mode: where the relay enters the cascade (the top level's exchange).
    pub(crate) fn ladder_entry(&self) -> Option<&str> {
        self.names.ladder_entry.as_deref()
    }

    /// The producers' entry exchange.
    pub fn delayed_exchange(&self) -> &str {
        &self.names.delayed
    }

    /// Where due jobs and retries re-enter.
    pub fn work_exchange(&self) -> &str {
        &self.names.work
    }

    /// The queue the consumers compete on: the default lane's, where every
    /// internal hop routed `email` lands.
    pub fn send_queue(&self) -> &str {
        &self.names.send
    }

    /// The lanes, the default first; one unless `topology.lanes` names several.
    pub fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    /// Lane `id`.
    pub fn lane(&self, id: LaneId) -> &Lane {
        &self.lanes[id.0]
    }

    /// Lane `id` as the inbox records it (`postie_inbox.lane`): `None` for the default.
    pub(crate) fn lane_column(&self, id: LaneId) -> Option<&str> {
        (id.0 > 0).then(|| self.lanes[id.0].name.as_str())
    }

    /// The lane a job names: the default if it names none, or one not configured.
    pub(crate) fn lane_named(&self, name: Option<&str>) -> LaneId {
        name.and_then(|name| self.lanes.iter().position(|lane| lane.name == name))
            .map_or(LaneId(0), LaneId)
    }

    /// The exchange postie republishes retries through (so that it never needs
    /// the default exchange, and a least-privilege user suffices).
    pub fn retry_exchange(&self) -> &str {
        &self.names.retry
    }

    /// Retry queue for backoff step `n` (0-based, below the number of steps); also
    /// its routing key on [`Topology::retry_exchange`].
    pub fn retry_queue(&self, n: usize) -> &str {
        &self.names.retry_queues[n]
    }

    /// The dead-letter exchange.
    pub fn dead_exchange(&self) -> &str {
        &self.names.dead_exchange
    }

    /// The dead-letter queue operators replay from.
    pub fn dead_queue(&self) -> &str {
        &self.names.dead_queue
    }

    /// The topic exchange of delivery events (`email.<outcome>.<type>`): postie
    /// declares it and publishes to it; consumers bind their own queues.
    pub fn events_exchange(&self) -> &str {
        &self.names.events
    }

    /// The backoff steps.
    pub fn retry_steps(&self) -> &[Duration] {
        &self.retry_steps
    }

    /// Every queue, for status and clean-up.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.send_queue().to_owned(), self.dead_queue().to_owned()];
        queues.extend(self.lanes[1..].iter().map(|lane| lane.queue.clone()));
        queues.extend(self.names.retry_queues.iter().cloned());
        if let DelayLayout::Ladder(_) = self.delay {
            queues.push(self.intake_queue().to_owned());
            queues.extend(self.lanes[1..].iter().map(|lane| lane.intake.clone()));
            queues.extend(self.ladder_queues());
        }
        queues
    }

    /// Ladder mode: every level's queue, shortest first (empty in plugin mode).
    pub fn ladder_queues(&self) -> Vec<String> {
        match self.delay {
            DelayLayout::Ladder(ladder) => {
                (0..ladder.levels()).map(|k| self.delay_level(k)).collect()
            }
            DelayLayout::Plugin => Vec::new(),
        }
    }

    /// Every exchange, for clean-up.
    pub fn exchanges(&self) -> Vec<String> {
        let mut exchanges: Vec<String> = [
            self.delayed_exchange(),
            self.work_exchange(),
            self.retry_exchange(),
            self.dead_exchange(),
            self.events_exchange(),
        ]
        .map(str::to_owned)
        .into();
        // Each ladder level's exchange has its queue's name.
        exchanges.extend(self.ladder_queues());
        exchanges
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

    /// Arguments shared by every queue that carries jobs: replicated quorum queues
    /// (whose dead-letter hops are at-least-once, which needs `reject-publish`
    /// overflow), on `topology.quorum_initial_group_size` nodes if set (the broker's
    /// default otherwise: every cluster node).
    pub(crate) fn quorum_args(&self) -> FieldTable {
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
}

/// `<p>.dead`'s delivery limit, `x-delivery-limit`: 2^31 − 1, the largest the
/// argument's signed 32-bit type holds, so that no number of looks at a dead letter
/// drops it. Not `-1`: RabbitMQ 4.x reads it as "no limit", but 3.10 takes it as 0
/// and drops a letter the first time a reader hands it back (measured on 3.10.8 and
/// 4.3.6; docs/brokers.md). 3.x has no default limit; 4.x's is 20.
pub const DEAD_DELIVERY_LIMIT: i32 = i32::MAX;

impl Topology {
    /// `<p>.dead`'s arguments: a quorum queue that dead-letters nowhere, with
    /// [`DEAD_DELIVERY_LIMIT`]. `legacy` gives those of a queue declared before
    /// postie set the limit (quorum only), which an existing broker may still have.
    pub(crate) fn dead_queue_args(&self, legacy: bool) -> FieldTable {
        let mut args = self.quorum_args();
        if !legacy {
            insert(
                &mut args,
                "x-delivery-limit",
                AMQPValue::LongInt(DEAD_DELIVERY_LIMIT),
            );
        }
        args
    }
}

/// Sets `key` in an AMQP argument table.
pub(crate) fn insert(args: &mut FieldTable, key: &str, value: AMQPValue) {
    args.insert(lapin::types::ShortString::from(key), value);
}

/// An AMQP long string.
pub(crate) fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(lapin::types::LongString::from(value))
}
