//! The suppression list: search by address, add (with reason and note), remove; the
//! source of each change is `console:<credential>`.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::IntoResponse;
use maud::html;

use super::action::{Action, Csrf};
use super::auth::Principal;
use super::lists::given;
use super::{page, Answer, Console};
use crate::inbox::{Suppress, SuppressionReason};

#[derive(serde::Deserialize, Default)]
pub(super) struct SuppressionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    address: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    note: String,
}

/// `GET /suppression?address=…`: the list (one address's rows when given).
pub(super) async fn suppression(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<SuppressionForm>,
) -> Answer {
    let size = console.settings.console.page_size;
    let rows = console
        .inbox
        .suppression_list(given(&q.address).as_deref(), size)
        .await?;
    let body = html! {
        form action="/suppression" method="get" {
            label { "Address " input name="address" value=(q.address); } " " button { "Search" }
        }
        (page::table(&["address", "scope", "reason", "source", "note", "since", "until", ""], rows.iter().map(|r| html! {
            tr { td { (r.address) } td { (r.scope) } td { (r.reason.as_str()) } td { (r.source) }
                 td { (r.evidence.as_deref().unwrap_or("-")) } td { (r.created_at) }
                 td { (r.expires_at.as_deref().unwrap_or("-")) }
                 td { (page::action(&who, "/suppression/remove", &[("address", &r.address)], "Remove")) } }
        })))
        @if rows.len() as i64 == size { p.muted { "The first " (size) " shown." } }
        @if who.role == super::auth::Role::Operate {
            h2 { "Suppress an address" }
            form action="/suppression/add" method="post" {
                input type="hidden" name="csrf" value=(who.csrf);
                label { "Address " input name="address"; } " "
                label { "Reason " select name="reason" {
                    @for r in SuppressionReason::ALL { option selected[r == SuppressionReason::Manual] { (r.as_str()) } }
                } } " "
                label { "Note " input name="note"; } " "
                button { "Suppress" }
            }
        }
    };
    Ok(page::frame("Suppression list", &who, body).into_response())
}

/// `POST /suppression/add`: as `postie suppression add` (every scope, no expiry).
pub(super) async fn suppress(
    State(console): State<Arc<Console>>,
    Action(who, f): Action<SuppressionForm>,
) -> Answer {
    let address = f.address.trim();
    let reason = SuppressionReason::parse(&f.reason).unwrap_or(SuppressionReason::Manual);
    if !address.contains('@') {
        return Ok(page::done(
            &who,
            "Not added",
            "That is not an email address.",
            "/suppression",
        )
        .into_response());
    }
    let source = format!("console:{}", who.name);
    let added = console
        .inbox
        .suppress(Suppress {
            address,
            scope: "*",
            reason,
            source: &source,
            evidence: given(&f.note).as_deref(),
            lasts: None,
        })
        .await?;
    tracing::info!(who = who.name, action = "suppress", added, "console action");
    let message = if added {
        "Suppressed."
    } else {
        "Already suppressed (unchanged)."
    };
    Ok(page::done(&who, "Suppression list", message, "/suppression").into_response())
}

/// `POST /suppression/remove`: every scope's row of the address.
pub(super) async fn unsuppress(
    State(console): State<Arc<Console>>,
    Action(who, f): Action<SuppressionForm>,
) -> Answer {
    let source = format!("console:{}", who.name);
    let removed = console
        .inbox
        .unsuppress(f.address.trim(), None, &source)
        .await?;
    tracing::info!(
        who = who.name,
        action = "unsuppress",
        removed,
        "console action"
    );
    let message = format!("Removed {removed} row(s).");
    Ok(page::done(&who, "Suppression list", &message, "/suppression").into_response())
}

impl Csrf for SuppressionForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}
