//! Failover between providers (issue 29) end to end: a real RabbitMQ, a real
//! PostgreSQL and two provider test servers (tests/provider-server, real HTTP
//! processes), postie configured with `transport.providers = [primary, secondary]`.
//!
//! - the primary refusing connections in the middle of a run of jobs published
//!   evenly over twice the outage: every job sent once, by the secondary while the
//!   primary is down, and by the primary again once its prober sees it answer; the
//!   inbox records which provider sent each and its id; `/metrics` and `postie
//!   status` show each provider. The fast tier refuses for 6 s within 400 jobs over
//!   12 s; `slow_the_primary_refusing_…` (the slow tier) runs the figures
//!   docs/benchmarks.md quotes, 30 s within 2,000 jobs over 60 s (the same ~33 jobs
//!   a second);
//! - sends that hang after the request was written may have been accepted: they are
//!   retried on the primary only, even while the primary is down and everything
//!   else goes to the secondary;
//! - each provider held to its own `rate_limit=`.
//!
//! Each test prints `FIGURES` lines (run with `--nocapture`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use secrecy::SecretString;
use serde_json::{json, Value};
use support::providers::{ProviderMessage, ProviderServer};
use support::{eventually, free_port, job, message_id, run_postie, sample, TestEnv};

const WAIT: Duration = Duration::from_secs(180);

fn unix_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `url` with postie's `name=` parameter.
fn named(url: String, name: &str) -> SecretString {
    SecretString::from(format!("{url}&name={name}"))
}

/// Sent rows.
async fn sent(env: &TestEnv) -> i64 {
    let db = env.db().await;
    match db
        .query_one(
            "SELECT count(*) FROM postie_inbox WHERE status = 'sent'",
            &[],
        )
        .await
    {
        Ok(row) => row.get(0),
        Err(_) => -1,
    }
}

/// Message-ID → (provider, provider_message_id) as the inbox recorded them.
async fn recorded(env: &TestEnv) -> BTreeMap<String, (String, String)> {
    let rows = env
        .db()
        .await
        .query(
            "SELECT message_id, provider, provider_message_id FROM postie_inbox \
              WHERE status = 'sent'",
            &[],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let get = |i| r.get::<_, Option<String>>(i).unwrap_or_default();
            (get(0), (get(1), get(2)))
        })
        .collect()
}

/// Every key accepted exactly once across `servers`, and the inbox naming the
/// server (by provider name) and its id for each.
async fn assert_once_across(
    env: &TestEnv,
    keys: &[String],
    servers: &[(&str, &[ProviderMessage])],
) {
    let mut per_id: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, messages) in servers {
        for m in *messages {
            per_id.entry(m.message_id.as_str()).or_default().push(name);
        }
    }
    let expected: BTreeSet<String> = keys.iter().map(|k| message_id(k)).collect();
    let got: BTreeSet<String> = per_id.keys().map(|s| s.to_string()).collect();
    let lost: Vec<_> = expected.difference(&got).collect();
    assert!(lost.is_empty(), "never accepted: {lost:?}");
    let repeated: Vec<_> = per_id.iter().filter(|(_, by)| by.len() > 1).collect();
    assert!(repeated.is_empty(), "accepted more than once: {repeated:?}");
    let recorded = recorded(env).await;
    for (name, messages) in servers {
        for m in *messages {
            assert_eq!(
                recorded.get(&m.message_id),
                Some(&(name.to_string(), m.provider_id.clone())),
                "{}: the inbox names who sent it and the provider's id",
                m.message_id
            );
        }
    }
}

/// `/metrics` of the postie listening on `port`.
async fn metrics(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("/metrics")
        .text()
        .await
        .unwrap()
}

/// Per-second counts of `messages` from `from_ms`, as `t:n` pairs.
fn per_second(messages: &[ProviderMessage], from_ms: i64) -> BTreeMap<i64, usize> {
    let mut out = BTreeMap::new();
    for m in messages {
        *out.entry((m.received_at_ms - from_ms) / 1_000).or_default() += 1;
    }
    out
}

/// 400 jobs over 12 s, the primary refusing connections from t = 3 s for 6 s: ~33
/// jobs a second as in the slow twin; 3 s of publishing after the outage, for the
/// primary to take traffic back (its prober's backoff is at most 1 s here; with the
/// tests of a tier running side by side it took up to 1.2 s), and the breaker read 3 s
/// into the outage (five refused sends open it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_refusing_mid_run_fails_over_to_the_secondary_and_takes_traffic_back() {
    the_primary_refusing_mid_run(400, 6).await;
}

/// docs/benchmarks.md's figures: 2,000 jobs over 60 s, the primary refusing from
/// t = 15 s for 30 s (`POSTIE_FAILOVER_JOBS` and `POSTIE_FAILOVER_DOWN_S` change them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_the_primary_refusing_mid_run_fails_over_to_the_secondary_and_takes_traffic_back() {
    let n = support::bench::env_usize("POSTIE_FAILOVER_JOBS", 2_000);
    let down_s = support::bench::env_usize("POSTIE_FAILOVER_DOWN_S", 30) as u64;
    the_primary_refusing_mid_run(n, down_s).await;
}

/// `n` jobs published evenly over `2 × down_s` seconds, the primary refusing
/// connections for `down_s` seconds from a quarter of the way in.
async fn the_primary_refusing_mid_run(n: usize, down_s: u64) {
    let env = TestEnv::new("failover").await;
    let primary = ProviderServer::start().await;
    let secondary = ProviderServer::start().await;
    let providers = [
        named(primary.url("sendgrid"), "primary"),
        named(secondary.url("postmark"), "secondary"),
    ];
    let mut settings = env.settings();
    // The list instead of the harness's one transport.
    settings.transport.url = None;
    settings.transport.providers = providers.to_vec();
    let port = free_port();
    settings.http.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let serving = env.serve(settings);

    // n jobs published evenly over twice the outage; the outage in the middle.
    let run = Duration::from_secs(down_s * 2);
    let keys: Vec<String> = (0..n).map(|i| format!("fo-{i}")).collect();
    let started = Instant::now();
    let started_ms = unix_ms();
    let publish = async {
        for (i, chunk) in keys.chunks(20).enumerate() {
            let at = run.mul_f64((i * 20) as f64 / n as f64);
            tokio::time::sleep_until((started + at).into()).await;
            let bodies: Vec<Value> = chunk
                .iter()
                .map(|k| job(k, &format!("{k}@example.com")))
                .collect();
            env.publish_many(&bodies).await;
        }
    };
    let outage = async {
        tokio::time::sleep(run / 4).await;
        let down_at = unix_ms();
        primary.go_down(down_s).await;
        // The server refuses from its receipt of the request, somewhere between
        // `down_at` and now (a send it was answering meanwhile may still land); it
        // answers again `down_s` after that receipt, so not before `up_at`.
        let refusing_from = unix_ms();
        // Well into the outage: the primary's breaker is open, consumption is not
        // paused (the secondary takes the jobs).
        tokio::time::sleep(Duration::from_secs(down_s / 2)).await;
        let during = metrics(port).await;
        (down_at, refusing_from, unix_ms() - down_at, during)
    };
    let ((), (down_at, refusing_from, probed_after, during)) = tokio::join!(publish, outage);
    let up_at = down_at + down_s as i64 * 1_000;
    let envr = &env;
    eventually(&format!("{n} sent"), WAIT, || async move {
        (sent(envr).await == n as i64).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = metrics(port).await;
    serving.stop().await;

    let (p, s) = (
        primary.messages(false).await,
        secondary.messages(false).await,
    );
    assert_once_across(&env, &keys, &[("primary", &p), ("secondary", &s)]).await;
    assert_eq!(p.len() + s.len(), n);
    // Surely down: from when the request to go down was answered until `up_at`.
    let in_window =
        |m: &&ProviderMessage| m.received_at_ms >= refusing_from && m.received_at_ms < up_at;
    let primary_in_window: Vec<i64> = p
        .iter()
        .filter(in_window)
        .map(|m| m.received_at_ms - down_at)
        .collect();
    assert!(
        primary_in_window.is_empty(),
        "the primary was down (asked at t0, answered at t0+{}ms, up at t0+{}ms), yet it \
         accepted sends at t0+ these ms: {primary_in_window:?}",
        refusing_from - down_at,
        up_at - down_at
    );
    let secondary_in_window = s.iter().filter(in_window).count();
    assert!(
        secondary_in_window > 0,
        "the secondary sent while the primary was down"
    );
    // Back on the primary: after the prober saw it answer (backoff at most 1 s here),
    // nothing more goes to the secondary.
    let settled = up_at + 5_000;
    let secondary_after = s.iter().filter(|m| m.received_at_ms >= settled).count();
    let primary_after = p.iter().filter(|m| m.received_at_ms >= up_at).count();
    assert_eq!(secondary_after, 0, "the primary takes traffic back");
    assert!(
        primary_after > 0,
        "jobs published after the outage went to the primary"
    );
    let secondary_before = s.iter().filter(|m| m.received_at_ms < down_at).count();
    assert_eq!(secondary_before, 0, "nothing failed over before the outage");
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);

    let open = |text: &str, provider: &str| {
        sample(
            text,
            &format!("postie_provider_circuit_open{{provider=\"{provider}\"}}"),
        )
    };
    assert_eq!(open(&during, "primary"), Some(1.0), "{during}");
    assert_eq!(open(&during, "secondary"), Some(0.0), "{during}");
    assert_eq!(
        sample(&during, "postie_consumer_paused"),
        Some(0.0),
        "{during}"
    );
    assert_eq!(open(&after, "primary"), Some(0.0), "{after}");
    let sent_by = |text: &str, provider: &str| {
        sample(
            text,
            &format!("postie_provider_sends_total{{provider=\"{provider}\",result=\"sent\"}}"),
        )
        .unwrap_or(0.0) as usize
    };
    assert_eq!(sent_by(&after, "primary"), p.len(), "{after}");
    assert_eq!(sent_by(&after, "secondary"), s.len(), "{after}");

    // `postie status` lists both, in order, with what each sent.
    let mut vars = env.env_vars();
    vars.retain(|(k, _)| k != "POSTIE__TRANSPORT__URL");
    let list: Vec<&str> = providers
        .iter()
        .map(secrecy::ExposeSecret::expose_secret)
        .collect();
    vars.push(("POSTIE__TRANSPORT__PROVIDERS".into(), list.join(",")));
    let status = run_postie(&["status"], &vars);
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    let line = |name: &str| {
        status
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in {}", status.stdout))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(line("primary")[2], p.len().to_string(), "{}", status.stdout);
    assert_eq!(
        line("secondary")[2],
        s.len().to_string(),
        "{}",
        status.stdout
    );

    let timeline = |m: &[ProviderMessage]| {
        per_second(m, started_ms)
            .iter()
            .map(|(t, c)| format!("{t}:{c}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "FIGURES failover: {n} jobs over {}s, primary refused connections from t={}s for {down_s}s: \
         {} sent by the primary, {} by the secondary ({} while the primary was down), \
         0 lost, 0 duplicates, 0 dead; primary's breaker open at t+{}ms (metrics read), \
         last send through the secondary at t={:.1}s, first through the primary after the outage at t={:.1}s",
        run.as_secs(),
        (down_at - started_ms) / 1_000,
        p.len(),
        s.len(),
        secondary_in_window,
        probed_after,
        s.iter().map(|m| m.received_at_ms).max().map_or(0.0, |t| (t - started_ms) as f64 / 1e3),
        p.iter()
            .filter(|m| m.received_at_ms >= up_at)
            .map(|m| m.received_at_ms)
            .min()
            .map_or(0.0, |t| (t - started_ms) as f64 / 1e3),
    );
    eprintln!(
        "FIGURES failover timeline primary (s:sent): {}",
        timeline(&p)
    );
    eprintln!(
        "FIGURES failover timeline secondary (s:sent): {}",
        timeline(&s)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_hangs_after_its_request_is_retried_on_the_same_provider_only() {
    let env = TestEnv::new("failover-hang").await;
    let primary = ProviderServer::start().await;
    let secondary = ProviderServer::start().await;
    let mut settings = env.settings();
    settings.transport.url = None;
    settings.transport.providers = vec![
        named(primary.url("sendgrid"), "primary"),
        named(secondary.url("postmark"), "secondary"),
    ];
    primary
        .set_faults(json!([{"to_contains": "hang", "action": {"hang": true}, "times": 3}]))
        .await;
    let serving = env.serve(settings);
    let hung: Vec<String> = (0..3).map(|i| format!("hang-{i}")).collect();
    for key in &hung {
        env.publish(&job(key, &format!("{key}@example.com"))).await;
    }
    eventually("three sends hanging at the primary", WAIT, || async {
        (primary.stats().await.hung == 3).then_some(())
    })
    .await;
    // The primary goes down with those requests unanswered: its breaker opens and
    // the next jobs go to the secondary, but the three may have been accepted.
    primary.go_down(8).await;
    let calm: Vec<String> = (0..20).map(|i| format!("calm-{i}")).collect();
    let bodies: Vec<Value> = calm
        .iter()
        .map(|k| job(k, &format!("{k}@example.com")))
        .collect();
    env.publish_many(&bodies).await;
    let envr = &env;
    eventually("23 sent", WAIT, || async move {
        (sent(envr).await == 23).then_some(())
    })
    .await;
    serving.stop().await;

    let (p, s) = (
        primary.messages(false).await,
        secondary.messages(false).await,
    );
    let keys: Vec<String> = hung.iter().chain(&calm).cloned().collect();
    assert_once_across(&env, &keys, &[("primary", &p), ("secondary", &s)]).await;
    let by_secondary: BTreeSet<&str> = s.iter().map(|m| m.message_id.as_str()).collect();
    for key in &hung {
        assert!(
            !by_secondary.contains(message_id(key).as_str()),
            "{key} hung at the primary and was sent through the secondary"
        );
        let row = env.inbox_row(key).await.unwrap();
        assert!(row.attempts >= 2, "{key}: the hang counted an attempt");
    }
    let calm_by_secondary = calm
        .iter()
        .filter(|k| by_secondary.contains(message_id(k).as_str()))
        .count();
    assert!(
        calm_by_secondary > 0,
        "the other jobs failed over while the primary was down"
    );
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    eprintln!(
        "FIGURES failover hang: 3 sends hung at the primary, then it refused for 8 s: \
         the 3 sent once each by the primary after it came back, 0 through the secondary; \
         {calm_by_secondary}/20 other jobs failed over meanwhile; 0 duplicates, 0 dead"
    );
}

/// The most accepted within any one second (a sliding window over arrival times).
fn busiest_second(messages: &[ProviderMessage]) -> usize {
    let mut at: Vec<i64> = messages.iter().map(|m| m.received_at_ms).collect();
    at.sort_unstable();
    let mut most = 0;
    let mut start = 0;
    for end in 0..at.len() {
        while at[end] - at[start] >= 1_000 {
            start += 1;
        }
        most = most.max(end - start + 1);
    }
    most
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_provider_keeps_its_own_rate_limit() {
    let env = TestEnv::new("failover-rate").await;
    let primary = ProviderServer::start().await;
    let secondary = ProviderServer::start().await;
    let mut settings = env.settings();
    settings.transport.url = None;
    settings.transport.providers = vec![
        named(
            format!("{}&rate_limit=10/s", primary.url("sendgrid")),
            "primary",
        ),
        named(
            format!("{}&rate_limit=40/s", secondary.url("ses")),
            "secondary",
        ),
    ];
    let serving = env.serve(settings);
    let first: Vec<String> = (0..30).map(|i| format!("slow-{i}")).collect();
    let bodies: Vec<Value> = first
        .iter()
        .map(|k| job(k, &format!("{k}@example.com")))
        .collect();
    env.publish_many(&bodies).await;
    let envr = &env;
    eventually("30 sent through the primary", WAIT, || async move {
        (sent(envr).await == 30).then_some(())
    })
    .await;
    // The primary down for longer than the rest takes: the secondary at its own rate.
    primary.go_down(60).await;
    let rest: Vec<String> = (0..160).map(|i| format!("fast-{i}")).collect();
    let bodies: Vec<Value> = rest
        .iter()
        .map(|k| job(k, &format!("{k}@example.com")))
        .collect();
    env.publish_many(&bodies).await;
    eventually("190 sent", WAIT, || async move {
        (sent(envr).await == 190).then_some(())
    })
    .await;
    serving.stop().await;
    primary.come_back().await;
    let (p, s) = (
        primary.messages(false).await,
        secondary.messages(false).await,
    );
    let keys: Vec<String> = first.iter().chain(&rest).cloned().collect();
    assert_once_across(&env, &keys, &[("primary", &p), ("secondary", &s)]).await;
    assert_eq!(p.len(), 30, "the first 30 went through the primary");
    let (p_most, s_most) = (busiest_second(&p), busiest_second(&s));
    // One second's worth may go at once after an idle spell (the burst), then the pace.
    assert!(
        p_most <= 10 + 10,
        "the primary's 10/s: {p_most} in one second"
    );
    assert!(
        s_most <= 40 + 40,
        "the secondary's 40/s: {s_most} in one second"
    );
    assert!(
        s_most > 10 + 10,
        "the secondary is not held to the primary's 10/s: {s_most} in its busiest second"
    );
    let span = |m: &[ProviderMessage]| {
        let (lo, hi) = m.iter().fold((i64::MAX, i64::MIN), |(lo, hi), m| {
            (lo.min(m.received_at_ms), hi.max(m.received_at_ms))
        });
        (hi - lo) as f64 / 1e3
    };
    assert!(
        span(&p) >= 1.5,
        "30 at 10/s after a burst of 10: {}s",
        span(&p)
    );
    assert!(
        span(&s) >= 2.5,
        "160 at 40/s after a burst of 40: {}s",
        span(&s)
    );
    eprintln!(
        "FIGURES failover rates: primary rate_limit=10/s: 30 in {:.1}s, busiest second {p_most}; \
         secondary rate_limit=40/s (primary down): 160 in {:.1}s, busiest second {s_most}",
        span(&p),
        span(&s)
    );
}
