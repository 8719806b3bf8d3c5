//! One job by key: its inbox row, its unpublished events, its dead letter; Cancel
//! (`Inbox::cancel`, as `postie cancel`) and Reschedule (its kept body published again
//! to `<p>.delayed` under the next revision, as a producer reschedules: the relay
//! records it, and the old copy is stale).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::IntoResponse;
use lapin::types::{AMQPValue, FieldTable};
use maud::html;

use super::action::{Action, Csrf};
use super::auth::Principal;
use super::overview::urlencode;
use super::{page, Answer, Console};
use crate::broker;
use crate::config::KeyNamespace;
use crate::headers::HEADER_PUBLISHED_AT;
use crate::topology::ROUTING_KEY;

#[derive(serde::Deserialize)]
pub(super) struct KeyQuery {
    #[serde(default)]
    key: String,
}

/// `GET /job?key=…`: its inbox row, its events, its dead letter, its actions.
pub(super) async fn job(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<KeyQuery>,
) -> Answer {
    let key = q.key.trim();
    let row = console.inbox.job_row(key).await?;
    let events = console.inbox.job_events(key).await?;
    let scan = console.settings.console.dead_letter_scan;
    // Only a dead job (or one the inbox no longer knows) has its letter looked for:
    // the look reads up to `scan` dead letters.
    let letter = match row.as_ref().map(|r| r.status.as_str()) {
        None | Some("dead") => {
            crate::dlq::inspect(&console.settings, scan, Some(key))
                .await?
                .2
        }
        Some(_) => None,
    };
    let body = html! {
        p { "Key " code { (key) } }
        @match &row {
            None => p { "No inbox row for this key (never seen, or pruned after inbox.retention)." },
            Some(row) => {
                p { "Status: " strong #status { (row.status) } " "
                    // A sent email is not un-sent; a cancelled job is cancelled.
                    @if !matches!(row.status.as_str(), "sent" | "cancelled") {
                        (page::action(&who, "/job/cancel", &[("key", key)], "Cancel"))
                    } }
                @if row.status == "scheduled" && who.role == super::auth::Role::Operate {
                    form action="/job/reschedule" method="post" {
                        input type="hidden" name="csrf" value=(who.csrf);
                        input type="hidden" name="key" value=(key);
                        label { "Due in " input name="delay" value="10m" size="6"; } " "
                        button { "Reschedule" }
                    }
                }
                (page::table(&["column", "value"], row.fields.iter().map(|(name, value)| html! {
                    tr { td { (name) } td { (value.as_deref().unwrap_or("-")) } }
                })))
                @let local = row.due_ms.map(|due| row.terms.describe(&console.settings.topology, due))
                    .unwrap_or_default();
                @if !local.is_empty() { p #local { "Due, local time and window: " (local) } }
            }
        }
        h2 { "Delivery events not yet published" }
        (page::table(&["outcome", "at (UTC)", "attempts", "reason"], events.iter().map(|e| html! {
            tr { td { (e.outcome) } td { (e.occurred_at) } td { (e.attempts) } td { (e.reason.as_deref().unwrap_or("-")) } }
        })))
        h2 { "Dead letter" }
        @match &letter {
            None => p { "None with this key in " (console.topology.dead_queue()) " (looked for when the job is dead or unknown, among the first " (scan) ")." },
            Some(l) => p { (l.summary.kind) ": " (l.summary.reason) " "
                a href=(format!("/dead/letter?key={}", urlencode(key))) { "its body and headers" } " "
                a href=(format!("/dead/replay?key={}", urlencode(key))) { "replay…" } },
        }
    };
    Ok(page::frame("Job", &who, body).into_response())
}

#[derive(serde::Deserialize)]
pub(super) struct KeyForm {
    #[serde(default)]
    csrf: String,
    key: String,
    /// Reschedule: due in this long (`90s`, `10m`).
    #[serde(default)]
    delay: String,
}

/// `POST /job/cancel`: `postie cancel KEY`.
pub(super) async fn cancel_job(
    State(console): State<Arc<Console>>,
    Action(who, form): Action<KeyForm>,
) -> Answer {
    let cancelled = console.inbox.cancel(&form.key, None).await?;
    tracing::info!(who = who.name, action = "cancel", key = %form.key, prior = %cancelled.prior_status, "console action");
    let message = format!(
        "{}: was {}, cancelled up to revision {}.",
        form.key, cancelled.prior_status, cancelled.covers
    );
    let back = format!("/job?key={}", urlencode(&form.key));
    Ok(page::done(&who, "Cancelled", &message, &back).into_response())
}

/// `POST /job/reschedule`: the scheduled job's kept body, its `revision` one past the
/// newest seen, published to `<p>.delayed` due in `delay`; the relay records the new
/// due time and the old copy, when it comes due, is stale.
pub(super) async fn reschedule(
    State(console): State<Arc<Console>>,
    Action(who, form): Action<KeyForm>,
) -> Answer {
    let back = format!("/job?key={}", urlencode(&form.key));
    let settings = &console.settings;
    let refusal = match humantime::parse_duration(form.delay.trim()) {
        _ if settings.worker.key_namespace == KeyNamespace::UserId => {
            Some("worker.key_namespace = \"user_id\": only the job's producer can publish it again")
        }
        Ok(delay) if delay <= settings.delay.max => None,
        Ok(_) => Some("that is beyond delay.max"),
        Err(_) => Some("write the delay like 90s, 10m or 2h"),
    };
    let kept = console.inbox.kept_job(&form.key).await?;
    let (Some(revision_and_body), None) = (kept, refusal) else {
        let why = refusal.unwrap_or("only a scheduled job whose body is kept can be rescheduled");
        return Ok(page::done(&who, "Not rescheduled", why, &back).into_response());
    };
    let (revision, body) = revision_and_body;
    let mut job: serde_json::Value = serde_json::from_slice(&body)?;
    job["revision"] = serde_json::json!(revision + 1);
    let delay = humantime::parse_duration(form.delay.trim())?;
    let mut headers = FieldTable::default();
    headers.insert(
        "x-delay".into(),
        AMQPValue::LongLongInt(delay.as_millis() as i64),
    );
    let now_ms = chrono::Utc::now().timestamp_millis();
    headers.insert(HEADER_PUBLISHED_AT.into(), AMQPValue::LongLongInt(now_ms));
    let conn = broker::connect(
        &settings.amqp.addresses()?,
        "postie-console",
        settings.amqp.connect_timeout,
    )
    .await?
    .connection;
    let published = async {
        let channel = broker::confirm_channel(&conn).await?;
        let properties = broker::job_properties().with_headers(headers);
        let exchange = console.topology.delayed_exchange();
        broker::publish_confirmed(
            &channel,
            exchange,
            ROUTING_KEY,
            true,
            &serde_json::to_vec(&job)?,
            properties,
        )
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = conn.close(200, "done".into()).await;
    published?;
    tracing::info!(who = who.name, action = "reschedule", key = %form.key, revision = revision + 1, "console action");
    let message = format!(
        "{}: published again as revision {}, due in {}.",
        form.key,
        revision + 1,
        form.delay.trim()
    );
    Ok(page::done(&who, "Rescheduled", &message, &back).into_response())
}

impl Csrf for KeyForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}
