//! Everything RabbitMQ: connections and confirmed publishes, the topology (names,
//! declaration, the delay-mode probe), ladder mode's TTL cascade, and coalesced acks.
//! Nothing here knows what a job means; [`crate::consume`] drives it.

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
