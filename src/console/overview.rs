//! The overview (inbox rows by status, each transport's sends and rate limit, each
//! instance's breakers from `postie_breakers`, queue depths by `broker::queue_depths`,
//! the maintenance leader, the last hour's sends and lateness as inline SVG) with its
//! live part.

use std::sync::Arc;

use axum::extract::State;
use axum::response::IntoResponse;
use maud::{html, Markup};

use super::auth::Principal;
use super::{page, Answer, Console};
use crate::inbox::{MinuteSends, RecentSends};

/// `GET /`: the frame around the live part, which htmx refreshes every 5 s.
pub(super) async fn overview(who: Principal, State(console): State<Arc<Console>>) -> Answer {
    let live = live_part(&console).await?;
    let body = html! {
        p.muted { "Prefix " code { (console.settings.topology.prefix) } ", delay mode "
                  (console.topology.mode_name()) ". Refreshes every 5 s (with JavaScript)." }
        (live)
    };
    Ok(page::frame("Overview", &who, body).into_response())
}

/// `GET /overview/live`: the part of the overview that refreshes.
pub(super) async fn live(_who: Principal, State(console): State<Arc<Console>>) -> Answer {
    Ok(live_part(&console).await?.into_response())
}

async fn live_part(console: &Console) -> anyhow::Result<Markup> {
    let inbox = &console.inbox;
    let counts = inbox.counts().await?;
    let leader = inbox.maintenance_leader().await?;
    let recent = inbox.recent_sends().await?;
    let sends = recent.per_minute();
    let depths = queue_depths(console).await;
    let transports = transports(console, &recent)?;
    let breakers = breakers(console).await?;
    Ok(html! {
        div #live hx-get="/overview/live" hx-trigger="every 5s" hx-swap="outerHTML" {
            h2 { "The last hour" }
            (chart(&sends))
            h2 { "Transports" }
            (transports)
            h3 { "Breakers, by instance" }
            (breakers)
            h2 { "Inbox rows by status" }
            (page::table(&["status", "rows"], counts.by_status.iter().map(|(status, n)| html! {
                tr { td { (status.as_str()) } td { (n) } }
            })))
            p { "Duplicates suppressed: " (counts.duplicates) "; leases taken over: " (counts.takeovers) }
            h2 { "Queues" }
            @match depths {
                Ok(depths) => (page::table(&["queue", "ready", "consumers"], depths.into_iter().map(|(q, d)| html! {
                    tr { td { (q) } @match d {
                        Some((ready, consumers)) => { td { (ready) } td { (consumers) } }
                        None => { td colspan="2" { "missing: run postie topology" } }
                    } }
                }))),
                Err(error) => p.danger { "The broker did not answer: " (super::scrubbed(&error)) },
            }
            h2 { "Maintenance leader" }
            @match leader {
                Some(l) => p { "PostgreSQL backend " (l.pid) " from " (l.client) ", connected since " (l.since) " UTC" },
                None => p { "No instance holds the maintenance lock." },
            }
        }
    })
}

/// Each transport in order of preference with its sends over the last minute and
/// hour (from the inbox) and its rate limit; then any other provider that sent.
fn transports(console: &Console, recent: &RecentSends) -> anyhow::Result<Markup> {
    let plans = console.settings.provider_plans()?;
    let sends = recent.by_provider();
    let sent = |name: Option<&str>| sends.iter().find(|s| s.provider.as_deref() == name);
    let others = sends.iter().filter(|s| {
        !plans
            .iter()
            .any(|p| s.provider.as_deref() == Some(p.name.as_str()))
    });
    Ok(html! {
        table {
            tr { th { "transport" } th { "sent, last 60 s" } th { "sent, last hour" } th { "rate limit" } }
            @for plan in &plans {
                @let s = sent(Some(&plan.name));
                tr { td { (plan.name) } td { (s.map_or(0, |s| s.last_minute)) } td { (s.map_or(0, |s| s.last_hour)) }
                     td { (plan.rate_limit.map_or("none".to_string(), |r| r.to_string())) } }
            }
            @for s in others {
                tr { td { (s.provider.as_deref().unwrap_or("(unrecorded)")) } td { (s.last_minute) } td { (s.last_hour) }
                     td { "not configured here" } }
            }
        }
    })
}

/// Each instance's breakers as they last wrote them (`postie_breakers`): open ones
/// first; an open row whose instance stopped stays until that instance's name
/// returns, and closed rows for a day.
async fn breakers(console: &Console) -> anyhow::Result<Markup> {
    let breakers = console.inbox.breakers().await?;
    Ok(html! {
        @if breakers.is_empty() {
            p { "No breaker has opened in the last day." }
        } @else {
            table {
                tr { th { "transport" } th { "instance" } th { "breaker" } th { "since (UTC)" } }
                @for b in &breakers {
                    tr { td { (b.provider) } td { (b.owner) }
                         td { @if b.open { strong { "open" } } @else { "closed" } } td { (b.since) } }
                }
            }
        }
    })
}

/// Each queue's depth, on a connection of its own for this page.
async fn queue_depths(console: &Console) -> anyhow::Result<Vec<crate::broker::QueueDepth>> {
    let settings = &console.settings;
    let conn = crate::broker::connect(
        &settings.amqp.addresses()?,
        "postie-console",
        settings.amqp.connect_timeout,
    )
    .await?
    .connection;
    let depths = crate::broker::queue_depths(&conn, &console.topology.queues()).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(depths?)
}

/// Two bar charts, one bar per minute of the last hour: emails sent, and their mean
/// lateness (sent minus due).
fn chart(sends: &[MinuteSends]) -> Markup {
    let total: i64 = sends.iter().map(|m| m.sent).sum();
    let max_sent = sends.iter().map(|m| m.sent).max().unwrap_or(0).max(1) as f64;
    let max_late = sends
        .iter()
        .filter_map(|m| m.lateness_s)
        .fold(0.0_f64, f64::max)
        .max(0.001);
    let bars = |value: &dyn Fn(&MinuteSends) -> f64, color: &str| {
        html! {
            @for m in sends {
                @let h = (value(m) * 56.0).clamp(0.0, 56.0);
                rect x=(format!("{}", (59 - m.ago.clamp(0, 59)) * 10)) y=(format!("{:.1}", 58.0 - h))
                     width="8" height=(format!("{h:.1}")) fill=(color) {}
            }
        }
    };
    html! {
        p { (total) " sent in the last hour; at most " (max_sent as i64) " in one minute." }
        svg width="600" height="60" viewBox="0 0 600 60" role="img" aria-label="emails sent per minute" {
            rect width="600" height="60" fill="#f4f6fa" {}
            (bars(&|m| m.sent as f64 / max_sent, "#3465a4"))
        }
        p { "Mean lateness (sent minus due) per minute; at most " (format!("{max_late:.3}")) " s." }
        svg width="600" height="60" viewBox="0 0 600 60" role="img" aria-label="mean lateness per minute" {
            rect width="600" height="60" fill="#f4f6fa" {}
            (bars(&|m| m.lateness_s.unwrap_or(0.0) / max_late, "#c17d11"))
        }
    }
}

/// `text` as a URL query value.
pub(super) fn urlencode(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}
