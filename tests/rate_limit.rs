//! The send rate (issue #13): three `postie serve` processes against the SMTP test
//! server in quota mode (40 emails/s, `454 … Throttling failure` for the rest).
//!
//! Each scenario runs twice: at 300 jobs in the fast tier (about 10 s at 30/s), and
//! at 1,200 jobs as `slow_<name>` in the slow tier (40 s at 30/s: the figures
//! docs/benchmarks.md and docs/send-rate.md quote). Bounds that depend on the size are
//! scaled with it; each says how.
//!
//! Each test prints a `FIGURES` line (run with `--nocapture`): emails sent, seconds
//! against the quota's minimum, the busiest 1,000 ms, throttle replies, dead letters,
//! and the limiter's PostgreSQL statements per email. Timing is reported, and only
//! asserted with generous bounds: timing goals belong in benchmarks. The scenarios
//! measure send timing, each with three processes, and `three_limiters_…` counts
//! tokens in 3 s: they must not run beside other heavy tests (declared in
//! `.config/nextest.toml`), so that another test's start-up is not their jitter on a
//! 2-core machine.
//!
//! Also here, the other limit a provider sets: `transport.pool_size` caps the connections.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use support::sink::busiest_window;
use support::{free_port, job, message_id, PostieProcess, TestEnv};

/// The full size (`slow_…`): 40 s at 30/s.
const FULL: usize = 1_200;
/// The fast tier's size: 10 s at 30/s, still well past the limiter's start-up.
const FAST: usize = 300;
const QUOTA: u32 = 40;

struct Run {
    // Fields drop in this order: the instances must be gone before the env deletes
    // the topology, or a running instance reconnects and declares it again.
    instances: Vec<(PostieProcess, u16)>,
    env: TestEnv,
    started: Instant,
    keys: Vec<String>,
}

async fn start(name: &str, jobs: usize, limit: Option<&str>) -> Run {
    let env = TestEnv::new(name).await;
    env.sink.set_quota(Some(QUOTA)).await;
    let keys: Vec<String> = (0..jobs).map(|i| format!("{name}-{i}")).collect();
    let bodies: Vec<_> = keys.iter().map(|k| job(k, "r@example.com")).collect();
    env.publish_many(&bodies).await;
    let started = Instant::now();
    let instances = (0..3)
        .map(|_| {
            let port = free_port();
            let listen = format!("127.0.0.1:{port}");
            let mut extra = vec![("POSTIE__HTTP__LISTEN", listen.as_str())];
            if let Some(limit) = limit {
                extra.push(("POSTIE__TRANSPORT__RATE_LIMIT", limit));
            }
            (env.spawn_process(&extra), port)
        })
        .collect();
    Run {
        env,
        instances,
        started,
        keys,
    }
}

/// The samples of `name` (any labels) summed, in a Prometheus text exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let labels = series.strip_prefix(name)?;
            (labels.is_empty() || labels.starts_with('{')).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// `name` summed over the instances still running.
async fn metric_sum(run: &Run, name: &str) -> f64 {
    let mut sum = 0.0;
    for (_, port) in &run.instances {
        if let Ok(response) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
            if let Ok(text) = response.text().await {
                sum += sample(&text, name);
            }
        }
    }
    sum
}

struct Figures {
    seconds: f64,
    busiest: usize,
    /// The busiest 1,000 ms after the first 3 s (start-up: connections, caches).
    steady: usize,
    throttled: u64,
    attempts: u64,
    dead: u32,
    leases: f64,
    /// Tokens left unused to pay back sends a stall pushed together.
    paid_back: f64,
    sent: usize,
}

async fn finish(run: &Run, what: &str, within: Duration) -> Figures {
    let env = &run.env;
    let survivor = &run.instances.last().unwrap().0;
    env.emails_or_log(survivor, what, run.keys.len(), within)
        .await;
    let seconds = run.started.elapsed().as_secs_f64();
    let messages = env.sink.messages(false).await;
    let quota = env.sink.quota().await;
    let received = env.emails_per_id().await;
    let expected: BTreeSet<String> = run.keys.iter().map(|k| message_id(k)).collect();
    assert_eq!(
        received.keys().cloned().collect::<BTreeSet<_>>(),
        expected,
        "lost or unexpected emails"
    );
    let mut times: Vec<i64> = messages.iter().map(|m| m.received_at_ms).collect();
    times.sort_unstable();
    if let Some(&first) = times.first() {
        let per_second: Vec<usize> = (0..8)
            .map(|s| {
                let from = first + s * 1_000;
                times
                    .iter()
                    .filter(|t| (from..from + 1_000).contains(*t))
                    .count()
            })
            .collect();
        eprintln!("SENDS per second from the first send: {per_second:?}");
    }
    Figures {
        seconds,
        busiest: busiest_window(&messages),
        steady: {
            let first = messages.iter().map(|m| m.received_at_ms).min().unwrap_or(0);
            let later: Vec<_> = messages
                .iter()
                .filter(|m| m.received_at_ms > first + 3_000)
                .cloned()
                .collect();
            busiest_window(&later)
        },
        throttled: quota.throttled,
        attempts: quota.accepted + quota.throttled,
        dead: env.depth(env.topology.dead_queue()).await,
        leases: metric_sum(run, "postie_rate_limit_leases_total").await,
        paid_back: metric_sum(run, "postie_rate_limit_tokens_paid_back_total").await,
        sent: received.len(),
    }
}

fn report(scenario: &str, jobs: usize, minimum: f64, f: &Figures) {
    eprintln!(
        "FIGURES {scenario}: sent {}/{jobs} in {:.1}s (minimum {minimum:.0}s, {:.2}x); busiest 1000ms {} (after the first 3 s: {}); throttle replies {} of {} SMTP attempts ({:.2}%); dead {}; limiter statements {} ({:.3} per email); tokens paid back {}",
        f.sent,
        f.seconds,
        f.seconds / minimum,
        f.busiest,
        f.steady,
        f.throttled,
        f.attempts,
        100.0 * f.throttled as f64 / f.attempts.max(1) as f64,
        f.dead,
        f.leases,
        f.leases / f.sent.max(1) as f64,
        f.paid_back,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_limit_under_the_quota_is_never_throttled() {
    fleet_limit(FAST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_fleet_limit_under_the_quota_is_never_throttled() {
    fleet_limit(FULL).await;
}

/// `jobs` at a fleet limit of 30/s under the quota of 40/s.
async fn fleet_limit(jobs: usize) {
    let run = start("rl-limit", jobs, Some("30/s")).await;
    let f = finish(&run, "every job sent at 30/s", Duration::from_secs(240)).await;
    report("limit 30/s, quota 40/s", jobs, jobs as f64 / 30.0, &f);
    assert_eq!(f.dead, 0, "dead-lettered");
    // The limiter spaces tokens 1/30 s apart, fleet-wide, so the run cannot be shorter
    // than `jobs` tokens at 30/s (less the first token of each of the 3 instances):
    // 39.9 s for 1,200, 9.9 s for 300.
    assert!(
        f.seconds >= (jobs as f64 - 3.0) / 30.0,
        "sent {jobs} in {:.1}s: faster than 30/s",
        f.seconds
    );
    // Tokens are taken before the claim, so the claim's commit and the SMTP exchange
    // after it add their jitter at the sink: sends that a stall pushed together arrive
    // together. What must hold is the quota: never more than it in any 1,000 ms, so
    // the relay never throttles. How close the sink's busiest second stays to 30 is a
    // timing figure, printed on the FIGURES line above (32-36 on a 2-core machine,
    // against RabbitMQ 3.10 and 4.3 alike, before and after issue 28) and measured
    // by the benchmark, not asserted here: it flaked on an idle machine.
    assert!(
        f.steady <= QUOTA as usize && f.busiest <= QUOTA as usize,
        "busiest 1000 ms: {} sends (after the first 3 s: {}), quota {QUOTA}",
        f.busiest,
        f.steady
    );
    assert!(
        (f.throttled as f64) < 0.01 * f.attempts as f64,
        "{} throttle replies of {} attempts",
        f.throttled,
        f.attempts
    );
    // One statement per slice of 3 tokens (30/s × 100 ms): a third of the tokens taken.
    assert!(
        f.leases > 0.0 && f.leases <= (jobs as f64 + f.paid_back) / 3.0 + 10.0,
        "{}",
        f.leases
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_limit_the_fleet_converges_on_the_quota() {
    no_limit(FAST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_with_no_limit_the_fleet_converges_on_the_quota() {
    no_limit(FULL).await;
}

/// `jobs` with no limit against the quota of 40/s: the adaptive cap finds it.
async fn no_limit(jobs: usize) {
    let run = start("rl-adapt", jobs, None).await;
    let f = finish(&run, "every job sent", Duration::from_secs(240)).await;
    let minimum = jobs as f64 / f64::from(QUOTA);
    report("no limit, quota 40/s", jobs, minimum, &f);
    assert_eq!(f.dead, 0, "dead-lettered");
    assert!(f.throttled > 0, "the quota never bit");
    // Throttling counted no attempt: no retry (which is what sets postie-attempt), and
    // every inbox row records its one accepted SMTP attempt.
    assert_eq!(metric_sum(&run, "postie_retries_total").await, 0.0);
    assert_eq!(
        run.env
            .inbox_count("status = 'sent' AND attempts = 1")
            .await,
        jobs as i64
    );
    assert!(
        metric_sum(&run, "postie_smtp_throttle_replies_total").await > 0.0,
        "throttles counted"
    );
    // Converged: within 6 times the quota's minimum (180 s for 1,200 jobs, whose
    // minimum is 30 s; 45 s for 300).
    assert!(
        f.seconds < 6.0 * minimum,
        "took {:.1}s (minimum {minimum:.1}s)",
        f.seconds
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_strands_at_most_one_slice() {
    killed_instance(FAST, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_killed_instance_strands_at_most_one_slice() {
    killed_instance(FULL, Duration::from_secs(10)).await;
}

/// `jobs` at 30/s on 3 instances, one killed with `kill -9` once a third are sent; the
/// survivors' pace is counted over `window` after the kill, which the two thirds left
/// must outlast at 30/s (800 jobs, 26.7 s, for a 10 s window; 200, 6.7 s, for 5 s).
async fn killed_instance(jobs: usize, window: Duration) {
    assert!(
        window.as_secs_f64() * 30.0 < (jobs * 2 / 3) as f64,
        "{jobs} jobs do not outlast a window of {window:?} after the kill"
    );
    let mut run = start("rl-kill", jobs, Some("30/s")).await;
    let env = &run.env;
    env.wait_for_emails("a third sent", jobs / 3, Duration::from_secs(120))
        .await;
    run.instances[0].0.kill9();
    let killed_ms = chrono::Utc::now().timestamp_millis();
    let f = finish(
        &run,
        "every job sent after the kill",
        Duration::from_secs(240),
    )
    .await;
    report(
        "limit 30/s, quota 40/s, kill -9 of one of 3",
        jobs,
        jobs as f64 / 30.0,
        &f,
    );
    let messages = run.env.sink.messages(false).await;
    // The survivors' pace over the `window` after the kill (the dead one's unacked
    // deliveries come back to them; its claims wait out the 5 s lease).
    let window_ms = window.as_millis() as i64;
    let after: Vec<i64> = messages
        .iter()
        .map(|m| m.received_at_ms - killed_ms)
        .filter(|t| (0..window_ms).contains(t))
        .collect();
    let mut arrivals: Vec<i64> = messages.iter().map(|m| m.received_at_ms).collect();
    arrivals.sort_unstable();
    let gap = arrivals
        .windows(2)
        .filter(|w| w[1] >= killed_ms - 1_000 && w[0] <= killed_ms + 1_000)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or(0);
    eprintln!(
        "FIGURES kill: {} sends in the {:.0} s after the kill ({:.1}/s); longest gap between sends around the kill {gap} ms (one slice = 100 ms)",
        after.len(),
        window.as_secs_f64(),
        after.len() as f64 / window.as_secs_f64()
    );
    assert_eq!(f.dead, 0, "dead-lettered");
    // Start-up bunching as in the first test; never over the quota.
    assert!(
        f.busiest <= QUOTA as usize,
        "busiest 1000 ms: {} sends",
        f.busiest
    );
    // The survivors lost at most 2 s of the fleet's 30/s over the window (one slice
    // is 100 ms): 240 in 10 s at full size, 90 in 5 s in the fast run. The stall
    // allowed is the same at both sizes (what the kill costs does not grow with the
    // window), so a stall of more than 2 s fails both.
    let floor = (30.0 * window.as_secs_f64()) as usize - 60;
    assert!(
        after.len() >= floor,
        "the fleet slowed to {} in {:.0} s (at least {floor})",
        after.len(),
        window.as_secs_f64()
    );
}

/// The limiter alone against PostgreSQL: three limiters (three instances) with 20
/// waiting jobs each take tokens for 3 s at `rate`; counts tokens and statements.
async fn limiter_alone(rate: &str, per_second: f64) -> (usize, u64) {
    use postie::testing::inbox::Inbox;
    use postie::testing::ops::metrics::Metrics;
    use postie::testing::work::Limiter;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let env = TestEnv::new("rl-unit").await;
    let mut settings = env.settings();
    settings.transport.rate_limit = Some(postie::config::SendRate::parse(rate).unwrap());
    let inbox = Inbox::connect(&settings.database).await.unwrap();
    inbox.migrate().await.unwrap();
    let taken = Arc::new(AtomicUsize::new(0));
    let metrics: Vec<_> = (0..3).map(|_| Arc::new(Metrics::new())).collect();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for m in &metrics {
        let limiter = Limiter::new(
            settings.transport.rate_limit,
            settings.transport.rate_burst,
            inbox.clone(),
            "unit",
            m.clone(),
            true,
        );
        for _ in 0..20 {
            let (limiter, taken) = (limiter.clone(), taken.clone());
            tasks.push(tokio::spawn(async move {
                while started.elapsed() < Duration::from_secs(3) {
                    limiter.pace().await;
                    let _turn = limiter.fleet_token().await.unwrap();
                    if started.elapsed() < Duration::from_secs(3) {
                        taken.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    tokio::time::sleep_until((started + Duration::from_secs(3)).into()).await;
    let leases: u64 = metrics.iter().map(|m| m.rate.leases.get()).sum();
    for t in tasks {
        t.await.unwrap();
    }
    let n = taken.load(Ordering::Relaxed);
    eprintln!(
        "FIGURES limiter alone at {rate}: {n} tokens in 3 s (expected {:.0}), {leases} statements ({:.4} per token)",
        per_second * 3.0,
        leases as f64 / n.max(1) as f64
    );
    (n, leases)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_limiters_share_one_rate_through_postgresql() {
    let (n, leases) = limiter_alone("30/s", 30.0).await;
    assert!((80..=100).contains(&n), "{n} tokens");
    assert!(leases as usize <= n / 3 + 4, "{leases} statements");
    let (n, leases) = limiter_alone("2000/s", 2000.0).await;
    assert!((5_000..=6_300).contains(&n), "{n} tokens");
    // Slices of up to 200: at least 150 tokens a statement on average. (A busy
    // machine takes fewer tokens in the 3 s than the slices reserved: 5,463 tokens
    // in 32 statements once, while CI ran beside other builds.)
    assert!(leases as usize <= n / 150 + 4, "{leases} statements");
}

/// `transport.pool_size` is the most connections an instance opens to the relay, whatever
/// `worker.concurrency` (providers cap concurrent connections). lettre's pool caps
/// only its idle connections: without postie's own cap, 16 sends at once to a slow
/// relay opened 16 connections here, and every send beyond the idle cap opened and
/// closed one of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_pool_size_caps_the_connections_to_the_relay() {
    const SENDS: usize = 24;
    let env = TestEnv::new("smtpcap").await;
    // Every email takes 150 ms to be accepted, so that sends overlap.
    env.sink
        .set_faults(serde_json::json!([{"stage": "data_end", "action": {"delay_ms": 150}}]))
        .await;
    let mut settings = env.settings();
    settings.transport.pool_size = 2;
    settings.worker.concurrency = 16;
    let serving = env.serve(settings);
    let bodies: Vec<_> = (0..SENDS)
        .map(|i| job(&format!("cap-{i}"), "r@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let env = &env;
    support::eventually("every email", Duration::from_secs(60), move || async move {
        (env.sink.count().await >= SENDS).then_some(())
    })
    .await;
    serving.stop().await;
    let stats = env.sink.stats().await;
    assert_eq!(stats.accepted as usize, SENDS);
    assert!(
        (1..=2).contains(&stats.connections),
        "{} connections for transport.pool_size = 2",
        stats.connections
    );
}
