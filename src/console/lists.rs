//! The lists and their actions: pending jobs (cancel one, or all matching after a
//! confirm step with their count), and dead letters (grouped by reason; replay one, a
//! group or all matching a filter, after a confirm step with their count, through
//! `dlq::replay`). Pending jobs come a page at a time by `Inbox::pending_page`, a page
//! number from 0 to 100,000; one `Confirm` step serves both lists.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use maud::{html, Markup};

use super::action::{Action, Csrf};
use super::auth::Principal;
use super::overview::urlencode;
use super::{page, Answer, Console};
use crate::dlq::{self, ReplayFilter};
use crate::inbox::PendingFilter;

/// A list's filter, from the query string or a form.
#[derive(serde::Deserialize, Default)]
pub(super) struct ListQuery {
    #[serde(default)]
    csrf: String,
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    reason: String,
    /// The page of a list, from 0 (a number up to [`MAX_PAGE`]).
    #[serde(default)]
    page: String,
    /// The count the operator confirmed: an action moves at most this many.
    #[serde(default)]
    count: usize,
}

/// The last page a list may be asked for: with `console.page_size` at most 10,000,
/// an OFFSET of at most 10^9 rows (which PostgreSQL stops at the table's end).
const MAX_PAGE: i64 = 100_000;

/// The page number asked for (none: the first), or why it is refused.
fn page_number(text: &str) -> Result<i64, String> {
    match text.trim() {
        "" => Ok(0),
        text => text
            .parse::<i64>()
            .ok()
            .filter(|n| (0..=MAX_PAGE).contains(n))
            .ok_or_else(|| format!("page must be a whole number from 0 to {MAX_PAGE}.")),
    }
}

pub(super) fn given(text: &str) -> Option<String> {
    Some(text.trim().to_owned()).filter(|t| !t.is_empty())
}

impl ListQuery {
    fn pending_filter(&self) -> PendingFilter {
        PendingFilter {
            key: given(&self.key),
            kind: given(&self.kind),
            key_prefix: given(&self.prefix),
            ..PendingFilter::default()
        }
    }

    fn replay_filter(&self, limit: Option<usize>) -> ReplayFilter {
        ReplayFilter {
            reason_contains: given(&self.reason),
            key: given(&self.key),
            limit,
        }
    }

    /// The filter's fields as hidden inputs of a form.
    fn fields(&self) -> [(&'static str, &str); 4] {
        [
            ("type", &self.kind),
            ("prefix", &self.prefix),
            ("key", &self.key),
            ("reason", &self.reason),
        ]
    }
}

/// An action's confirm step: what matches, and a button naming how many it moves (at
/// most `console.max_batch`), which posts the filter and that count.
struct Confirm {
    matching: usize,
    action: &'static str,
    button: &'static str,
    noun: &'static str,
    back: &'static str,
}

impl Confirm {
    fn form(&self, who: &Principal, console: &Console, q: &ListQuery, described: Markup) -> Markup {
        let count = self.matching.min(console.settings.console.max_batch);
        let count_text = count.to_string();
        let mut fields = q.fields().to_vec();
        fields.push(("count", &count_text));
        let button = format!("{} {count} {}", self.button, self.noun);
        html! {
            p #count { (described) }
            @if count > 0 { p { (page::action(who, self.action, &fields, &button)) } }
            p { a href=(self.back) { "Back" } }
        }
    }
}

/// `GET /pending`: scheduled jobs by due time, filtered, one page at a time.
pub(super) async fn pending(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<ListQuery>,
) -> Answer {
    let size = console.settings.console.page_size;
    let page_no = match page_number(&q.page) {
        Ok(n) => n,
        Err(why) => {
            let refusal = page::notice("Bad request", &why);
            return Ok((StatusCode::BAD_REQUEST, refusal).into_response());
        }
    };
    let (jobs, total) = console
        .inbox
        .pending_page(&q.pending_filter(), page_no * size, size)
        .await?;
    let link = |n: i64| {
        format!(
            "/pending?type={}&prefix={}&page={n}",
            urlencode(&q.kind),
            urlencode(&q.prefix)
        )
    };
    let body = html! {
        form action="/pending" method="get" {
            label { "Type " input name="type" value=(q.kind); } " "
            label { "Key prefix " input name="prefix" value=(q.prefix); } " "
            button { "Filter" }
        }
        p #total { (total) " pending" @if total > 0 { ", " (page_no * size + 1) " to " (page_no * size + jobs.len() as i64) " shown" } }
        @if total > 0 { p { a href=(format!("/pending/cancel?type={}&prefix={}", urlencode(&q.kind), urlencode(&q.prefix))) { "Cancel all " (total) " matching…" } } }
        (page::table(&["due (UTC)", "local time, window", "key", "type", "revision", ""], jobs.iter().map(|job| {
            let due = chrono::DateTime::from_timestamp_millis(job.due_ms)
                .map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
                .unwrap_or_default();
            let local = job.terms.describe(&console.settings.topology, job.due_ms);
            html! { tr {
                td { (due) }
                td { @if local.is_empty() { "-" } @else { (local) } }
                td { a href=(format!("/job?key={}", urlencode(&job.key))) { (job.key) } }
                td { (job.kind.as_deref().unwrap_or("-")) }
                td { (job.revision) }
                td { (page::action(&who, "/job/cancel", &[("key", &job.key)], "Cancel")) }
            } }
        })))
        p {
            @if page_no > 0 { a href=(link(page_no - 1)) { "← earlier" } " " }
            @if (page_no + 1) * size < total { a href=(link(page_no + 1)) { "later →" } }
        }
    };
    Ok(page::frame("Pending jobs", &who, body).into_response())
}

/// `GET /pending/cancel`: how many jobs match, and the button that cancels them.
pub(super) async fn confirm_cancel(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<ListQuery>,
) -> Answer {
    let (_, total) = console
        .inbox
        .pending_page(&q.pending_filter(), 0, 0)
        .await?;
    let described = html! { (total) " pending job(s) match type " code { (q.kind) } " and key prefix " code { (q.prefix) } "." };
    let confirm = Confirm {
        matching: total.max(0) as usize,
        action: "/pending/cancel",
        button: "Cancel",
        noun: "job(s)",
        back: "/pending",
    };
    let body = confirm.form(&who, &console, &q, described);
    Ok(page::frame("Cancel pending jobs?", &who, body).into_response())
}

/// `POST /pending/cancel`: cancels at most the confirmed count of matching jobs.
pub(super) async fn cancel(
    State(console): State<Arc<Console>>,
    Action(who, q): Action<ListQuery>,
) -> Answer {
    let limit = q.count.min(console.settings.console.max_batch) as i64;
    let (jobs, _) = console
        .inbox
        .pending_page(&q.pending_filter(), 0, limit)
        .await?;
    for job in &jobs {
        console.inbox.cancel(&job.key, None).await?;
    }
    tracing::info!(who = who.name, action = "cancel_matching", kind = %q.kind, prefix = %q.prefix, cancelled = jobs.len(), "console action");
    let message = format!("Cancelled {} pending job(s).", jobs.len());
    Ok(page::done(&who, "Cancelled", &message, "/pending").into_response())
}

/// `GET /dead`: the dead letters grouped by reason, then each one.
pub(super) async fn dead(who: Principal, State(console): State<Arc<Console>>) -> Answer {
    let scan = console.settings.console.dead_letter_scan;
    let (depth, letters) = dlq::peek(&console.settings, scan).await?;
    let mut groups: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for l in &letters {
        *groups.entry((&l.kind, &l.reason)).or_default() += 1;
    }
    let body = html! {
        p #depth { (depth) " dead letter(s) in " (console.topology.dead_queue())
            @if letters.len() < depth as usize { "; the first " (letters.len()) " looked at" } }
        form action="/dead/replay" method="get" {
            label { "Replay those whose reason contains " input name="reason"; } " " button { "Count…" }
        }
        h2 { "By reason" }
        (page::table(&["kind", "reason", "count", ""], groups.iter().map(|((kind, reason), n)| html! {
            tr { td { (kind) } td { (reason) } td { (n) }
                 td { a href=(format!("/dead/replay?reason={}", urlencode(reason))) { "replay group…" } } }
        })))
        h2 { "Dead letters" }
        (page::table(&["key", "kind", "attempts", "dead at", "reason", ""], letters.iter().map(|l| html! {
            tr { td { a href=(format!("/dead/letter?key={}", urlencode(&l.key))) { (l.key) } }
                 td { (l.kind) } td { (l.attempts.map_or("-".into(), |n| n.to_string())) }
                 td { (l.dead_at.as_deref().unwrap_or("-")) } td { (l.reason) }
                 td { a href=(format!("/dead/replay?key={}", urlencode(&l.key))) { "replay…" } } }
        })))
    };
    Ok(page::frame("Dead letters", &who, body).into_response())
}

/// `GET /dead/letter?key=…`: one dead letter's body and headers.
pub(super) async fn letter(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<ListQuery>,
) -> Answer {
    let scan = console.settings.console.dead_letter_scan;
    let (_, _, found) = dlq::inspect(&console.settings, scan, Some(&q.key)).await?;
    let body = html! {
        @match found {
            None => p { "No dead letter with key " code { (q.key) } " among the first " (scan) "." },
            Some(l) => {
                p { "Key " code { (l.summary.key) } ": " (l.summary.kind) ", " (l.summary.reason) " "
                    a href=(format!("/dead/replay?key={}", urlencode(&l.summary.key))) { "replay…" } }
                h2 { "Headers" }
                (page::table(&["header", "value"], l.headers.iter().map(|(k, v)| html! { tr { td { (k) } td { (v) } } })))
                h2 { "Body" }
                pre #body { (l.body) }
            }
        }
    };
    Ok(page::frame("Dead letter", &who, body).into_response())
}

/// `GET /dead/replay`: how many dead letters match, and the button that replays them.
pub(super) async fn confirm_replay(
    who: Principal,
    State(console): State<Arc<Console>>,
    Query(q): Query<ListQuery>,
) -> Answer {
    let scan = console.settings.console.dead_letter_scan;
    let (_, letters) = dlq::peek(&console.settings, scan).await?;
    let filter = q.replay_filter(None);
    let matching = letters.iter().filter(|l| filter.matches(l)).count();
    let described = html! { (matching) " dead letter(s) match"
    @if !q.key.is_empty() { " key " code { (q.key) } }
    @if !q.reason.is_empty() { " reason containing " code { (q.reason) } } "." };
    let confirm = Confirm {
        matching,
        action: "/dead/replay",
        button: "Replay",
        noun: "dead letter(s)",
        back: "/dead",
    };
    let body = confirm.form(&who, &console, &q, described);
    Ok(page::frame("Replay dead letters?", &who, body).into_response())
}

/// `POST /dead/replay`: `postie dlq replay` with the filter, at most the confirmed count.
pub(super) async fn replay(
    State(console): State<Arc<Console>>,
    Action(who, q): Action<ListQuery>,
) -> Answer {
    let limit = q.count.min(console.settings.console.max_batch);
    let report = dlq::replay(&console.settings, &q.replay_filter(Some(limit))).await?;
    tracing::info!(who = who.name, action = "replay", key = %q.key, reason = %q.reason, moved = report.moved, "console action");
    let message = format!(
        "Replayed {} dead letter(s) to {}.",
        report.moved,
        console.topology.send_queue()
    );
    Ok(page::done(&who, "Replayed", &message, "/dead").into_response())
}

impl Csrf for ListQuery {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}
