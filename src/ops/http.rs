//! The HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the process is
//! alive), `/readyz` (broker session consuming, PostgreSQL answering, SMTP circuit
//! closed, not draining; 503 with the reasons otherwise; either way the broker node
//! in use, redacted).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use super::health::Health;

/// Binds `addr` (failing start-up with a clear line if it cannot) and serves until
/// `stop` is cancelled. Returns the bound address (useful with port 0).
pub(crate) async fn start(
    addr: SocketAddr,
    health: Health,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for HTTP on {addr} (http.listen): {e}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Arc::new(health));
    serve(listener, app, stop, "HTTP endpoint");
    tracing::info!(%bound, "HTTP endpoint: /metrics /healthz /readyz");
    Ok(bound)
}

/// Serves `app` on `listener` in a task of its own until `stop`; a failure is logged
/// under `what` (this endpoint and the feedback endpoint).
pub(crate) fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    stop: CancellationToken,
    what: &'static str,
) {
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "{what} failed");
        }
    });
}

async fn metrics(State(health): State<Arc<Health>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        health.metrics().render(),
    )
}

/// `ready` or `not ready: <reasons>`, then `broker: <address>` (redacted) once a
/// broker node has been reached: the one in use, or the last one used.
async fn readyz(State(health): State<Arc<Health>>) -> impl IntoResponse {
    let reasons = health.not_ready();
    let broker = match health.broker_address() {
        address if address.is_empty() => String::new(),
        address => format!("broker: {address}\n"),
    };
    let broker = broker + &health.outbox_lines();
    if reasons.is_empty() {
        (StatusCode::OK, format!("ready\n{broker}"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n{broker}", reasons.join(", ")),
        )
    }
}
