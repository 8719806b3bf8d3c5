//! Running postie in production: the retry idiom (`backoff`), dependency health and the transport's circuit
//! breaker, Prometheus metrics, the `/metrics` `/healthz` `/readyz` endpoint, and
//! logs and traces.

pub mod backoff;
pub mod health;
pub mod http;
pub(crate) mod https;
pub mod metrics;
pub mod telemetry;
