//! The dispositions an [`Outcome`](super::Outcome) settles into: the republished
//! copy's target and headers, and the counting of the outcomes that need more than a
//! line.

use lapin::types::FieldTable;

use super::{DeadKind, Disposition, Target};
use crate::contract::readable;
use crate::headers::{self, HEADER_DUE_AT, HEADER_X_DELAY};
use crate::ops::metrics::{Metrics, Step, ThrottlePolicy};
use crate::topology::{LaneId, Topology, ROUTING_KEY};
use crate::work::now_ms;

/// [`super::Outcome::Sent`]: counted, with its lateness and any takeover.
pub(super) fn sent(metrics: &Metrics, takeover: bool, lateness_ms: i64) -> Disposition {
    tracing::info!(takeover, lateness_ms, "sent");
    metrics.emails_sent.inc();
    if takeover {
        metrics.takeovers.inc();
    }
    metrics
        .lateness_seconds
        .observe(lateness_ms as f64 / 1000.0);
    Disposition::Ack
}

/// [`super::Outcome::Throttled`]: dropped (acked), or back to wait until `until_ms`.
pub(super) fn throttled(
    metrics: &Metrics,
    topology: &Topology,
    original: Option<&FieldTable>,
    until_ms: Option<i64>,
) -> Disposition {
    tracing::info!(?until_ms, "throttled");
    let Some(until) = until_ms else {
        metrics.throttled.inc(ThrottlePolicy::Drop);
        return Disposition::Ack;
    };
    metrics.throttled.inc(ThrottlePolicy::Defer);
    let left = (until - now_ms()).max(0);
    Disposition::Republish(wait_until(topology, original, until, left))
}

/// [`super::Outcome::Moved`]: counted, and to its lane's queue, untouched.
pub(super) fn moved(
    metrics: &Metrics,
    topology: &Topology,
    original: Option<&FieldTable>,
    lane: LaneId,
) -> Disposition {
    tracing::debug!(lane = %topology.lane(lane).name, "moved to its lane");
    metrics.lane_moves.inc();
    Disposition::Republish(Target {
        exchange: topology.work_exchange().to_owned(),
        routing_key: topology.lane(lane).routing_key.clone(),
        headers: headers::without(original, &[]),
    })
}

/// [`super::Outcome::TenantDeferred`]: counted, and back through the lane's intake
/// to wait for its tenant's slot, stamped with it.
pub(super) fn tenant_deferred(
    metrics: &Metrics,
    topology: &Topology,
    original: Option<&FieldTable>,
    lane: LaneId,
    slot_ms: i64,
) -> Disposition {
    let left = (slot_ms - now_ms()).max(0);
    tracing::debug!(
        wait_ms = left,
        "over its tenant's cap; deferred to its slot"
    );
    metrics.tenant_deferred.inc();
    let mut target = wait_until(topology, original, slot_ms, left);
    headers::set_int(&mut target.headers, headers::HEADER_TENANT_SLOT, slot_ms);
    target.routing_key = topology.lane(lane).routing_key.clone();
    Disposition::Republish(target)
}

/// Back through the contract exchange, stamped with its due time: the relay (ladder)
/// reads the due time; the plugin reads `x-delay`, set to what is left.
pub(super) fn wait_until(
    topology: &Topology,
    original: Option<&FieldTable>,
    due_ms: i64,
    left_ms: i64,
) -> Target {
    let mut headers = headers::without(original, &[]);
    headers::set_int(&mut headers, HEADER_DUE_AT, due_ms);
    headers::set_int(&mut headers, HEADER_X_DELAY, left_ms);
    Target {
        exchange: topology.delayed_exchange().to_owned(),
        routing_key: ROUTING_KEY.to_string(),
        headers,
    }
}

/// To retry queue `step`.
pub(super) fn retry(topology: &Topology, step: usize, headers: FieldTable) -> Target {
    Target {
        exchange: topology.retry_exchange().to_owned(),
        routing_key: topology.retry_queue(step).to_owned(),
        headers,
    }
}

/// The original headers with the attempt count and the last error.
pub(super) fn retry_headers(
    original: Option<&FieldTable>,
    attempt: u32,
    error: &str,
    provider: Option<&str>,
) -> FieldTable {
    let mut headers = headers::without(original, &[]);
    headers::set_int(&mut headers, headers::HEADER_ATTEMPT, i64::from(attempt));
    headers::set_text(&mut headers, headers::HEADER_LAST_ERROR, error);
    if let Some(provider) = provider {
        headers::set_text(&mut headers, headers::HEADER_PROVIDER, provider);
    }
    headers
}

/// A dead letter: the original headers, the reason, and no retry counter (so that a
/// replay starts a fresh cycle).
pub(crate) fn dead_letter(
    topology: &Topology,
    original: Option<&FieldTable>,
    kind: DeadKind,
    reason: &str,
    attempts: u32,
) -> Target {
    let mut headers = headers::without(original, &[headers::HEADER_ATTEMPT]);
    headers::set_text(
        &mut headers,
        headers::HEADER_DEAD_REASON,
        &readable(reason, 1_000),
    );
    headers::set_text(&mut headers, headers::HEADER_DEAD_KIND, kind.as_str());
    headers::set_text(
        &mut headers,
        headers::HEADER_DEAD_AT,
        &chrono::Utc::now().to_rfc3339(),
    );
    headers::set_int(
        &mut headers,
        headers::HEADER_DEAD_ATTEMPTS,
        i64::from(attempts),
    );
    Target {
        exchange: topology.dead_exchange().to_owned(),
        routing_key: ROUTING_KEY.to_string(),
        headers,
    }
}

/// [`super::Outcome::Retry`]: counted, to retry queue `step` with the attempt count,
/// the error and the pinned provider (if any).
pub(super) fn retry_later(
    metrics: &Metrics,
    topology: &Topology,
    original: Option<&FieldTable>,
    (step, attempt): (usize, u32),
    error: &str,
    provider: &Option<String>,
) -> Disposition {
    let error = readable(error, 1_000);
    tracing::warn!(step, attempt, error = %error, "transient failure; will retry");
    metrics.retries.inc(Step(step as u32));
    let headers = retry_headers(original, attempt, &error, provider.as_deref());
    Disposition::Republish(retry(topology, step, headers))
}

/// An outcome that is only counted, logged and acked.
pub(super) fn acked(
    counter: &prometheus_client::metrics::counter::Counter,
    what: &'static str,
) -> Disposition {
    tracing::info!("{what}");
    counter.inc();
    Disposition::Ack
}
