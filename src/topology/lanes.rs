//! Lanes: a send queue each, named from the prefix. The default lane keeps
//! `<p>.send` and the contract's routing key (`email`); another lane `<l>` is
//! `<p>.send.<l>`, bound to `<p>.work` with `email.<l>`. A producer may publish a
//! lane's jobs to `<p>.delayed` with `email.<l>` too: in ladder mode they reach the
//! lane's own intake queue (`<p>.intake.<l>`), in plugin mode its send queue, so a
//! newsletter of any size never queues ahead of a password reset at the relay
//! either. The body's `lane` decides the lane wherever a job is. What reaches `<p>.send`
//! from the ladder, the retry queues, the plugin or a DLQ replay (all routed `email`)
//! and belongs to another lane is moved there by the worker (`Outcome::Moved`).

use crate::config::{SendRate, TopologySettings};

/// A lane's place in [`Topology::lanes`](super::Topology::lanes): 0 is the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LaneId(pub usize);

/// One lane: its names and its share of the send rate.
#[derive(Debug, Clone)]
pub struct Lane {
    /// As configured (`topology.lanes`), or `topology.default_lane`.
    pub name: String,
    /// Its send queue.
    pub queue: String,
    /// Its routing key on `<p>.work`, and on `<p>.delayed` for a producer that
    /// publishes into the lane directly.
    pub routing_key: String,
    /// The default lane, when there are several: `email.<name>`, which reaches its
    /// queues too (a producer may name every lane the same way).
    pub alias_key: Option<String>,
    /// Ladder mode: the intake queue its routing key reaches on `<p>.delayed`
    /// (`<p>.intake.<l>`; the default lane's is `<p>.intake`), relayed by a loop of
    /// its own so that a bulk publish of any size never holds up another lane's jobs.
    pub intake: String,
    /// Its weight in the send rate.
    pub weight: u32,
    /// Its own fleet-wide cap, if any.
    pub rate_limit: Option<SendRate>,
    /// Each tenant's cap inside it, if any.
    pub tenant_rate_limit: Option<SendRate>,
}

impl Lane {
    /// The routing keys that reach its queues: its own, and its alias if any.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.routing_key.as_str()).chain(self.alias_key.as_deref())
    }
}

/// The lanes of `settings` under `send` (`<p>.send`) and `intake` (`<p>.intake`),
/// the default first.
pub(super) fn lanes(settings: &TopologySettings, send: &str, intake: &str) -> Vec<Lane> {
    let list = settings.lane_list();
    let several = list.len() > 1;
    list.into_iter()
        .enumerate()
        .map(|(i, (name, lane))| {
            let (queue, routing_key, intake) = match i {
                0 => (
                    send.to_owned(),
                    super::ROUTING_KEY.to_owned(),
                    intake.to_owned(),
                ),
                _ => (
                    format!("{send}.{name}"),
                    format!("{}.{name}", super::ROUTING_KEY),
                    format!("{intake}.{name}"),
                ),
            };
            Lane {
                alias_key: (i == 0 && several).then(|| format!("{}.{name}", super::ROUTING_KEY)),
                name,
                queue,
                routing_key,
                intake,
                weight: lane.weight,
                rate_limit: lane.rate_limit,
                tenant_rate_limit: lane.tenant_rate_limit,
            }
        })
        .collect()
}
