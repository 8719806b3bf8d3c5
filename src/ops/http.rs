//! The HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the process is
//! alive), `/readyz` (broker session consuming, PostgreSQL answering, SMTP circuit
//! closed, not draining; 503 with the reasons otherwise; either way the broker node
//! in use, redacted).
//!
//! And [`serve`], the one way postie serves HTTP (this endpoint, the feedback
//! webhooks, the console), holding every client to [`Limits`]: a cap on connections
//! served at once, a deadline for a request's headers (and an idle kept-alive
//! connection), for its body, and for its answer to be taken.
//!
//! Under `http.*`: at most `max_connections` at once, the next waiting in the
//! kernel's queue; headers and an idle kept-alive connection within
//! `header_timeout` (hyper's timer); the body read before any handler, within
//! `request_timeout` and the listener's size bound (408, 413); an answer not taken
//! within `request_timeout` drops the connection. Each request carries its client's
//! `ConnectInfo`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::health::Health;
use crate::config::HttpSettings;

/// The largest request head (request line and headers) read; hyper answers 431 past it.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Bodies on this endpoint: none is read.
const METRICS_MAX_BODY: usize = 16 * 1024;
/// How often, at most, a listener at its connection cap says so.
const CAP_WARNING_EVERY: Duration = Duration::from_secs(60);

/// What bounds a listener's clients (`http.*`; the body size is the listener's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connections served at once; one more waits in the kernel's accept queue.
    pub(crate) max_connections: usize,
    /// A request's headers within this; an idle kept-alive connection closed after it.
    pub(crate) header_timeout: Duration,
    /// A request's body read within this (408), and its answer taken by the client
    /// within this once ready (else the connection is closed).
    pub(crate) request_timeout: Duration,
    /// The largest request body read (413 past it).
    pub(crate) max_body_bytes: usize,
}

impl Limits {
    /// `http.*`'s bounds with this listener's largest body.
    pub(crate) fn new(http: &HttpSettings, max_body_bytes: usize) -> Self {
        Self {
            max_connections: http.max_connections,
            header_timeout: http.header_timeout,
            request_timeout: http.request_timeout,
            max_body_bytes,
        }
    }
}

/// Binds `http.listen` (failing start-up with a clear line if it cannot) and serves
/// until `stop` is cancelled. Returns the bound address (useful with port 0).
pub(crate) async fn start(
    http: &HttpSettings,
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
    let limits = Limits::new(http, METRICS_MAX_BODY);
    serve(listener, app, limits, stop, "HTTP endpoint");
    tracing::info!(%bound, "HTTP endpoint: /metrics /healthz /readyz");
    Ok(bound)
}

/// Serves `app` on `listener` in a task of its own until `stop`, under `limits`;
/// `what` names the listener in its log lines. Each request carries its client's
/// address as `ConnectInfo<SocketAddr>`, and reaches `app` with its body read.
pub(crate) fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: CancellationToken,
    what: &'static str,
) {
    let app = app.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| read_body(limits, req, next),
    ));
    tokio::spawn(accept(listener, app, limits, stop, what));
}

/// Takes a slot, then a connection, and serves it in a task of its own.
async fn accept(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: CancellationToken,
    what: &'static str,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut warned: Option<Instant> = None;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if warned.is_none_or(|at| at.elapsed() >= CAP_WARNING_EVERY) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        listener = what,
                        max_connections = limits.max_connections,
                        "HTTP listener at its connection cap (http.max_connections); new connections wait"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => return,
                    },
                    () = stop.cancelled() => return,
                }
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let (app, stop) = (app.clone(), stop.clone());
                tokio::spawn(connection(stream, peer, app, limits, stop, slot));
            }
            Err(error) => {
                // Out of file descriptors, most likely: wait, do not spin.
                tracing::warn!(listener = what, %error, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves one connection (HTTP/1.1) until it ends, its client is too slow, or
/// `stop` (then in-flight requests finish). Headers within `header_timeout` (hyper's
/// timer, which also closes an idle kept-alive connection); once a handler has
/// answered, the client must take the answer, or send its next request's headers,
/// within `request_timeout`, else the connection is dropped. The slot goes with it.
async fn connection<S>(
    io: S,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    stop: CancellationToken,
    _slot: OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let opened = Instant::now();
    // Milliseconds since `opened` when the connection is dropped; `IDLE`: a handler
    // is running (its own dependencies bound it), so no deadline.
    const IDLE: u64 = u64::MAX;
    let millis = |at: Instant| at.duration_since(opened).as_millis() as u64;
    let deadline = Arc::new(AtomicU64::new(millis(opened + limits.header_timeout)));
    let service = {
        let deadline = deadline.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let (app, deadline) = (app.clone(), deadline.clone());
            deadline.store(IDLE, Ordering::Relaxed);
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(ConnectInfo(peer));
            async move {
                let answered = app.oneshot(request).await;
                let taken_by = millis(Instant::now() + limits.request_timeout);
                deadline.store(taken_by, Ordering::Relaxed);
                answered
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        let until = deadline.load(Ordering::Relaxed);
        let wake = match until {
            IDLE => opened + Duration::from_secs(86_400 * 365),
            ms => opened + Duration::from_millis(ms),
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            () = tokio::time::sleep_until(wake) => {
                if deadline.load(Ordering::Relaxed) == until {
                    tracing::debug!(%peer, "HTTP client too slow; connection closed");
                    return;
                }
            }
            () = stop.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Reads the request's body, at most `max_body_bytes`, within `request_timeout`,
/// before any handler runs: a client that sends its body slowly or never is
/// answered 408 and its connection closed.
async fn read_body(limits: Limits, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        limits.request_timeout,
        axum::body::to_bytes(body, limits.max_body_bytes),
    )
    .await;
    let refused = |status: StatusCode, why: &'static str| {
        (status, [(header::CONNECTION, "close")], why).into_response()
    };
    match read {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(error)) if is_too_large(&error) => refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request's body is too large\n",
        ),
        Ok(Err(_)) => refused(StatusCode::BAD_REQUEST, "the request's body was cut off\n"),
        Err(_) => refused(
            StatusCode::REQUEST_TIMEOUT,
            "the request's body did not arrive in time\n",
        ),
    }
}

fn is_too_large(error: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits(request_timeout: Duration) -> Limits {
        Limits {
            max_connections: 1,
            header_timeout: Duration::from_secs(1),
            request_timeout,
            max_body_bytes: 1024,
        }
    }

    /// An answer bigger than the pipe, to a client that never reads it: the
    /// connection is dropped once `request_timeout` has passed since it was ready.
    #[tokio::test]
    async fn a_client_that_does_not_take_its_answer_is_dropped() {
        let big = "x".repeat(1 << 20);
        let app = Router::new().route("/", get(move || async move { big }));
        let (mut client, server) = tokio::io::duplex(4096);
        let slot = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let limits = limits(Duration::from_millis(300));
        let served = tokio::spawn(connection(
            server,
            peer,
            app,
            limits,
            CancellationToken::new(),
            slot,
        ));
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let started = std::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("the connection outlived its deadline")
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(250));
        // What it had written before: the start of the answer, then the end.
        let mut head = [0u8; 12];
        client.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
    }

    /// A body over the listener's bound is refused (413) before its handler runs.
    #[tokio::test]
    async fn a_body_over_the_bound_is_refused() {
        let app = Router::new().route("/", axum::routing::post(|body: String| async move { body }));
        let limits = limits(Duration::from_secs(5));
        let app = app.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| read_body(limits, req, next),
        ));
        let small = Request::post("/").body(Body::from("ok")).unwrap();
        let answer = app.clone().oneshot(small).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let large = Request::post("/")
            .body(Body::from("x".repeat(2048)))
            .unwrap();
        let answer = app.oneshot(large).await.unwrap();
        assert_eq!(answer.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }
}
