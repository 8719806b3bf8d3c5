//! The limits a job waits for before its claim, besides a connection slot: its
//! lane's own cap and its lane's share among the lanes (`work::lanes`), then its
//! route's send rate (`work::limiter`).
//!
//! Here: the routes' limiters; the lanes' caps; a job's tenant turn (its tenant's slot
//! under the lane's tenant cap; over it, `Outcome::TenantDeferred` to the slot); and
//! its lane turn (its cap, then its `FairShare` passage, held until its send-rate
//! turn and slot).

use lapin::types::FieldTable;

use super::{Admitted, Stop, Worker};
use crate::headers::{header_int, HEADER_TENANT_SLOT};
use crate::topology::LaneId;
use crate::work::context::Context;
use crate::work::lanes::Passage;
use crate::work::limiter::{Limiter, Turn};
use crate::work::Outcome;

/// How far ahead of now a tenant's slot may be and its job still go at once (its
/// burst).
const TENANT_BURST_MS: i64 = 1_000;

/// The tenant of a job that names none.
const DEFAULT_TENANT: &str = "default";

/// A limiter per route of the mailer, in its order: each route's fleet row.
pub(super) fn route_limiters(cx: &Context) -> std::sync::Arc<[Limiter]> {
    let routes = cx.mailer.routes().all();
    let prefix = &cx.settings.topology.prefix;
    routes
        .iter()
        .enumerate()
        .map(|(i, route)| {
            // One route keeps the fleet row it always had (the prefix).
            let name = match routes.len() {
                1 => prefix.clone(),
                _ => format!("{prefix}/{}", route.name),
            };
            Limiter::new(
                route.rate_limit,
                route.rate_burst,
                cx.inbox.clone(),
                &name,
                cx.metrics().clone(),
                i == 0,
            )
        })
        .collect()
}

/// Each lane's own cap (`topology.lanes.<l>.rate_limit`), in lane order: a fleet row
/// of its own (`<prefix>/lane/<l>`).
pub(super) fn lane_caps(cx: &Context) -> std::sync::Arc<[Option<Limiter>]> {
    let prefix = &cx.settings.topology.prefix;
    (cx.topology.lanes().iter())
        .map(|lane| {
            lane.rate_limit.map(|rate| {
                let name = format!("{prefix}/lane/{}", lane.name);
                let metrics = cx.metrics().clone();
                Limiter::new(Some(rate), None, cx.inbox.clone(), &name, metrics, false)
            })
        })
        .collect()
}

impl Worker {
    /// Under its lane's tenant cap, the job takes its tenant's next slot; a slot
    /// further ahead than the burst defers the job to it (`Outcome::TenantDeferred`),
    /// holding nothing. A job already given a slot (its header) goes on.
    pub(super) async fn tenant_turn(
        &self,
        admitted: &Admitted,
        headers: Option<&FieldTable>,
    ) -> Result<Option<Outcome>, Stop> {
        let lane = self.cx.topology.lane(admitted.lane);
        let Some(rate) = lane.tenant_rate_limit else {
            return Ok(None);
        };
        if header_int(headers, HEADER_TENANT_SLOT).is_some() {
            return Ok(None);
        }
        let tenant = admitted.job.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        let interval_ms = 1_000.0 / rate.per_second();
        let key = admitted.job.key.as_str();
        let slot = self
            .db("tenant slot", || {
                let tenant = (lane.name.as_str(), tenant);
                (self.cx.inbox).tenant_slot(tenant, key, interval_ms, TENANT_BURST_MS)
            })
            .await?;
        let Some(slot) = slot else {
            return Ok(None);
        };
        Ok(Some(Outcome::TenantDeferred {
            key: admitted.job.key.clone(),
            lane: admitted.lane,
            slot_ms: slot,
        }))
    }

    /// `lane`'s cap (a fleet token of its own, kept until the attempt ends), then its
    /// passage among the lanes (kept until the job has its send-rate turn and slot).
    pub(super) async fn lane_turn(
        &self,
        lane: LaneId,
    ) -> Result<(Option<Turn>, Option<Passage>), Stop> {
        let cap = match &self.lane_caps[lane.0] {
            Some(cap) => tokio::select! {
                _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                turn = self.db("lane rate limit", || cap.fleet_token()) => Some(turn?),
            },
            None => None,
        };
        let passage = match &self.share {
            Some(share) => tokio::select! {
                _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                passage = share.enter(lane) => Some(passage),
            },
            None => None,
        };
        Ok((cap, passage))
    }
}
