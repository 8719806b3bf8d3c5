//! The HTTP control API: what was accepted, the counters, fault rules, the quota and
//! down mode.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRef, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::down::Switch;
use crate::state::{Accepted, AppState, FaultRule, QuotaConfig, Stats};

type Shared = State<Arc<AppState>>;

/// What the control handlers reach: the shared state, and the API's down switch.
#[derive(Clone)]
struct Control {
    state: Arc<AppState>,
    switch: Arc<Switch>,
}

impl FromRef<Control> for Arc<AppState> {
    fn from_ref(control: &Control) -> Self {
        control.state.clone()
    }
}

impl FromRef<Control> for Arc<Switch> {
    fn from_ref(control: &Control) -> Self {
        control.switch.clone()
    }
}

/// The control router.
pub(crate) fn router(state: Arc<AppState>, switch: Switch) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/messages", get(messages))
        .route("/stats", get(stats))
        .route("/faults", get(faults).put(set_faults).delete(clear_faults))
        .route("/quota", get(quota).put(set_quota))
        .route("/down", get(down).put(go_down).delete(come_back))
        .with_state(Control {
            state,
            switch: Arc::new(switch),
        })
}

#[derive(Deserialize)]
struct MessagesQuery {
    #[serde(default)]
    raw: bool,
}

async fn messages(State(s): Shared, Query(q): Query<MessagesQuery>) -> Json<Vec<Accepted>> {
    Json(s.accepted(q.raw))
}

async fn stats(State(s): Shared) -> Json<Stats> {
    Json(s.stats())
}

async fn faults(State(s): Shared) -> Json<Vec<FaultRule>> {
    Json(s.rules())
}

async fn set_faults(State(s): Shared, body: Bytes) -> Response {
    match serde_json::from_slice::<Vec<FaultRule>>(&body) {
        Ok(rules) => {
            s.set_rules(rules);
            Json(s.rules()).into_response()
        }
        Err(e) => (
            StatusCode::BAD_REQUEST,
            format!("invalid fault rules: {e}\n"),
        )
            .into_response(),
    }
}

async fn clear_faults(State(s): Shared) -> Json<Vec<FaultRule>> {
    s.set_rules(Vec::new());
    Json(Vec::new())
}

async fn quota(State(s): Shared) -> Json<QuotaConfig> {
    Json(s.quota())
}

async fn set_quota(State(s): Shared, body: Bytes) -> Response {
    match serde_json::from_slice::<QuotaConfig>(&body) {
        Ok(q) if q.per_second != Some(0) => {
            s.set_quota(q);
            Json(s.quota()).into_response()
        }
        _ => (StatusCode::BAD_REQUEST, "invalid quota\n").into_response(),
    }
}

/// The longest down window (`Instant` arithmetic must not overflow).
const LONGEST_DOWN: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Deserialize)]
struct GoDown {
    /// How long the API refuses connections (fractions allowed; 0: come back now).
    seconds: f64,
}

#[derive(Serialize)]
struct DownState {
    down: bool,
}

async fn down(State(switch): State<Arc<Switch>>) -> Json<DownState> {
    Json(DownState {
        down: switch.is_down(),
    })
}

async fn go_down(State(switch): State<Arc<Switch>>, body: Bytes) -> Response {
    let window = serde_json::from_slice::<GoDown>(&body)
        .ok()
        .and_then(|d| Duration::try_from_secs_f64(d.seconds).ok())
        .filter(|window| *window <= LONGEST_DOWN);
    match window {
        Some(window) => switch_to(&switch, window).await,
        None => (
            StatusCode::BAD_REQUEST,
            "invalid down window: {\"seconds\": N} with 0 <= N <= one year\n",
        )
            .into_response(),
    }
}

async fn come_back(State(switch): State<Arc<Switch>>) -> Response {
    switch_to(&switch, Duration::ZERO).await
}

/// Applies the window, then answers the state it left.
async fn switch_to(switch: &Switch, window: Duration) -> Response {
    if switch.set(window).await {
        Json(DownState {
            down: switch.is_down(),
        })
        .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the API's accept loop has stopped\n",
        )
            .into_response()
    }
}
