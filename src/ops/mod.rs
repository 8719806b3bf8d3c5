//! Running postie in production: the retry idiom (`backoff`), dependency health and the transport's circuit
//! breaker, Prometheus metrics, the `/metrics` `/healthz` `/readyz` endpoint, and
//! logs and traces.
//!
//! - `backoff.rs`: the one retry idiom. `https.rs`: the one outbound HTTP(S) client
//!   set-up (`mail::api`, the feedback fetches, `broker::management`).
//! - `health.rs`: readiness, pausing, the transport circuit.
//! - `metrics.rs`: every metric declared once; `metrics/labels.rs` label values.
//! - `http.rs`: `/metrics` `/healthz` `/readyz`, and `serve`, the one way postie
//!   serves HTTP (the feedback endpoint and the console too).
//! - `telemetry.rs`: logs and OTLP traces.

pub(crate) mod backoff;
pub(crate) mod health;
pub(crate) mod http;
pub(crate) mod https;
pub mod metrics;
pub(crate) mod telemetry;
