//! The HTTP control API.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::faults::FaultRule;
use crate::quota::{QuotaConfig, QuotaView};
use crate::state::{AppState, Stats};

/// Shared state as seen by handlers.
type Shared = State<Arc<AppState>>;

/// Serves the control API until the listener fails.
pub(crate) async fn serve(listener: TcpListener, state: Arc<AppState>) -> anyhow::Result<()> {
    axum::serve(listener, router(state)).await?;
    Ok(())
}

/// Builds the control router.
fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/messages", get(list_messages).delete(clear_messages))
        .route("/stats", get(stats))
        .route(
            "/faults",
            get(list_faults).put(set_faults).delete(clear_faults),
        )
        .route("/quota", get(quota).put(set_quota).delete(clear_quota))
        .with_state(state)
}

/// Query string of `GET /messages`.
#[derive(Debug, Deserialize)]
struct MessagesQuery {
    /// Include the raw message content.
    #[serde(default)]
    raw: bool,
}

/// `GET /messages[?raw=true]`.
async fn list_messages(State(state): Shared, Query(q): Query<MessagesQuery>) -> Response {
    match state.messages_json(q.raw) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// `DELETE /messages`.
async fn clear_messages(State(state): Shared) -> Json<serde_json::Value> {
    Json(json!({ "deleted": state.clear_messages() }))
}

/// `GET /stats`.
async fn stats(State(state): Shared) -> Json<Stats> {
    Json(state.stats())
}

/// `GET /faults`.
async fn list_faults(State(state): Shared) -> Json<Vec<FaultRule>> {
    Json(state.rules())
}

/// `PUT /faults`: replaces the rules; answers with the new list, or 400.
async fn set_faults(State(state): Shared, body: Bytes) -> Response {
    match serde_json::from_slice::<Vec<FaultRule>>(&body) {
        Ok(rules) => {
            state.set_rules(rules);
            Json(state.rules()).into_response()
        }
        Err(e) => (
            StatusCode::BAD_REQUEST,
            format!("invalid fault rules: {e}\n"),
        )
            .into_response(),
    }
}

/// `DELETE /faults`.
async fn clear_faults(State(state): Shared) -> Json<serde_json::Value> {
    Json(json!({ "deleted": state.set_rules(Vec::new()) }))
}

/// `GET /quota`: the settings and the counters.
async fn quota(State(state): Shared) -> Json<QuotaView> {
    Json(state.quota())
}

/// `PUT /quota`: replaces the settings; answers like `GET /quota`, or 400.
async fn set_quota(State(state): Shared, body: Bytes) -> Response {
    let config = serde_json::from_slice::<QuotaConfig>(&body)
        .map_err(|e| e.to_string())
        .and_then(|config| config.validate().map(|()| config));
    match config {
        Ok(config) => {
            state.set_quota(config);
            Json(state.quota()).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("invalid quota: {e}\n")).into_response(),
    }
}

/// `DELETE /quota`: quota mode off (the counters carry on).
async fn clear_quota(State(state): Shared) -> Json<QuotaView> {
    state.set_quota(QuotaConfig::new(None));
    Json(state.quota())
}
