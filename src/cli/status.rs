//! `postie status`: inbox counts by status and the depth of every queue.

use crate::broker;
use crate::config::{SendRate, Settings};
use crate::inbox::{Inbox, RecentSends};

/// Arguments of `postie status`.
#[derive(clap::Args)]
pub struct StatusArgs {
    /// List every ladder queue, also the empty ones (by default one line counts them).
    #[arg(long)]
    all: bool,
}

/// Prints inbox counts by status and the depth of every queue.
pub(super) async fn run(settings: &Settings, args: &StatusArgs) -> anyhow::Result<()> {
    let inbox = Inbox::connect(&settings.database).await?;
    let unapplied = inbox.unapplied_migrations().await?;
    if let Some(first) = unapplied.first() {
        anyhow::bail!(
            "the database is not migrated: {} of postie's migrations not applied (from {first}); \
             run `postie migrate`",
            unapplied.len()
        );
    }
    let counts = inbox.counts().await?;
    out!("inbox:");
    for (status, count) in &counts.by_status {
        out!("  {:<10} {count}", status.as_str());
    }
    out!("  duplicates suppressed: {}", counts.duplicates);
    out!("  leases taken over:     {}", counts.takeovers);
    let recent = inbox.recent_sends().await?;
    transports(settings, &recent)?;
    rates(settings, &inbox).await?;
    lanes(settings, &inbox, &recent).await?;
    super::outbox::status(settings).await?;

    let topology = broker::resolve_topology(settings).await?;
    out!("delay mode: {}", topology.mode_name());
    let conn = broker::connect(
        &settings.amqp.addresses()?,
        "postie-status",
        settings.amqp.connect_timeout,
    )
    .await
    .map(|c| c.connection)?;
    out!("queues (ready messages, consumers):");
    let ladder = topology.ladder_queues();
    let mut empty_levels = 0;
    for (queue, depth) in broker::queue_depths(&conn, &topology.queues()).await? {
        match depth {
            // A ladder level with nothing waiting: counted, not listed, unless --all.
            Some((0, 0)) if !args.all && ladder.contains(&queue) => empty_levels += 1,
            Some((ready, consumers)) => out!("  {queue:<24} {ready:>8} {consumers:>4}"),
            None => out!("  {queue:<24} (missing: run `postie topology`)"),
        }
    }
    if empty_levels > 0 {
        out!(
            "  and {empty_levels} of the {} ladder queues empty (`postie status --all` lists them)",
            ladder.len()
        );
    }
    dead_check(settings, &conn, &topology).await?;
    for old in &settings.topology.drain_prefixes {
        drain_check(settings, &conn, old).await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// With lanes configured: each lane's sends and lateness over the last minute (its
/// queues' depths are among the queues below), and the tenants furthest ahead.
async fn lanes(settings: &Settings, inbox: &Inbox, recent: &RecentSends) -> anyhow::Result<()> {
    let topology = &settings.topology;
    if topology.lanes.is_empty() {
        return Ok(());
    }
    out!("lanes (last minute, rows the relay recorded: sent, lateness p50 and p99):");
    let sends = recent.by_lane();
    for (name, lane) in topology.lane_list() {
        let row = sends.iter().find(|s| {
            s.lane.as_deref() == Some(name.as_str())
                || (s.lane.is_none() && name == topology.default_lane)
        });
        let (sent, p50, p99) =
            row.map_or((0, 0.0, 0.0), |s| (s.sent, s.lateness_p50, s.lateness_p99));
        out!(
            "  {name:<16} weight {:>4}  sent {sent:>6}  lateness {p50:>7.2} s {p99:>7.2} s",
            lane.weight
        );
    }
    let busiest = inbox.busiest_tenants(5).await?;
    if !busiest.is_empty() {
        out!("busiest tenants (their next slot, ahead of now):");
        for t in busiest {
            out!(
                "  {:<16} {:<24} {:>8.1} s",
                t.lane,
                t.tenant,
                t.ahead_seconds
            );
        }
    }
    Ok(())
}

/// Bounces and complaints per email sent, per job type, over the last hour and day;
/// `!` marks a rate over its warning threshold.
async fn rates(settings: &Settings, inbox: &Inbox) -> anyhow::Result<()> {
    let rates = inbox.rates().await?;
    let s = &settings.suppression;
    out!(
        "bounce and complaint rates by job type (last hour, last day; ! over {:.2} % bounces or {:.2} % complaints):",
        s.bounce_rate_warning * 100.0,
        s.complaint_rate_warning * 100.0
    );
    if rates.is_empty() {
        out!("  (nothing sent in the last day)");
    }
    out!(
        "  {:<20} {:>8} {:>8}  {:>17} {:>17}  {:>17} {:>17}",
        "type",
        "sent 1h",
        "sent 1d",
        "bounces 1h",
        "bounces 1d",
        "complaints 1h",
        "complaints 1d"
    );
    for r in &rates {
        let cell = |count: [i64; 2], w: usize, limit: f64| match r.rate(count, w) {
            None => format!("{} (-)", count[w]),
            Some(rate) => {
                let over = r.over(rate, w, limit, s.rate_min_sends);
                format!(
                    "{} ({:.2} %{})",
                    count[w],
                    rate * 100.0,
                    if over { "!" } else { "" }
                )
            }
        };
        let kind = if r.kind.is_empty() { "(none)" } else { &r.kind };
        out!(
            "  {kind:<20} {:>8} {:>8}  {:>17} {:>17}  {:>17} {:>17}",
            r.sent[0],
            r.sent[1],
            cell(r.bounces, 0, s.bounce_rate_warning),
            cell(r.bounces, 1, s.bounce_rate_warning),
            cell(r.complaints, 0, s.complaint_rate_warning),
            cell(r.complaints, 1, s.complaint_rate_warning),
        );
    }
    Ok(())
}

/// The fleet's send rate, then each transport in order of preference with its sends
/// over the last minute and hour and its limit.
fn transports(settings: &Settings, recent: &RecentSends) -> anyhow::Result<()> {
    let plans = settings.provider_plans()?;
    let limit = |rate: Option<SendRate>| rate.map_or("none".to_string(), |r| r.to_string());
    let last_minute = recent.last_minute();
    out!(
        "send rate: {last_minute} sent in the last 60 s ({:.1}/s); limit {}",
        last_minute as f64 / 60.0,
        match plans.as_slice() {
            [one] => limit(one.rate_limit),
            _ => "per transport".into(),
        }
    );
    let sends = recent.by_provider();
    out!("transports, in order of preference (sent in the last 60 s, last hour; limit):");
    for plan in &plans {
        let sent = sends
            .iter()
            .find(|s| s.provider.as_deref() == Some(plan.name.as_str()));
        out!(
            "  {:<16} {:>8} {:>8}   {}",
            plan.name,
            sent.map_or(0, |s| s.last_minute),
            sent.map_or(0, |s| s.last_hour),
            limit(plan.rate_limit)
        );
    }
    for other in sends.iter().filter(|s| {
        !plans
            .iter()
            .any(|p| s.provider.as_deref() == Some(p.name.as_str()))
    }) {
        out!(
            "  {:<16} {:>8} {:>8}   (not configured here{})",
            other.provider.as_deref().unwrap_or("(unrecorded)"),
            other.last_minute,
            other.last_hour,
            if other.provider.is_none() {
                ": sent by an older postie"
            } else {
                ""
            }
        );
    }
    out!("  each instance's breakers: postie_provider_circuit_open on /metrics");
    Ok(())
}

/// Whether `<p>.dead` keeps its letters however often they are looked at
/// (`broker::dead`): its own delivery limit, else a policy's (read from the
/// management API when `amqp.management_url` is set), else a warning with the fix.
async fn dead_check(
    settings: &Settings,
    conn: &lapin::Connection,
    topology: &broker::Topology,
) -> anyhow::Result<()> {
    let queue = topology.dead_queue();
    let protected = |how: String| {
        out!("dead letters: {queue} has delivery limit {how}: looking cannot drop a letter");
    };
    match broker::dead_limit(conn, topology).await? {
        broker::DeadLimit::Missing => {}
        broker::DeadLimit::Declared => protected(format!(
            "{} (x-delivery-limit)",
            crate::topology::DEAD_DELIVERY_LIMIT
        )),
        broker::DeadLimit::Unknown(detail) => out!(
            "dead letters: WARNING: the delivery limit of {queue} could not be checked ({detail})"
        ),
        broker::DeadLimit::Lacking => {
            let policy = match &settings.amqp.management_url {
                Some(base) => {
                    broker::management::queue_policy(
                        base,
                        &vhost(settings),
                        queue,
                        settings.amqp.connect_timeout,
                    )
                    .await?
                }
                None => None,
            };
            match policy {
                Some(p) if p.delivery_limit.is_some_and(broker::dead::limit_protects) => {
                    protected(format!(
                        "{} (policy {})",
                        p.delivery_limit.unwrap_or_default(),
                        p.name
                    ))
                }
                _ => {
                    out!(
                        "dead letters: WARNING: {}",
                        broker::dead::unprotected_warning(queue)
                    );
                    if settings.amqp.management_url.is_none() {
                        out!("  (a policy is not looked for without amqp.management_url)");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The vhost of `amqp.url`'s first address, as it stands in the URL.
fn vhost(settings: &Settings) -> String {
    crate::endpoint::split_urls(secrecy::ExposeSecret::expose_secret(&settings.amqp.url))
        .first()
        .map(|u| broker::management::vhost_of(u))
        .unwrap_or_default()
}

/// What a drained prefix (`topology.drain_prefixes`) still holds, and whether it is
/// safe to turn the delayed-message plugin off for it: nothing ready in `<old>.send`
/// and nothing held by the plugin for `<old>.delayed`.
async fn drain_check(
    settings: &Settings,
    conn: &lapin::Connection,
    old: &str,
) -> anyhow::Result<()> {
    out!("draining {old:?} (topology.drain_prefixes):");
    let queue = format!("{old}.send");
    let ready = match broker::queue_state(conn, &queue).await? {
        Some(q) => {
            out!("  {queue:<24} {:>8} {:>4}", q.ready, q.consumers);
            q.ready
        }
        None => {
            out!("  {queue:<24} (gone)");
            0
        }
    };
    let exchange = format!("{old}.delayed");
    let held = match &settings.amqp.management_url {
        None => {
            out!(
                "  {exchange:<24} messages held by the plugin: unknown (set amqp.management_url, \
                 or read \"messages delayed\" on the exchange's page in the management UI)"
            );
            None
        }
        Some(base) => {
            let info = broker::management::exchange_info(
                base,
                &vhost(settings),
                &exchange,
                settings.amqp.connect_timeout,
            )
            .await?;
            match info {
                None => {
                    out!("  {exchange:<24} (gone)");
                    Some(0)
                }
                Some(info) => {
                    let held = info.messages_delayed.unwrap_or(0);
                    out!("  {exchange:<24} {}: {held} messages held", info.kind);
                    Some(held)
                }
            }
        }
    };
    out!("  {}", drain_verdict(old, ready, held));
    Ok(())
}

/// The line that says whether `old` is drained.
fn drain_verdict(old: &str, ready: u32, held: Option<u64>) -> String {
    match held {
        Some(0) if ready == 0 => format!(
            "drained: safe to disable the delayed-message plugin and delete {old}.* \
             (once no producer publishes to {old}.delayed)"
        ),
        Some(held) => format!(
            "not drained: {held} held by the plugin, {ready} ready in {old}.send; keep consuming"
        ),
        None => format!(
            "not known to be drained: {ready} ready in {old}.send, the plugin's count unknown"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::drain_verdict;

    #[test]
    fn drained_only_when_both_the_queue_and_the_plugin_are_empty() {
        assert!(drain_verdict("old", 0, Some(0)).starts_with("drained: safe"));
        assert!(drain_verdict("old", 3, Some(0)).starts_with("not drained"));
        assert!(drain_verdict("old", 0, Some(7)).contains("7 held by the plugin"));
        assert!(drain_verdict("old", 0, None).starts_with("not known"));
    }
}
