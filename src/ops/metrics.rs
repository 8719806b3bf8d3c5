//! Prometheus metrics: one named counter, gauge or histogram per thing an on-call
//! engineer asks about, each with fixed, low-cardinality labels (never a key or an
//! address). One [`Metrics`] per `serve`, rendered by the HTTP endpoint.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Why a job was dead-lettered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum DeadReason {
    /// Could never become an email.
    invalid,
    /// SMTP 5xx.
    permanent,
    /// Every retry step used.
    retries_exhausted,
}

/// A label with one fixed-vocabulary value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason.
    pub reason: DeadReason,
}

/// The retry step a job went to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabel {
    /// Retry queue index.
    pub step: u32,
}

/// A dependency postie talks to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Dependency {
    /// RabbitMQ.
    rabbitmq,
    /// PostgreSQL.
    postgresql,
    /// The SMTP relay.
    smtp,
}

/// Labels naming a dependency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DependencyLabel {
    /// The dependency.
    pub dependency: Dependency,
}

/// Labels naming a queue (the topology's own queues only).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// Queue name.
    pub queue: String,
}

/// Where the relay sent a job.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    /// `ladder` or `now`.
    pub route: String,
}

/// A throttle policy.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    /// `drop` or `defer`.
    pub policy: String,
}

/// What a prune deleted: `finished`, `tombstone` or `throttle` rows.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrunedLabel {
    /// The kind of row.
    pub kind: String,
}

/// Every metric postie exports.
pub struct Metrics {
    registry: Registry,
    /// Deliveries taken from the send queue.
    pub jobs_received: Counter,
    /// Emails accepted by the SMTP server and recorded.
    pub emails_sent: Counter,
    /// Deliveries of an already-sent key, acked without sending.
    pub duplicates_suppressed: Counter,
    /// Jobs parked because another instance held a live claim.
    pub deferred: Counter,
    /// Expired claims taken over (the known duplicate window).
    pub takeovers: Counter,
    /// Transient failures sent to a retry queue, by step.
    pub retries: Family<StepLabel, Counter>,
    /// Jobs dead-lettered, by reason.
    pub dead_lettered: Family<ReasonLabel, Counter>,
    /// Jobs refused as invalid (also counted in `dead_lettered`).
    pub invalid_jobs: Counter,
    /// Jobs relayed into the ladder or straight to work.
    pub relayed: Family<RouteLabel, Counter>,
    /// Ladder mode: overdue scheduled jobs the reconciler re-published.
    pub reconciled: Counter,
    /// One SMTP send, seconds.
    pub smtp_send_seconds: Histogram,
    /// One delivery from receipt to ack, seconds.
    pub processing_seconds: Histogram,
    /// Sent minus due, seconds.
    pub lateness_seconds: Histogram,
    /// Deliveries being processed now.
    pub in_flight: Gauge,
    /// 1 while consumption is paused (a dependency is down), else 0.
    pub consumer_paused: Gauge,
    /// Ready messages per queue, polled.
    pub queue_depth: Family<QueueLabel, Gauge>,
    /// Reconnections, by dependency.
    pub reconnects: Family<DependencyLabel, Counter>,
    /// 1 while the SMTP circuit breaker is open.
    pub smtp_breaker_open: Gauge,
    /// Jobs over their type's throttle, by policy.
    pub throttled: Family<PolicyLabel, Counter>,
    /// Jobs skipped because a cancel covers them.
    pub cancelled: Counter,
    /// Jobs skipped because a newer revision exists.
    pub stale: Counter,
    /// Ladder mode: jobs scheduled and not yet sent or cancelled (polled).
    pub pending: Gauge,
    /// Rows deleted by retention, by kind.
    pub pruned: Family<PrunedLabel, Counter>,
    /// One prune pass, seconds.
    pub prune_seconds: Histogram,
    /// The inbox's rows, the planner's estimate (maintenance instance only).
    pub inbox_rows: Gauge,
    /// 1 on the instance running singleton maintenance, else 0.
    pub maintenance_leader: Gauge,
    /// The send-rate limit and the adaptive throttle (issue #13).
    pub rate: RateMetrics,
}

/// The send-rate limit and the adaptive throttle.
pub struct RateMetrics {
    /// `smtp.rate_limit` in emails per second (0: no limit).
    pub limit: Gauge<f64, AtomicU64>,
    /// This instance's adaptive send-rate cap, emails per second (0: no cap).
    pub adaptive: Gauge<f64, AtomicU64>,
    /// SMTP replies classed as throttles.
    pub throttle_replies: Counter,
    /// Time a job waited for its turn to send (before its claim), seconds.
    pub wait_seconds: Histogram,
    /// Slices of tokens leased from PostgreSQL (one statement each).
    pub leases: Counter,
    /// Tokens leased from PostgreSQL.
    pub tokens: Counter,
    /// Tokens left unused to pay back sends that a stall pushed together.
    pub tokens_paid_back: Counter,
}

impl RateMetrics {
    fn register(&self, registry: &mut Registry) {
        let r = registry;
        r.register(
            "rate_limit_per_second",
            "smtp.rate_limit in emails per second (0: none)",
            self.limit.clone(),
        );
        r.register(
            "adaptive_rate_per_second",
            "This instance's adaptive send-rate cap (0: no cap)",
            self.adaptive.clone(),
        );
        r.register(
            "smtp_throttle_replies",
            "SMTP replies classed as throttles (smtp.throttle_patterns)",
            self.throttle_replies.clone(),
        );
        r.register(
            "rate_wait_seconds",
            "Time a job waited for its turn to send, before its claim",
            self.wait_seconds.clone(),
        );
        r.register(
            "rate_limit_leases",
            "Slices of tokens leased from PostgreSQL (one statement each)",
            self.leases.clone(),
        );
        r.register(
            "rate_limit_tokens",
            "Tokens leased from PostgreSQL",
            self.tokens.clone(),
        );
        r.register(
            "rate_limit_tokens_paid_back",
            "Tokens left unused to pay back sends that a stall pushed together",
            self.tokens_paid_back.clone(),
        );
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric under the `postie` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("postie");
        let seconds = |start, n| Histogram::new(exponential_buckets(start, 2.0, n));
        let m = Self {
            jobs_received: Counter::default(),
            emails_sent: Counter::default(),
            duplicates_suppressed: Counter::default(),
            deferred: Counter::default(),
            takeovers: Counter::default(),
            retries: Family::default(),
            dead_lettered: Family::default(),
            invalid_jobs: Counter::default(),
            relayed: Family::default(),
            reconciled: Counter::default(),
            smtp_send_seconds: seconds(0.001, 16),
            processing_seconds: seconds(0.001, 18),
            lateness_seconds: seconds(0.005, 16),
            in_flight: Gauge::default(),
            consumer_paused: Gauge::default(),
            queue_depth: Family::default(),
            reconnects: Family::default(),
            smtp_breaker_open: Gauge::default(),
            throttled: Family::default(),
            cancelled: Counter::default(),
            stale: Counter::default(),
            pending: Gauge::default(),
            pruned: Family::default(),
            prune_seconds: seconds(0.001, 20),
            inbox_rows: Gauge::default(),
            maintenance_leader: Gauge::default(),
            rate: RateMetrics {
                limit: Gauge::default(),
                adaptive: Gauge::default(),
                throttle_replies: Counter::default(),
                wait_seconds: seconds(0.001, 16),
                leases: Counter::default(),
                tokens: Counter::default(),
                tokens_paid_back: Counter::default(),
            },
            registry: Registry::default(),
        };
        registry.register(
            "jobs_received",
            "Deliveries taken from the send queue",
            m.jobs_received.clone(),
        );
        registry.register(
            "emails_sent",
            "Emails accepted by the SMTP server and recorded as sent",
            m.emails_sent.clone(),
        );
        registry.register(
            "duplicates_suppressed",
            "Deliveries of an already-sent key, acked without sending",
            m.duplicates_suppressed.clone(),
        );
        registry.register(
            "deferred",
            "Jobs parked because another instance held a live claim",
            m.deferred.clone(),
        );
        registry.register(
            "lease_takeovers",
            "Expired claims taken over (the old owner may have sent)",
            m.takeovers.clone(),
        );
        registry.register(
            "retries",
            "Transient failures sent to a retry queue, by step",
            m.retries.clone(),
        );
        registry.register(
            "dead_lettered",
            "Jobs dead-lettered, by reason",
            m.dead_lettered.clone(),
        );
        registry.register(
            "invalid_jobs",
            "Jobs refused as invalid",
            m.invalid_jobs.clone(),
        );
        registry.register(
            "relayed",
            "Ladder mode: jobs relayed from intake, by route",
            m.relayed.clone(),
        );
        registry.register(
            "reconciled",
            "Ladder mode: overdue scheduled jobs re-published by the reconciler",
            m.reconciled.clone(),
        );
        registry.register(
            "smtp_send_duration_seconds",
            "One SMTP send",
            m.smtp_send_seconds.clone(),
        );
        registry.register(
            "processing_duration_seconds",
            "One delivery from receipt to ack",
            m.processing_seconds.clone(),
        );
        registry.register(
            "delivery_lateness_seconds",
            "Sent minus due",
            m.lateness_seconds.clone(),
        );
        registry.register(
            "in_flight",
            "Deliveries being processed now",
            m.in_flight.clone(),
        );
        registry.register(
            "consumer_paused",
            "1 while consumption is paused for an outage",
            m.consumer_paused.clone(),
        );
        registry.register(
            "queue_depth",
            "Ready messages per queue (polled)",
            m.queue_depth.clone(),
        );
        registry.register(
            "reconnects",
            "Reconnections, by dependency",
            m.reconnects.clone(),
        );
        registry.register(
            "smtp_circuit_open",
            "1 while the SMTP circuit breaker is open",
            m.smtp_breaker_open.clone(),
        );
        registry.register(
            "throttled",
            "Jobs over their type's throttle, by policy",
            m.throttled.clone(),
        );
        registry.register(
            "cancelled",
            "Jobs skipped because a cancel covers them",
            m.cancelled.clone(),
        );
        registry.register(
            "stale",
            "Jobs skipped because a newer revision exists",
            m.stale.clone(),
        );
        registry.register(
            "pending",
            "Ladder mode: scheduled jobs not yet sent or cancelled (polled)",
            m.pending.clone(),
        );
        registry.register(
            "pruned_rows",
            "Rows deleted by retention, by kind",
            m.pruned.clone(),
        );
        registry.register(
            "prune_duration_seconds",
            "One prune pass",
            m.prune_seconds.clone(),
        );
        registry.register(
            "inbox_rows",
            "Inbox rows, planner estimate (maintenance instance)",
            m.inbox_rows.clone(),
        );
        registry.register(
            "maintenance_leader",
            "1 on the instance running singleton maintenance",
            m.maintenance_leader.clone(),
        );
        m.rate.register(&mut registry);
        Self { registry, ..m }
    }

    /// Counts a dead letter under its reason.
    pub fn dead(&self, reason: DeadReason) {
        if reason == DeadReason::invalid {
            self.invalid_jobs.inc();
        }
        self.dead_lettered
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Counts a reconnection.
    pub fn reconnected(&self, dependency: Dependency) {
        self.reconnects
            .get_or_create(&DependencyLabel { dependency })
            .inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Shared handle.
pub type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_with_fixed_labels() {
        let m = Metrics::new();
        m.emails_sent.inc();
        m.dead(DeadReason::invalid);
        m.retries.get_or_create(&StepLabel { step: 2 }).inc();
        let text = m.render();
        assert!(text.contains("postie_emails_sent_total 1"), "{text}");
        assert!(
            text.contains("postie_dead_lettered_total{reason=\"invalid\"} 1"),
            "{text}"
        );
        assert!(text.contains("postie_invalid_jobs_total 1"), "{text}");
        assert!(
            text.contains("postie_retries_total{step=\"2\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE postie_delivery_lateness_seconds histogram"),
            "{text}"
        );
    }
}
