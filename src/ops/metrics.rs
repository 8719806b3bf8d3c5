//! Prometheus metrics: one named counter, gauge or histogram per thing an on-call
//! engineer asks about, each with fixed, low-cardinality labels (never a key or an
//! address). One [`Metrics`] per `serve`, rendered by the HTTP endpoint.
//!
//! Each metric is declared once, in the `declare!` table below: its field, its
//! constructor, its exported name and its help text (also the field's doc). A
//! labelled counter is a [`Counters`] over an enum of its values (`labels.rs`).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

mod labels;

pub use labels::{
    Counters, DeadReason, Dependency, EventOutcome, FeedbackKind, FeedbackLabel, FeedbackResult,
    FeedbackSource, Label, LabelValue, ProviderLabel, ProviderName, ProviderResult, Pruned,
    RateLabel, RateWindow, RelayRoute, Step, Suppressed, ThrottlePolicy, UnsubscribeResult,
};

/// Labels naming a queue (the topology's own queues only).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// Queue name.
    pub queue: String,
}

/// `lane="name"`: a lane (`topology.lanes`' names, bounded by the configuration).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaneLabel {
    /// The lane's name.
    pub lane: String,
}

/// `source="name"`: a producer's outbox (`outbox.sources`' names, never its URL).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// The source's name.
    pub source: String,
}

/// How a metric is registered: a handle sharing its values.
trait Register {
    fn register_in(&self, registry: &mut Registry, name: &'static str, help: &'static str);
}

impl<M: Metric + Clone> Register for M {
    fn register_in(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.clone());
    }
}

impl<V: LabelValue> Register for Counters<V> {
    fn register_in(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.family().clone());
    }
}

/// A histogram of seconds: `n` buckets doubling from `start`.
fn seconds(start: f64, n: u16) -> Histogram {
    Histogram::new(exponential_buckets(start, 2.0, n))
}

/// Declares a set of metrics once each: `field: Type [= constructor] => "name",
/// "help";` gives the struct field (documented by its help), its construction
/// (`Default` unless given) and its registration, in table order. Fields in `also`
/// are built but not registered.
macro_rules! declare {
    (
        $(#[$meta:meta])*
        pub struct $set:ident {
            $(
                $(#[$fmeta:meta])*
                $field:ident: $ty:ty $(= $init:expr)? => $name:literal, $help:literal;
            )*
        }
        $(also {
            $( $(#[$xmeta:meta])* $xvis:vis $xfield:ident: $xty:ty = $xinit:expr, )*
        })?
    ) => {
        $(#[$meta])*
        pub struct $set {
            $(
                #[doc = $help]
                $(#[$fmeta])*
                pub $field: $ty,
            )*
            $($( $(#[$xmeta])* $xvis $xfield: $xty, )*)?
        }

        impl $set {
            /// Every metric of the set, not yet registered.
            fn create() -> Self {
                Self {
                    $( $field: declare!(@init $ty $(, $init)?), )*
                    $($( $xfield: $xinit, )*)?
                }
            }

            /// Registers every metric of the set, in table order.
            fn register(&self, registry: &mut Registry) {
                $( Register::register_in(&self.$field, registry, $name, $help); )*
            }
        }
    };
    (@init $ty:ty) => { <$ty>::default() };
    (@init $ty:ty, $init:expr) => { $init };
}

declare! {
    /// The send-rate limit and the adaptive throttle (issue #13).
    pub struct RateMetrics {
        limit: Gauge<f64, AtomicU64>
            => "rate_limit_per_second", "transport.rate_limit in emails per second (0: none)";
        adaptive: Gauge<f64, AtomicU64>
            => "adaptive_rate_per_second", "This instance's adaptive send-rate cap (0: no cap)";
        throttle_replies: Counter
            => "smtp_throttle_replies", "SMTP replies classed as throttles (smtp.throttle_patterns)";
        wait_seconds: Histogram = seconds(0.001, 16)
            => "rate_wait_seconds", "Time a job waited for its turn to send, before its claim";
        leases: Counter
            => "rate_limit_leases", "Slices of tokens leased from PostgreSQL (one statement each)";
        tokens: Counter
            => "rate_limit_tokens", "Tokens leased from PostgreSQL";
        tokens_paid_back: Counter
            => "rate_limit_tokens_paid_back", "Tokens left unused to pay back sends that a stall pushed together";
    }
}

declare! {
    /// Every metric postie exports.
    pub struct Metrics {
        jobs_received: Counter
            => "jobs_received", "Deliveries taken from the send queue";
        headers_dropped: Counter
            => "unsealed_headers_dropped", "postie-* headers a delivery carried without postie's seal (a producer's), dropped at intake";
        emails_sent: Counter
            => "emails_sent", "Emails accepted by the SMTP server and recorded as sent";
        duplicates_suppressed: Counter
            => "duplicates_suppressed", "Deliveries of an already-sent key, acked without sending";
        deferred: Counter
            => "deferred", "Jobs parked because another instance held a live claim";
        early_arrivals: Counter
            => "early_arrivals", "Deliveries that arrived before their due time and went back to wait";
        window_held: Counter
            => "window_held", "Jobs held back by a send window (quiet hours) until it next opens";
        debounced: Counter
            => "debounced", "Versions of debounced jobs recorded as the pending one (each replaces the one before)";
        takeovers: Counter
            => "lease_takeovers", "Expired claims taken over (the old owner may have sent)";
        retries: Counters<Step>
            => "retries", "Transient failures sent to a retry queue, by step";
        dead_lettered: Counters<DeadReason>
            => "dead_lettered", "Jobs dead-lettered, by reason";
        /// Also counted in `dead_lettered`.
        invalid_jobs: Counter
            => "invalid_jobs", "Jobs refused as invalid";
        relayed: Counters<RelayRoute>
            => "relayed", "Ladder mode: jobs relayed from intake, by route";
        reconciled: Counter
            => "reconciled", "Ladder mode: overdue scheduled jobs re-published by the reconciler";
        smtp_send_seconds: Histogram = seconds(0.001, 16)
            => "smtp_send_duration_seconds", "One SMTP send";
        processing_seconds: Histogram = seconds(0.001, 18)
            => "processing_duration_seconds", "One delivery from receipt to ack";
        lateness_seconds: Histogram = seconds(0.005, 16)
            => "delivery_lateness_seconds", "Sent minus due";
        in_flight: Gauge
            => "in_flight", "Deliveries being processed now";
        consumer_paused: Gauge
            => "consumer_paused", "1 while consumption is paused for an outage";
        queue_depth: Family<QueueLabel, Gauge>
            => "queue_depth", "Ready messages per queue (polled)";
        reconnects: Counters<Dependency>
            => "reconnects", "Reconnections, by dependency";
        smtp_breaker_open: Gauge
            => "smtp_circuit_open", "1 while every transport's circuit breaker is open (consumption paused)";
        provider_sends: Family<ProviderLabel, Counter>
            => "provider_sends", "Sends per transport (transport.providers' names), by result";
        provider_circuit_open: Family<ProviderName, Gauge>
            => "provider_circuit_open", "1 while this transport's circuit breaker is open";
        throttled: Counters<ThrottlePolicy>
            => "throttled", "Jobs over their type's throttle, by policy";
        cancelled: Counter
            => "cancelled", "Jobs skipped because a cancel covers them";
        jobs_suppressed: Counters<Suppressed>
            => "jobs_suppressed", "Jobs never sent because every recipient is suppressed, by the first one's reason";
        recipients_suppressed: Counters<Suppressed>
            => "recipients_suppressed", "Recipients left out of a job's envelope because they are suppressed, by reason";
        suppressions_added: Counters<Suppressed>
            => "suppressions_added", "Addresses postie put on the suppression list from a relay's reply, by reason";
        feedback_rate: Family<RateLabel, Gauge<f64, AtomicU64>>
            => "feedback_rate", "Bounces or complaints per email sent, per job type, over the last hour or day (polled by the maintenance instance)";
        feedback_notifications: Family<FeedbackLabel, Counter>
            => "feedback_notifications", "Bounce and complaint notifications from the providers' webhooks, by provider and result";
        unsubscribe_requests: Counters<UnsubscribeResult>
            => "unsubscribe_requests", "One-click unsubscribe requests (/u/TOKEN), by result";
        stale: Counter
            => "stale", "Jobs skipped because a newer revision exists";
        pending: Gauge
            => "pending", "Ladder mode: scheduled jobs not yet sent or cancelled (polled)";
        pruned: Counters<Pruned>
            => "pruned_rows", "Rows deleted by retention, by kind";
        prune_seconds: Histogram = seconds(0.001, 20)
            => "prune_duration_seconds", "One prune pass";
        inbox_rows: Gauge
            => "inbox_rows", "Inbox rows, planner estimate (maintenance instance)";
        maintenance_leader: Gauge
            => "maintenance_leader", "1 on the instance running singleton maintenance";
        events_published: Counters<EventOutcome>
            => "events_published", "Delivery events published to <p>.events and confirmed, by outcome";
        events_backlog_seconds: Gauge<f64, AtomicU64>
            => "events_backlog_seconds", "Age of the oldest delivery event this instance found waiting at its last poll (0: none)";
        outbox_relayed: Family<SourceLabel, Counter>
            => "outbox_relayed", "Rows of a producer's outbox published to <p>.delayed, confirmed and deleted, by source";
        outbox_batch_seconds: Family<SourceLabel, Histogram, fn() -> Histogram> = Family::new_with_constructor(|| seconds(0.001, 16))
            => "outbox_batch_duration_seconds", "One outbox batch: taken, published (confirms awaited), deleted, committed, by source";
        outbox_oldest_seconds: Family<SourceLabel, Gauge<f64, AtomicU64>>
            => "outbox_oldest_row_age_seconds", "Age of the oldest row of a source: in this instance's last batch, or waiting while it cannot publish (0: none)";
        outbox_source_up: Family<SourceLabel, Gauge>
            => "outbox_source_up", "1 while this instance reaches the source's outbox, 0 while it does not";
        outbox_rejected: Family<SourceLabel, Counter>
            => "outbox_rejected", "Rows of a producer's outbox refused for good (by the broker, or over worker.max_body_bytes) and moved to postie.outbox_rejected, by source";
        lane_sent: Family<LaneLabel, Counter>
            => "lane_emails_sent", "Emails sent, by lane (topology.lanes)";
        lane_lateness_seconds: Family<LaneLabel, Histogram, fn() -> Histogram> = Family::new_with_constructor(|| seconds(0.005, 16))
            => "lane_delivery_lateness_seconds", "Sent minus due, by lane";
        lane_moves: Counter
            => "lane_moves", "Jobs that reached <p>.send (ladder, retry, replay) moved to the queue of the lane they name";
        tenant_deferred: Counter
            => "tenant_deferred", "Jobs over their tenant's cap in their lane, deferred to the tenant's next slot";
        store_waits: Counter
            => "attachment_store_waits", "Jobs whose attachments could not be had (the store did not answer, or refused postie's own credentials; or this instance's spool failed to read), sent back through the retry ladder without counting an attempt";
    }
    also {
        /// The send-rate limit and the adaptive throttle.
        pub rate: RateMetrics = RateMetrics::create(),
        registry: Registry = Registry::default(),
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
        let m = Self::create();
        m.register(&mut registry);
        m.rate.register(&mut registry);
        Self { registry, ..m }
    }

    /// Counts a dead letter under its reason.
    pub fn dead(&self, reason: DeadReason) {
        if reason == DeadReason::Invalid {
            self.invalid_jobs.inc();
        }
        self.dead_lettered.inc(reason);
    }

    /// Counts a reconnection.
    pub fn reconnected(&self, dependency: Dependency) {
        self.reconnects.inc(dependency);
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
pub(crate) type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_with_fixed_labels() {
        let m = Metrics::new();
        m.emails_sent.inc();
        m.dead(DeadReason::Invalid);
        m.retries.inc(Step(2));
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
