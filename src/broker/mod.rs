//! Everything RabbitMQ: connections and confirmed publishes, the topology's
//! declaration (its names and the ladder's arithmetic are `topology`'s), the
//! delay-mode probe, and coalesced acks. Nothing here knows what a job means;
//! [`crate::consume`] drives it.
//!
//! - `amqp.rs`: `connect`, the one way to connect; confirmed publishes.
//! - `declare.rs`: the topology's objects declared and deleted; `queue_depths`.
//! - `probe.rs`: `delay.mode = auto`. `acks.rs`: coalesced acks.
//! - `dead.rs`: `<p>.dead` against looks. `management.rs`: the management HTTP API.

pub mod acks;
pub mod amqp;
pub mod dead;
pub mod declare;
pub mod management;
pub mod probe;

pub use crate::topology::{ladder, DelayLayout, Ladder, Topology, ROUTING_KEY};
pub(crate) use acks::Acks;
pub use amqp::{
    confirm_channel, connect, copy_properties, job_properties, may_impersonate, publish_confirmed,
    queue_exists, queue_state, Connected, PublishError, QueueState,
};
pub use dead::{dead_limit, DeadLimit};
pub use declare::{queue_depths, QueueDepth, TopologyError};
pub use probe::{probe_mode, probe_plugin, resolve_mode, resolve_topology, Probed};
