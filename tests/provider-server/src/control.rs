//! The HTTP control API: what was accepted, the counters, fault rules and the quota.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use crate::state::{Accepted, AppState, FaultRule, QuotaConfig, Stats};

type Shared = State<Arc<AppState>>;

/// The control router.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/messages", get(messages))
        .route("/stats", get(stats))
        .route("/faults", get(faults).put(set_faults).delete(clear_faults))
        .route("/quota", get(quota).put(set_quota))
        .with_state(state)
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
