//! Everything RabbitMQ: connections and confirmed publishes, the topology's
//! declaration (its names and the ladder's arithmetic are `topology`'s), the
//! delay-mode probe, and coalesced acks. Nothing here knows what a job means;
//! [`crate::consume`] drives it.
//!
//! - `amqp.rs`: `connect`, the one way to connect; confirmed publishes.
//! - `declare.rs`: the topology's objects declared and deleted; `queue_depths`.
//! - `probe.rs`: `delay.mode = auto`. `acks.rs`: coalesced acks.
//! - `dead.rs`: `<p>.dead` against looks. `management.rs`: the management HTTP API.

pub(crate) mod acks;
pub(crate) mod amqp;
pub(crate) mod dead;
pub(crate) mod declare;
pub(crate) mod management;
pub(crate) mod probe;

pub use crate::topology::{DelayLayout, Ladder, Topology, ROUTING_KEY};
pub(crate) use acks::Acks;
pub use amqp::{confirm_channel, connect, job_properties, publish_confirmed, PublishError};
pub(crate) use amqp::{copy_properties, may_impersonate, queue_exists, queue_state, Connected};
pub(crate) use dead::{dead_limit, DeadLimit};
pub(crate) use declare::{queue_depths, QueueDepth};
pub(crate) use probe::resolve_topology;
pub use probe::{probe_plugin, resolve_mode};
