//! What became of one delivery ([`Outcome`]) and what the consume loop does about it
//! ([`Disposition`]). Each outcome's log line, counter and disposition are written
//! together, in one arm of [`Outcome::settle`] (the longer arms call a function of
//! their own, next to it): adding an outcome is a variant and one arm, plus the
//! exhaustive `label()` and `key()` the compiler points to, and its counter declared
//! in `ops::metrics`.

use lapin::types::FieldTable;

use crate::contract::{readable, IdempotencyKey};
use crate::headers;
use crate::inbox::Cancelled;
use crate::ops::metrics::{DeadReason, Metrics, Suppressed};
use crate::topology::{LaneId, Topology};

mod dispositions;

pub(crate) use dispositions::dead_letter;
use dispositions::{
    acked, moved, retry, retry_later, sent, tenant_deferred, throttled, wait_until,
};

/// Why a job is dead-lettered, as a stable label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeadKind {
    /// The message can never become an email.
    Invalid,
    /// The SMTP server refused it for good (5xx).
    Permanent,
    /// Transient failures used up every retry step.
    Exhausted,
}

impl DeadKind {
    /// The label used in headers and metrics.
    pub(crate) fn as_str(self) -> &'static str {
        self.reason().as_str()
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
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
    /// Due outside its send window (quiet hours): goes back to the delayed exchange
    /// until the window next opens, stamped with that time; never sent meanwhile.
    Held {
        /// The job's key.
        key: IdempotencyKey,
        /// When the window next opens, Unix ms.
        until_ms: i64,
        /// How long from now, in ms.
        wait_ms: i64,
    },
    /// A debounced job's version, recorded as the pending one under a revision postie
    /// gave it: goes back to wait until due, stamped with that revision
    /// (`postie-revision`), by which it is claimed.
    Debounced {
        /// The job's key.
        key: IdempotencyKey,
        /// The revision postie gave it.
        revision: i32,
        /// Its due time, Unix ms.
        due_ms: i64,
        /// How long from now, in ms (0 when due already).
        wait_ms: i64,
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
    /// Its attachments' store is down: through retry queue `step` without counting an
    /// attempt, carrying `postie-store-waits` = `waits`.
    Waiting {
        /// The job's key.
        key: IdempotencyKey,
        /// Retry queue index.
        step: usize,
        /// Waits in a row, this one included.
        waits: u32,
        /// What the store did.
        error: String,
    },
    /// Every recipient is suppressed: recorded `suppressed`, acked, never sent.
    Suppressed {
        /// The job's key.
        key: IdempotencyKey,
        /// Which recipients and why, for the log.
        why: String,
        /// The first recipient's reason, for the counter.
        reason: Suppressed,
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
        /// The transport the job is pinned to from now on (`postie-provider`), when a
        /// send through it may have been accepted.
        provider: Option<String>,
    },
    /// A job of another lane than the queue it came from (routed `email` into
    /// `<p>.send` by the ladder, a retry queue or a replay): moved to its lane's queue,
    /// untouched.
    Moved {
        /// The job's key.
        key: IdempotencyKey,
        /// Its lane.
        lane: LaneId,
    },
    /// Over its tenant's cap in its lane: back to wait for the tenant's slot, through
    /// the lane's intake, stamped with the slot so that it is not deferred again.
    TenantDeferred {
        /// The job's key.
        key: IdempotencyKey,
        /// Its lane.
        lane: LaneId,
        /// The slot (Unix ms): its new due time.
        slot_ms: i64,
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
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Self::Sent { .. } => "sent",
            Self::Early { .. } => "early",
            Self::Held { .. } => "held",
            Self::Debounced { .. } => "debounced",
            Self::SentFenceLost { .. } => "sent_fence_lost",
            Self::Duplicate { .. } => "duplicate",
            Self::Cancelled { .. } => "cancelled",
            Self::Stale { .. } => "stale",
            Self::CancelRequest { .. } => "cancel_request",
            Self::Throttled { .. } => "throttled",
            Self::Deferred { .. } => "deferred",
            Self::Waiting { .. } => "waiting",
            Self::Retry { .. } => "retry",
            Self::Suppressed { .. } => "suppressed",
            Self::Moved { .. } => "moved",
            Self::TenantDeferred { .. } => "tenant_deferred",
            Self::DeadLetter { .. } => "dead_letter",
        }
    }
}

/// Where a copy of the delivery goes before the ack.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Target {
    /// The exchange.
    pub(crate) exchange: String,
    /// The routing key.
    pub(crate) routing_key: String,
    /// The copy's headers.
    pub(crate) headers: FieldTable,
}

/// What the consume loop does with a delivery. Only [`Disposition::Ack`] and the
/// publish-then-ack dispositions end it; I5 (no ack before the outcome is durable)
/// holds because an outcome is only named once it is committed to the inbox, and a
/// copy is acked only once the broker confirms it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Disposition {
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
    /// what becomes of the delivery, given the delivery's own headers. One arm per
    /// outcome: its log line, its counter, its disposition.
    pub(crate) fn settle(
        &self,
        metrics: &Metrics,
        topology: &Topology,
        original: Option<&FieldTable>,
    ) -> Disposition {
        self.record_in_span();
        match self {
            Self::Sent {
                takeover,
                lateness_ms,
                ..
            } => sent(metrics, *takeover, *lateness_ms),
            Self::SentFenceLost { .. } => {
                tracing::warn!(
                    "sent, but another instance had taken the key over: possible duplicate"
                );
                metrics.emails_sent.inc();
                Disposition::Ack
            }
            Self::Duplicate { .. } => acked(
                &metrics.duplicates_suppressed,
                "already sent; duplicate suppressed",
            ),
            Self::Cancelled { .. } => acked(&metrics.cancelled, "cancelled; not sent"),
            Self::Suppressed { why, reason, .. } => {
                tracing::info!(recipients = %why, "every recipient is suppressed; not sent");
                metrics.jobs_suppressed.inc(*reason);
                Disposition::Ack
            }
            Self::Stale { .. } => acked(&metrics.stale, "a newer revision exists; skipped"),
            Self::CancelRequest { cancelled, .. } => {
                tracing::info!(prior_status = %cancelled.prior_status, covers = cancelled.covers, "cancel recorded");
                Disposition::Ack
            }
            Self::Throttled { until_ms, .. } => throttled(metrics, topology, original, *until_ms),
            Self::Deferred { step, .. } => {
                tracing::info!(step, "claimed elsewhere; parked until the lease ends");
                metrics.deferred.inc();
                let headers = headers::without(original, &[]);
                Disposition::Republish(retry(topology, *step, headers))
            }
            Self::Waiting {
                step, waits, error, ..
            } => {
                tracing::warn!(step, waits, %error, "an attachment is unavailable (its store, or this instance's spool); waiting in the retry ladder, not counted as an attempt");
                metrics.store_waits.inc();
                let mut headers = headers::without(original, &[]);
                headers::set_int(&mut headers, headers::HEADER_STORE_WAITS, i64::from(*waits));
                headers::set_text(&mut headers, headers::HEADER_LAST_ERROR, error);
                Disposition::Republish(retry(topology, *step, headers))
            }
            Self::Held {
                until_ms, wait_ms, ..
            } => {
                tracing::info!(wait_ms, "outside its send window; held until it opens");
                metrics.window_held.inc();
                Disposition::Republish(wait_until(topology, original, *until_ms, *wait_ms))
            }
            Self::Debounced {
                revision,
                due_ms,
                wait_ms,
                ..
            } => {
                tracing::debug!(revision, wait_ms, "debounced: the pending version now");
                metrics.debounced.inc();
                let mut target = wait_until(topology, original, *due_ms, *wait_ms);
                headers::set_int(
                    &mut target.headers,
                    headers::HEADER_REVISION,
                    i64::from(*revision),
                );
                Disposition::Republish(target)
            }
            Self::Early {
                due_ms, early_ms, ..
            } => {
                tracing::warn!(early_ms, "arrived before its due time; sent back to wait");
                metrics.early_arrivals.inc();
                Disposition::Republish(wait_until(topology, original, *due_ms, *early_ms))
            }
            Self::Retry {
                step,
                attempt,
                error,
                provider,
                ..
            } => retry_later(
                metrics,
                topology,
                original,
                (*step, *attempt),
                error,
                provider,
            ),
            Self::Moved { lane, .. } => moved(metrics, topology, original, *lane),
            Self::TenantDeferred { lane, slot_ms, .. } => {
                tenant_deferred(metrics, topology, original, *lane, *slot_ms)
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

    /// Names the key and the outcome in the current delivery span.
    fn record_in_span(&self) {
        let span = tracing::Span::current();
        if let Some(key) = self.key() {
            span.record("key", key.as_str());
        }
        span.record("outcome", self.label());
    }

    /// The job's key, when the message had one.
    pub(crate) fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::Sent { key, .. }
            | Self::Early { key, .. }
            | Self::Held { key, .. }
            | Self::Debounced { key, .. }
            | Self::SentFenceLost { key }
            | Self::Duplicate { key }
            | Self::Cancelled { key }
            | Self::Stale { key }
            | Self::CancelRequest { key, .. }
            | Self::Throttled { key, .. }
            | Self::Deferred { key, .. }
            | Self::Waiting { key, .. }
            | Self::Retry { key, .. }
            | Self::Suppressed { key, .. }
            | Self::Moved { key, .. }
            | Self::TenantDeferred { key, .. } => Some(key),
            Self::DeadLetter { key, .. } => key.as_ref(),
        }
    }
}

impl DeadKind {
    /// The counter label of this reason class.
    fn reason(self) -> DeadReason {
        match self {
            Self::Invalid => DeadReason::Invalid,
            Self::Permanent => DeadReason::Permanent,
            Self::Exhausted => DeadReason::RetriesExhausted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DelayMode, DelaySettings, TopologySettings};
    use crate::ops::metrics::{Step, ThrottlePolicy};
    use crate::work::now_ms;

    fn topology() -> Topology {
        let settings = TopologySettings::default();
        Topology::new(&settings, &DelaySettings::default(), DelayMode::Ladder)
    }

    #[test]
    fn mx_a_job_held_by_its_window_waits_for_the_opening_and_is_counted() {
        let metrics = Metrics::new();
        let topology = topology();
        let held = Outcome::Held {
            key: IdempotencyKey::parse("k-held").unwrap(),
            until_ms: 2_000_000,
            wait_ms: 60_000,
        };
        let disposition = held.settle(&metrics, &topology, None);
        let Disposition::Republish(target) = &disposition else {
            panic!("{disposition:?}");
        };
        assert_eq!(target.exchange, topology.delayed_exchange());
        let due = crate::headers::header_int(Some(&target.headers), crate::headers::HEADER_DUE_AT);
        assert_eq!(due, Some(2_000_000), "stamped due at the opening");
        assert_eq!(metrics.window_held.get(), 1);
        assert_eq!(metrics.early_arrivals.get(), 0);
        assert!(metrics.render().contains("postie_window_held_total 1"));
    }

    #[test]
    fn mx_a_debounced_version_waits_stamped_with_its_revision_and_is_counted() {
        let metrics = Metrics::new();
        let topology = topology();
        let debounced = Outcome::Debounced {
            key: IdempotencyKey::parse("k-debounced").unwrap(),
            revision: 7,
            due_ms: 3_000_000,
            wait_ms: 3_000,
        };
        let disposition = debounced.settle(&metrics, &topology, None);
        let Disposition::Republish(target) = &disposition else {
            panic!("{disposition:?}");
        };
        assert_eq!(target.exchange, topology.delayed_exchange());
        let header = |name| crate::headers::header_int(Some(&target.headers), name);
        assert_eq!(header(crate::headers::HEADER_DUE_AT), Some(3_000_000));
        assert_eq!(header(crate::headers::HEADER_REVISION), Some(7));
        assert_eq!(header(crate::headers::HEADER_X_DELAY), Some(3_000));
        assert!(metrics.render().contains("postie_debounced_total 1"));
    }

    #[test]
    fn mx_an_early_arrival_counts_as_early_not_deferred() {
        let metrics = Metrics::new();
        let topology = topology();
        let early = Outcome::Early {
            key: IdempotencyKey::parse("k-early").unwrap(),
            due_ms: 2_000_000,
            early_ms: 4_000,
        };
        let disposition = early.settle(&metrics, &topology, None);
        assert!(
            matches!(&disposition, Disposition::Republish(t) if t.exchange == topology.delayed_exchange()),
            "{disposition:?}"
        );
        assert_eq!(metrics.early_arrivals.get(), 1);
        assert_eq!(metrics.deferred.get(), 0);
        let text = metrics.render();
        assert!(text.contains("postie_early_arrivals_total 1"), "{text}");
        assert!(text.contains("postie_deferred_total 0"), "{text}");
    }

    #[test]
    fn mx_a_deferred_job_counts_as_deferred_not_early() {
        let metrics = Metrics::new();
        let deferred = Outcome::Deferred {
            key: IdempotencyKey::parse("k-held").unwrap(),
            step: 1,
        };
        let disposition = deferred.settle(&metrics, &topology(), None);
        assert!(matches!(disposition, Disposition::Republish(_)));
        assert_eq!(metrics.deferred.get(), 1);
        assert_eq!(metrics.early_arrivals.get(), 0);
    }

    #[test]
    fn mx_labelled_counters_count_by_enum() {
        let metrics = Metrics::new();
        let throttled = |until_ms| Outcome::Throttled {
            key: IdempotencyKey::parse("k-throttled").unwrap(),
            until_ms,
        };
        throttled(None).settle(&metrics, &topology(), None);
        throttled(Some(now_ms() + 1_000)).settle(&metrics, &topology(), None);
        throttled(None).settle(&metrics, &topology(), None);
        assert_eq!(metrics.throttled.get(ThrottlePolicy::Drop), 2);
        assert_eq!(metrics.throttled.get(ThrottlePolicy::Defer), 1);
        for step in [0, 3, 3] {
            let retry = Outcome::Retry {
                key: IdempotencyKey::parse("k-retry").unwrap(),
                step,
                attempt: 1,
                error: "421".into(),
                provider: None,
            };
            retry.settle(&metrics, &topology(), None);
        }
        // A retry pinned to a provider carries its name; the pin outlives the cycle.
        let counted_apart = Metrics::new();
        let pinned = Outcome::Retry {
            key: IdempotencyKey::parse("k-pinned").unwrap(),
            step: 0,
            attempt: 1,
            error: "no reply".into(),
            provider: Some("ses".into()),
        };
        let Disposition::Republish(target) = pinned.settle(&counted_apart, &topology(), None)
        else {
            panic!("a retry is republished");
        };
        let provider = |h: &FieldTable| headers::header_text(Some(h), headers::HEADER_PROVIDER);
        assert_eq!(provider(&target.headers).as_deref(), Some("ses"));
        let again = Outcome::Retry {
            key: IdempotencyKey::parse("k-pinned").unwrap(),
            step: 1,
            attempt: 2,
            error: "503".into(),
            provider: None,
        };
        let Disposition::Republish(next) =
            again.settle(&counted_apart, &topology(), Some(&target.headers))
        else {
            panic!("a retry is republished");
        };
        assert_eq!(
            provider(&next.headers).as_deref(),
            Some("ses"),
            "kept on later retries"
        );
        // A step beyond this topology's ladder has no retry queue to settle into;
        // the counter still takes it, past its cached children.
        metrics.retries.inc(Step(40));
        assert_eq!(metrics.retries.get(Step(3)), 2);
        assert_eq!(metrics.retries.get(Step(40)), 1, "beyond the cached slots");
        let text = metrics.render();
        for line in [
            "postie_throttled_total{policy=\"drop\"} 2",
            "postie_throttled_total{policy=\"defer\"} 1",
            "postie_retries_total{step=\"0\"} 1",
            "postie_retries_total{step=\"40\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            !text.contains("step=\"1\""),
            "no child before its first count"
        );
    }
}
