//! The sections of [`Settings`](super::Settings), each with its defaults and the
//! meaning of every field. Unknown fields are refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::de::{duration, durations, optional_duration};

/// How delays are honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DelayMode {
    /// Probe the broker at start-up: the exchange already there decides; on a fresh
    /// broker, `plugin` if the plugin is enabled, else `ladder`.
    Auto,
    /// `x-delayed-message` exchange (rabbitmq_delayed_message_exchange).
    Plugin,
    /// Plugin-free: intake relay and TTL-queue cascade.
    Ladder,
}

impl DelayMode {
    /// The name used in config and logs.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Plugin => "plugin",
            Self::Ladder => "ladder",
        }
    }
}

/// RabbitMQ connection and consumer settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSettings {
    /// `amqp://user:pass@host:port/vhost` or `amqps://…`.
    pub url: SecretString,
    /// Unacked deliveries the broker may push to one instance.
    pub prefetch: u16,
    /// How long a connection attempt may take.
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
    /// RabbitMQ's management HTTP API, `https://user:pass@host:15671` (optional;
    /// `http://` only to this machine, see `management_allow_http`). Only `postie
    /// status` uses it: how many messages the delayed-message plugin still holds for a
    /// drained prefix (`topology.drain_prefixes`), and which policy gives `<p>.dead`
    /// its delivery limit.
    pub management_url: Option<SecretString>,
    /// Allow `management_url` to be `http://` to a host other than this machine (its
    /// password then crosses the network in clear). Off: such a URL stops start-up.
    pub management_allow_http: bool,
}

impl Default for AmqpSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("amqp://guest:guest@127.0.0.1:5672/%2f"),
            prefetch: 128,
            connect_timeout: Duration::from_secs(10),
            management_url: None,
            management_allow_http: false,
        }
    }
}

/// PostgreSQL settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// `postgres://user:pass@host:port/db` (key=value strings work too).
    pub url: SecretString,
    /// Connections in the pool. Every instance opens its own: PostgreSQL spends more
    /// per statement the more backends run at once, so keep the fleet's total near
    /// a few per database core (README, "Scaling").
    pub pool_size: usize,
    /// Apply the migrations in `sql/` at start-up.
    pub migrate_on_start: bool,
    /// How long to wait for a pooled connection or a new one.
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
    /// How long a worker waits for one statement's answer (a claim, a completion, a
    /// renewal) before it counts the database as not answering: readiness false,
    /// consumption paused, the statement tried again (README, "Operations").
    #[serde(deserialize_with = "duration")]
    pub statement_timeout: Duration,
    /// Accept an unencrypted connection to a host that is not this machine (`sslmode`
    /// absent, `disable` or `prefer`). Off: postie refuses to start instead.
    pub allow_plaintext: bool,
    /// PEM file of CA certificates to trust for the server's certificate, on top of the
    /// system's roots (`sslmode=verify-ca` trusts these alone).
    pub ca_file: Option<PathBuf>,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("postgres://postgres@127.0.0.1:5432/postgres"),
            pool_size: 8,
            migrate_on_start: true,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            allow_plaintext: false,
            ca_file: None,
        }
    }
}

impl DatabaseSettings {
    /// `ca_file`, unless unset or empty.
    pub(crate) fn ca_file(&self) -> Option<&Path> {
        self.ca_file
            .as_deref()
            .filter(|path| !path.as_os_str().is_empty())
    }
}

/// Settings of the SMTP relay alone. What every transport shares (its URL, the pool,
/// the timeout, the breaker, the rate, `From` and the Message-ID) is under
/// [`TransportSettings`](super::TransportSettings) (`transport.*`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SmtpSettings {
    /// A 421/451/454 reply whose text contains one of these (case-insensitive) is a
    /// throttle: the job keeps its attempt count and the instance slows down.
    pub throttle_patterns: Vec<String>,
    /// Send an email for one recipient with `BDAT` (RFC 3030) to a relay that
    /// advertises CHUNKING and PIPELINING: the envelope and the body in one write, one
    /// round trip an email. Off, every email goes after `DATA` (the body only once the
    /// envelope is answered, so a claim lost meanwhile still stops it).
    pub chunking: bool,
}

impl Default for SmtpSettings {
    fn default() -> Self {
        Self {
            throttle_patterns: ["throttl", "rate", "too many", "try again later"]
                .map(String::from)
                .to_vec(),
            chunking: true,
        }
    }
}

/// Names and arguments of the broker objects.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopologySettings {
    /// Prefix of every exchange and queue name (`postie` → `postie.send`, …).
    pub prefix: String,
    /// Backoff steps: retry queue `n` holds a failed job for `retry_steps[n]`.
    /// A job gets `retry_steps.len() + 1` attempts before it is dead-lettered.
    #[serde(deserialize_with = "durations")]
    pub retry_steps: Vec<Duration>,
    /// Broker-side safety net: deliveries of one message before the broker itself
    /// dead-letters it (counts redeliveries after crashes and connection losses).
    pub delivery_limit: u32,
    /// Replicas of each quorum queue at declaration (`x-quorum-initial-group-size`);
    /// unset: one per cluster node. Fixed once a queue exists.
    pub quorum_initial_group_size: Option<u32>,
    /// Earlier prefixes whose `<old>.send` this instance also consumes until it is gone
    /// (docs/brokers.md, "Leaving the plugin"), under this prefix's topology: retries
    /// and dead letters go to the new queues. `postie status` shows what they hold.
    pub drain_prefixes: Vec<String>,
    /// Lanes (docs/lanes.md): each its own queues (`<p>.send.<lane>`; the default
    /// keeps `<p>.send`) and its weighted share of the send rate. None: one lane.
    pub lanes: std::collections::BTreeMap<String, super::LaneSettings>,
    /// The lane of a job that names none, or one not in `lanes`.
    pub default_lane: String,
}

impl Default for TopologySettings {
    fn default() -> Self {
        Self {
            prefix: "postie".into(),
            retry_steps: [5, 30, 120, 600, 3600]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
            delivery_limit: 50,
            quorum_initial_group_size: None,
            drain_prefixes: Vec::new(),
            lanes: Default::default(),
            default_lane: "default".into(),
        }
    }
}

/// The consumer and the unit of work.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Deliveries processed at the same time by one instance.
    pub concurrency: usize,
    /// Threads of the instance's async runtime (unset: one per core). Several
    /// instances on one small host may each take fewer (README, "Scaling").
    pub threads: Option<usize>,
    /// How long a claim is exclusive. Another instance takes a job over only after
    /// the lease has expired, so it must be well above `transport.timeout`.
    #[serde(deserialize_with = "duration")]
    pub lease: Duration,
    /// Largest accepted message body, in bytes. A larger one is dead-lettered by its
    /// length, before any parse (on the relay too).
    pub max_body_bytes: usize,
    /// The bytes of message bodies one instance may hold: each lane's prefetch
    /// (`amqp.prefetch`, `delay.relay_prefetch`) is cut so that its deliveries, each
    /// counted at `max_body_bytes`, fit. Must hold at least `concurrency` (plus
    /// `delay.relay_concurrency` unless delays are in plugin mode) such bodies.
    pub inflight_bytes: u64,
    /// Name of this instance in the inbox `owner` column (default: host-pid-random).
    pub instance_id: Option<String>,
    /// Largest wait between tries while a dependency is down.
    #[serde(deserialize_with = "duration")]
    pub outage_backoff_max: Duration,
    /// On SIGTERM: how long in-flight deliveries get to finish before they are
    /// handed back to the broker unacked.
    #[serde(deserialize_with = "duration")]
    pub drain_timeout: Duration,
    /// Producer isolation: `off` (the default), or `user_id` to keep every job's and
    /// cancel request's key in the key space of the AMQP `user_id` property, which
    /// RabbitMQ checks against the publishing connection's user (README,
    /// "Producer isolation").
    pub key_namespace: KeyNamespace,
    /// Keep `postie-*` headers that carry no seal of this fleet (README, "Headers a
    /// producer may set"). Only for the upgrade from a postie that did not seal them,
    /// while copies it published are still in the retry and delay queues; off, a
    /// producer's `postie-*` header (but `postie-published-at`) is dropped at intake.
    pub trust_unsealed_headers: bool,
}

/// Whose key space a job's key lives in (`worker.key_namespace`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyNamespace {
    /// One key space shared by every producer: keys are used as published.
    #[default]
    Off,
    /// One key space per RabbitMQ user: the key `K` published with `user_id` `U` is
    /// `U:K` (`%` and `:` in `U` percent-encoded). A message without `user_id` is
    /// dead-lettered. postie's own RabbitMQ user needs the `impersonator` tag, since
    /// it re-publishes jobs (ladder, retries, replays) with their `user_id`.
    UserId,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            concurrency: 64,
            threads: None,
            lease: Duration::from_secs(60),
            max_body_bytes: 512 * 1024,
            inflight_bytes: 128 * 1024 * 1024,
            instance_id: None,
            outage_backoff_max: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            key_namespace: KeyNamespace::Off,
            trust_unsealed_headers: false,
        }
    }
}

/// Delays: plugin or ladder mode.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DelaySettings {
    /// `auto`, `plugin` or `ladder` (see README, "Delays").
    pub mode: DelayMode,
    /// Ladder mode: the unit of the TTL cascade. Smaller means more levels; the
    /// worker waits out the last sub-unit rest, so this is not the lateness.
    #[serde(deserialize_with = "duration")]
    pub resolution: Duration,
    /// Ladder mode: the longest accepted `x-delay`; longer jobs are dead-lettered.
    /// (Plugin mode: the plugin's 2^32-1 ms.)
    #[serde(deserialize_with = "duration")]
    pub max: Duration,
    /// Ladder mode: intake deliveries relayed at once per instance.
    pub relay_concurrency: u16,
    /// Ladder mode: intake deliveries one instance holds unacked (at least
    /// `relay_concurrency`). The relay takes them earliest due first, so in a burst the
    /// jobs due soon are relayed first; each waiting one costs its body's memory.
    /// Unset: what the byte budget (`worker.inflight_bytes`) leaves after the send
    /// loops, at most 10,000: 128 with the defaults
    /// ([`Settings::relay_prefetch`](super::Settings::relay_prefetch)). A value set is
    /// cut to what the budget leaves too.
    pub relay_prefetch: Option<u16>,
    /// Ladder mode: record each scheduled job in the inbox, for `postie pending`
    /// and the pending gauge (one upsert per job).
    pub track_pending: bool,
    /// Ladder mode, with `track_pending`: keep each scheduled job's body in the inbox
    /// until it is finished, and let the maintenance instance re-publish a job that is
    /// overdue by more than `reconcile_grace` and that the broker lost: no worker holds
    /// it and it cannot be waiting in `<p>.send` (see README, "Delays").
    pub reconcile: bool,
    /// How overdue a scheduled job must be before the reconciler re-publishes it (if
    /// the broker lost it); a pass runs every half grace. At least 1 s.
    #[serde(deserialize_with = "duration")]
    pub reconcile_grace: Duration,
}

impl Default for DelaySettings {
    fn default() -> Self {
        Self {
            mode: DelayMode::Auto,
            resolution: Duration::from_millis(100),
            max: Duration::from_secs(366 * 86_400),
            relay_concurrency: 64,
            relay_prefetch: None,
            track_pending: true,
            reconcile: true,
            reconcile_grace: Duration::from_secs(10),
        }
    }
}

/// Retention of finished inbox rows, enforced by the singleton maintenance task.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InboxSettings {
    /// Finished rows (`sent`, `dead`, `cancelled`, `throttled`) untouched for this
    /// long are deleted: a key is sent at most once within this window. In-flight rows
    /// (`scheduled`, `sending`, `retrying`) are never deleted.
    #[serde(deserialize_with = "duration")]
    pub retention: Duration,
    /// Tombstones (cancels of keys never seen as jobs); unset = `retention`.
    #[serde(deserialize_with = "optional_duration")]
    pub tombstone_retention: Option<Duration>,
    /// How often the maintenance instance prunes.
    #[serde(deserialize_with = "duration")]
    pub prune_interval: Duration,
    /// Rows deleted per statement (each its own short transaction).
    pub prune_batch: u32,
}

impl Default for InboxSettings {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(30 * 86_400),
            tombstone_retention: None,
            prune_interval: Duration::from_secs(60),
            prune_batch: 5_000,
        }
    }
}

impl InboxSettings {
    /// `tombstone_retention`, defaulting to `retention`.
    pub(crate) fn tombstone_retention(&self) -> Duration {
        self.tombstone_retention.unwrap_or(self.retention)
    }
}
