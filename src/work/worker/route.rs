//! Which route a turn sends through: the job's pin (a route a send of it may already
//! have reached), else the first route whose breaker is closed.

use std::time::Duration;

use super::{Admitted, Stop, Worker};
use crate::mail::RouteId;

/// The route a job must stay on because a send through it may have been accepted
/// (`mail::route`): from the delivery's `postie-provider` header, or set by a send
/// of this delivery that ended uncertain. Never unset.
#[derive(Default)]
pub(super) struct Pin(std::sync::atomic::AtomicUsize);

impl Pin {
    const NONE: usize = usize::MAX;

    pub(super) fn new(route: Option<RouteId>) -> Self {
        Self(std::sync::atomic::AtomicUsize::new(
            route.map_or(Self::NONE, |r| r.0),
        ))
    }

    pub(super) fn get(&self) -> Option<RouteId> {
        match self.0.load(std::sync::atomic::Ordering::Relaxed) {
            Self::NONE => None,
            route => Some(RouteId(route)),
        }
    }

    pub(super) fn set(&self, route: RouteId) {
        self.0.store(route.0, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Worker {
    /// The route this turn sends through: the job's pinned route (waiting, holding
    /// nothing, while its breaker is open), else the first whose breaker is closed
    /// (waiting, while every one is open, for the transport circuit to close).
    pub(super) async fn route(&self, admitted: &Admitted) -> Result<RouteId, Stop> {
        let routes = self.cx.mailer.routes();
        let Some(pinned) = admitted.pin.get() else {
            while !routes.any_up() {
                tokio::select! {
                    _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                    _ = async {
                        self.cx.health.wait_dependencies_up().await;
                        // The circuit is marked open just after the last breaker
                        // opens: a moment for it, rather than a busy loop.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    } => {}
                }
            }
            return Ok(routes.choose());
        };
        let route = routes.get(pinned);
        if !route.is_up() {
            tracing::info!(key = %admitted.job.key, provider = %route.name, "waiting for the provider this job may already have reached");
            tokio::select! {
                _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                _ = route.wait_up() => {}
            }
        }
        Ok(pinned)
    }
}
