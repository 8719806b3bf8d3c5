//! What became of one delivery ([`Outcome`]) and what the consume loop does about it
//! ([`Disposition`]). Each outcome's log line, counter and disposition are written
//! together, in one arm of [`Outcome::settle`]: adding an outcome is one arm.

use lapin::types::FieldTable;

use crate::broker::{Topology, ROUTING_KEY};
use crate::contract::{readable, IdempotencyKey};
use crate::headers::{self, HEADER_DUE_AT, HEADER_X_DELAY};
use crate::inbox::Cancelled;
use crate::ops::metrics::{DeadReason, Metrics, PolicyLabel, StepLabel};

use super::now_ms;

/// Why a job is dead-lettered, as a stable label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadKind {
    /// The message can never become an email.
    Invalid,
    /// The SMTP server refused it for good (5xx).
    Permanent,
    /// Transient failures used up every retry step.
    Exhausted,
}

impl DeadKind {
    /// The label used in headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Permanent => "permanent",
            Self::Exhausted => "retries_exhausted",
        }
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Sent and recorded. `takeover` means an expired claim was taken over first, so
    /// the previous owner may have sent it too (the known duplicate window).
    Sent {
        /// The job's key.
        key: IdempotencyKey,
        /// An expired lease was taken over.
        takeover: bool,
        /// Sent minus due, in ms (negative never happens by construction).
        lateness_ms: i64,
    },
    /// Arrived well before its due time (clock skew, or moved in by hand): goes back
    /// to the delayed exchange, stamped with its due time.
    Early {
        /// The job's key.
        key: IdempotencyKey,
        /// Due time, Unix ms.
        due_ms: i64,
        /// How far off, in ms.
        early_ms: i64,
    },
    /// Sent, but meanwhile another instance took the key over (fence moved).
    SentFenceLost {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// Already sent: acked without sending.
    Duplicate {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A cancel covers this job's revision: acked without sending.
    Cancelled {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A newer revision of the key exists: acked without sending.
    Stale {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A cancel request was recorded.
    CancelRequest {
        /// The key cancelled.
        key: IdempotencyKey,
        /// What the inbox said.
        cancelled: Cancelled,
    },
    /// Over its type's throttle: dropped (`until_ms` None) or deferred until then.
    Throttled {
        /// The job's key.
        key: IdempotencyKey,
        /// Deferred until (Unix ms), or None when dropped.
        until_ms: Option<i64>,
    },
    /// Another instance holds a live claim: park the job in retry queue `step`,
    /// which is at least the remaining lease away, without counting an attempt.
    Deferred {
        /// The job's key.
        key: IdempotencyKey,
        /// Retry queue index.
        step: usize,
    },
    /// A transient failure: retry queue `step`, with `attempt` failures so far.
    Retry {
        /// The job's key.
        key: IdempotencyKey,
        /// Retry queue index.
        step: usize,
        /// Failed attempts in this cycle, this one included.
        attempt: u32,
        /// What went wrong.
        error: String,
    },
    /// To the dead-letter queue with a reason a person can read.
    DeadLetter {
        /// The job's key, when the message had one.
        key: Option<IdempotencyKey>,
        /// The reason class.
        kind: DeadKind,
        /// The reason.
        reason: String,
        /// Failed attempts in this cycle.
        attempts: u32,
    },
}

impl Outcome {
    /// A short label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Sent { .. } => "sent",
            Self::Early { .. } => "early",
            Self::SentFenceLost { .. } => "sent_fence_lost",
            Self::Duplicate { .. } => "duplicate",
            Self::Cancelled { .. } => "cancelled",
            Self::Stale { .. } => "stale",
            Self::CancelRequest { .. } => "cancel_request",
            Self::Throttled { .. } => "throttled",
            Self::Deferred { .. } => "deferred",
            Self::Retry { .. } => "retry",
            Self::DeadLetter { .. } => "dead_letter",
        }
    }
}

/// Where a copy of the delivery goes before the ack.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The copy's headers.
    pub headers: FieldTable,
}

/// What the consume loop does with a delivery. Only [`Disposition::Ack`] and the
/// publish-then-ack dispositions end it; I5 (no ack before the outcome is durable)
/// holds because an outcome is only named once it is committed to the inbox, and a
/// copy is acked only once the broker confirms it.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// The outcome is durable in the inbox (or needs no record): ack.
    Ack,
    /// Publish a copy to the target (confirmed), then ack.
    Republish(Target),
    /// Publish a copy to the dead-letter exchange with the reason (confirmed), then ack.
    DeadLetter(Target),
    /// No outcome yet (stopping, or the dependency it waited for is gone): no ack, the
    /// broker hands the delivery out again.
    LeaveUnacked,
}

impl Outcome {
    /// Logs the outcome (into the current delivery span too), counts it, and names
    /// what becomes of the delivery, given the delivery's own headers.
    pub fn settle(
        &self,
        metrics: &Metrics,
        topology: &Topology,
        original: Option<&FieldTable>,
    ) -> Disposition {
        let span = tracing::Span::current();
        if let Some(key) = self.key() {
            span.record("key", key.as_str());
        }
        span.record("outcome", self.label());
        match self {
            Self::Sent {
                takeover,
                lateness_ms,
                ..
            } => {
                tracing::info!(takeover, lateness_ms, "sent");
                metrics.emails_sent.inc();
                if *takeover {
                    metrics.takeovers.inc();
                }
                metrics
                    .lateness_seconds
                    .observe(*lateness_ms as f64 / 1000.0);
                Disposition::Ack
            }
            Self::SentFenceLost { .. } => {
                tracing::warn!(
                    "sent, but another instance had taken the key over: possible duplicate"
                );
                metrics.emails_sent.inc();
                Disposition::Ack
            }
            Self::Duplicate { .. } => {
                tracing::info!("already sent; duplicate suppressed");
                metrics.duplicates_suppressed.inc();
                Disposition::Ack
            }
            Self::Cancelled { .. } => {
                tracing::info!("cancelled; not sent");
                metrics.cancelled.inc();
                Disposition::Ack
            }
            Self::Stale { .. } => {
                tracing::info!("a newer revision exists; skipped");
                metrics.stale.inc();
                Disposition::Ack
            }
            Self::CancelRequest { cancelled, .. } => {
                tracing::info!(prior_status = %cancelled.prior_status, covers = cancelled.covers, "cancel recorded");
                Disposition::Ack
            }
            Self::Throttled { until_ms, .. } => {
                tracing::info!(?until_ms, "throttled");
                let policy = if until_ms.is_some() { "defer" } else { "drop" };
                metrics
                    .throttled
                    .get_or_create(&PolicyLabel {
                        policy: policy.into(),
                    })
                    .inc();
                match until_ms {
                    None => Disposition::Ack,
                    Some(until) => {
                        let mut headers = headers::without(original, &[]);
                        headers::set_int(&mut headers, HEADER_DUE_AT, *until);
                        headers::set_int(&mut headers, HEADER_X_DELAY, (*until - now_ms()).max(0));
                        Disposition::Republish(delayed(topology, headers))
                    }
                }
            }
            Self::Deferred { step, .. } => {
                tracing::info!(step, "claimed elsewhere; parked until the lease ends");
                metrics.deferred.inc();
                Disposition::Republish(Target {
                    exchange: topology.retry_exchange().to_owned(),
                    routing_key: topology.retry_queue(*step).to_owned(),
                    headers: headers::without(original, &[]),
                })
            }
            Self::Early {
                due_ms, early_ms, ..
            } => {
                tracing::warn!(early_ms, "arrived before its due time; sent back to wait");
                metrics.deferred.inc();
                // Back through the delayed exchange: the relay (ladder) reads the due
                // time; the plugin reads x-delay, set to what is left.
                let mut headers = headers::without(original, &[]);
                headers::set_int(&mut headers, HEADER_DUE_AT, *due_ms);
                headers::set_int(&mut headers, HEADER_X_DELAY, *early_ms);
                Disposition::Republish(delayed(topology, headers))
            }
            Self::Retry {
                step,
                attempt,
                error,
                ..
            } => {
                let error = readable(error, 1_000);
                tracing::warn!(step, attempt, error = %error, "transient failure; will retry");
                metrics
                    .retries
                    .get_or_create(&StepLabel { step: *step as u32 })
                    .inc();
                let mut headers = headers::without(original, &[]);
                headers::set_int(&mut headers, headers::HEADER_ATTEMPT, i64::from(*attempt));
                headers::set_text(&mut headers, headers::HEADER_LAST_ERROR, &error);
                Disposition::Republish(Target {
                    exchange: topology.retry_exchange().to_owned(),
                    routing_key: topology.retry_queue(*step).to_owned(),
                    headers,
                })
            }
            Self::DeadLetter {
                kind,
                reason,
                attempts,
                ..
            } => {
                tracing::warn!(kind = kind.as_str(), attempts, reason = %readable(reason, 1_000), "dead-lettered");
                metrics.dead(kind.reason());
                Disposition::DeadLetter(dead_letter(topology, original, *kind, reason, *attempts))
            }
        }
    }

    /// The job's key, when the message had one.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::Sent { key, .. }
            | Self::Early { key, .. }
            | Self::SentFenceLost { key }
            | Self::Duplicate { key }
            | Self::Cancelled { key }
            | Self::Stale { key }
            | Self::CancelRequest { key, .. }
            | Self::Throttled { key, .. }
            | Self::Deferred { key, .. }
            | Self::Retry { key, .. } => Some(key),
            Self::DeadLetter { key, .. } => key.as_ref(),
        }
    }
}

impl DeadKind {
    /// The counter label of this reason class.
    fn reason(self) -> DeadReason {
        match self {
            Self::Invalid => DeadReason::invalid,
            Self::Permanent => DeadReason::permanent,
            Self::Exhausted => DeadReason::retries_exhausted,
        }
    }
}

/// Back through the contract exchange (the relay or the plugin holds it until due).
fn delayed(topology: &Topology, headers: FieldTable) -> Target {
    Target {
        exchange: topology.delayed_exchange().to_owned(),
        routing_key: ROUTING_KEY.to_string(),
        headers,
    }
}

/// A dead letter: the original headers, the reason, and no retry counter (so that a
/// replay starts a fresh cycle).
pub fn dead_letter(
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
