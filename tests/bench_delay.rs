//! Delay benchmark (ladder mode): the producers' publish rate into `<p>.delayed` (one
//! confirm at a time, and with windows of confirms in flight), the lateness of N jobs
//! with delays spread uniformly over 0–60 s (published with pipelined confirms), and
//! with P jobs pending in the ladder: how long the relay takes to park them, RabbitMQ's
//! memory per pending job, and the lateness of jobs due soon behind them.
//!
//! `make bench-delay` runs the full size (N = 10,000, P = 1,000,000, 5,000 publishes
//! per window; override with POSTIE_BENCH_JOBS / POSTIE_BENCH_PENDING /
//! POSTIE_BENCH_PUBLISH) and writes target/bench/delay.json. The smoke version below
//! runs with the tests so the harness cannot rot.

mod support;

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker::{self, DelayLayout, ROUTING_KEY};
use support::bench::{
    broker_connection, broker_memory, env_usize, message_id, publish_delayed, Lateness,
};
use support::{eventually, job, TestEnv};

/// Jobs due soon, published behind the pending backlog.
const BEHIND_JOBS: usize = 200;
/// Their delays are spread over 0 to this, ms.
const BEHIND_SPREAD_MS: i64 = 5_000;
/// The pending backlog's delay: none of it comes due during a run. Under the tests'
/// `delay.max` (10 min): the harness declares the ladder with the tests' settings, and
/// a postie with another `delay.max` would add bindings for another number of levels.
const PENDING_DELAY_MS: i64 = 9 * 60 * 1000;

/// Bands of delay the burst's lateness is also shown by, ms (upper bounds).
const BANDS_MS: [i64; 4] = [2_000, 10_000, 30_000, i64::MAX];

struct Report {
    publish: Vec<PublishRate>,
    lateness: Lateness,
    /// The burst's lateness per band of delay (`BANDS_MS`): where it comes from.
    by_delay: Vec<(i64, i64, Lateness)>,
    spread_ms: i64,
    pending: usize,
    parked_s: f64,
    broker_mem_before: u64,
    broker_mem_pending: u64,
    behind: Lateness,
}

/// Jobs/s a producer gets into `<p>.delayed` with `window` confirms in flight.
struct PublishRate {
    window: usize,
    jobs: usize,
    per_s: f64,
}

/// Publishes `jobs` delayed jobs (9 min: none comes due) with at most `window`
/// unconfirmed at a time, as a producer would: window 1 waits for each confirm.
async fn publish_rate(env: &TestEnv, jobs: usize, window: usize) -> PublishRate {
    let conn = broker_connection("postie-bench-producer").await;
    let channel = broker::confirm_channel(&conn).await.unwrap();
    let exchange = env.topology.delayed_exchange();
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(540_000));
    let bodies: Vec<Vec<u8>> = (0..jobs)
        .map(|i| {
            job(&format!("pub{window}-{i}"), "bench@example.com")
                .to_string()
                .into_bytes()
        })
        .collect();
    let mut in_flight: VecDeque<lapin::PublisherConfirm> = VecDeque::with_capacity(window);
    let started = Instant::now();
    for body in &bodies {
        if in_flight.len() == window {
            let confirm = in_flight.pop_front().unwrap();
            assert!(confirm.await.expect("confirm").is_ack(), "nacked");
        }
        let confirm = channel
            .basic_publish(
                exchange.into(),
                ROUTING_KEY.into(),
                Default::default(),
                body,
                broker::job_properties().with_headers(headers.clone()),
            )
            .await
            .expect("publish");
        in_flight.push_back(confirm);
    }
    for confirm in in_flight {
        assert!(confirm.await.expect("confirm").is_ack(), "nacked");
    }
    let per_s = jobs as f64 / started.elapsed().as_secs_f64();
    let _ = conn.close(200, "done".into()).await;
    PublishRate {
        window,
        jobs,
        per_s,
    }
}

/// The publish rates, on a topology of their own (no postie running).
async fn publish_rates(jobs: usize) -> Vec<PublishRate> {
    let env = TestEnv::new("benchpublish").await;
    let mut rates = Vec::new();
    for window in [1, 100, 1_000] {
        rates.push(publish_rate(&env, jobs, window).await);
    }
    rates
}

async fn run(jobs: usize, pending: usize, spread_ms: i64, publishes: usize) -> Report {
    let publish = publish_rates(publishes).await;
    let env = TestEnv::new("benchdelay").await;
    let mut extra = support::bench::extra_postie_env();
    extra.push(("RUST_LOG".into(), "warn".into()));
    let postie_env: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let _postie = env.spawn_process(&postie_env);
    // Deterministic uniform spread (a fixed-step walk modulo the spread).
    let delays: Vec<i64> = (0..jobs)
        .map(|i| (i as i64 * 7_919) % (spread_ms + 1))
        .collect();
    let burst_started = Instant::now();
    let due = publish_delayed(&env, "lat", delays.iter().copied()).await;
    let published_s = burst_started.elapsed().as_secs_f64();
    let envr = &env;
    eprintln!("burst published in {published_s:.2}s");
    env.wait_for_emails(
        "every delayed job",
        jobs,
        Duration::from_secs(spread_ms as u64 / 1000 + 600),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = env.sink.messages(false).await;
    let lateness = Lateness::measure(&due, &received);
    let mut by_delay = Vec::new();
    let mut low = 0;
    for high in BANDS_MS {
        let band: BTreeMap<String, i64> = delays
            .iter()
            .enumerate()
            .filter(|(_, d)| (low..high).contains(*d))
            .map(|(i, _)| {
                let id = message_id(&format!("lat-{i}"));
                let due_ms = due[&id];
                (id, due_ms)
            })
            .collect();
        by_delay.push((low, high, Lateness::measure(&band, &received)));
        low = high;
    }

    // Memory with `pending` jobs parked in the ladder (due in 9 minutes).
    let broker_mem_before = broker_memory().await;
    let started = Instant::now();
    publish_delayed(&env, "pend", std::iter::repeat_n(PENDING_DELAY_MS, pending)).await;
    // Parked: the intake is empty and the ladder holds them all (the relay's window
    // holds up to delay.relay_prefetch of them unacked, out of the intake's count).
    let DelayLayout::Ladder(ladder) = env.topology.delay() else {
        panic!("the bench runs in ladder mode");
    };
    let levels: Vec<String> = (0..ladder.levels())
        .map(|k| env.topology.delay_level(k))
        .collect();
    let (intake, levels) = (&env.topology.intake_queue(), &levels);
    eventually(
        "the relay to park every pending job",
        Duration::from_secs(900 + pending as u64 / 500),
        move || async move {
            if envr.depth(intake).await > 0 {
                return None;
            }
            let mut parked = 0;
            for level in levels {
                parked += envr.depth(level).await as usize;
            }
            (parked >= pending).then_some(())
        },
    )
    .await;
    let parked_s = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let broker_mem_pending = broker_memory().await;
    eprintln!("parked {pending} jobs in {parked_s:.1}s");

    // Jobs due within seconds, behind the backlog.
    let before = env.sink.count().await;
    let step = BEHIND_SPREAD_MS / (BEHIND_JOBS as i64 - 1);
    let due = publish_delayed(&env, "behind", (0..BEHIND_JOBS as i64).map(|i| i * step)).await;
    env.wait_for_emails(
        "every job due behind the backlog",
        before + BEHIND_JOBS,
        Duration::from_secs(300),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let behind = Lateness::measure(&due, &env.sink.messages(false).await);
    assert!(
        started.elapsed() < Duration::from_millis(PENDING_DELAY_MS as u64),
        "the backlog came due before the jobs behind it were measured: use fewer pending jobs"
    );
    let dead = env.depth(env.topology.dead_queue()).await;
    assert_eq!(
        dead,
        0,
        "jobs were dead-lettered: {:?}",
        env.dead_reasons().await
    );
    Report {
        publish,
        lateness,
        by_delay,
        spread_ms,
        pending,
        parked_s,
        broker_mem_before,
        broker_mem_pending,
        behind,
    }
}

fn print(report: &Report) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("| producer: confirms in flight | jobs | jobs/s into postie.delayed (ladder) |");
    println!("|---:|---:|---:|");
    for p in &report.publish {
        println!("| {} | {} | {:.0} |", p.window, p.jobs, p.per_s);
    }
    println!();
    println!("| jobs | delays | lateness p50 | p99 | max | early | lost | duplicates |");
    println!("|---|---|---|---|---|---|---|---|");
    let l = &report.lateness;
    println!(
        "| {} | 0–{} s | {} ms | {} ms | {} ms | {} | {} | {} |",
        l.jobs,
        report.spread_ms / 1000,
        l.p50_ms,
        l.p99_ms,
        l.max_ms,
        l.early,
        l.lost,
        l.duplicates
    );
    println!();
    println!("| delay | jobs | lateness p50 | p99 | max | early |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (low, high, l) in &report.by_delay {
        let high = if *high == i64::MAX {
            format!("{} s", report.spread_ms / 1000)
        } else {
            format!("{} s", high / 1000)
        };
        println!(
            "| {} s – {high} | {} | {} ms | {} ms | {} ms | {} |",
            low / 1000,
            l.jobs,
            l.p50_ms,
            l.p99_ms,
            l.max_ms,
            l.early
        );
    }
    println!();
    let b = &report.behind;
    println!("| pending in ladder | parked in | broker memory before | with them pending | per pending job | {BEHIND_JOBS} jobs due in 0–{} s behind them: p50 | p99 | max | early | lost | duplicates |", BEHIND_SPREAD_MS / 1000);
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.1} s | {:.1} MiB | {:.1} MiB | {:.0} B | {} ms | {} ms | {} ms | {} | {} | {} |",
        report.pending,
        report.parked_s,
        mib(report.broker_mem_before),
        mib(report.broker_mem_pending),
        (report.broker_mem_pending as f64 - report.broker_mem_before as f64)
            / report.pending.max(1) as f64,
        b.p50_ms,
        b.p99_ms,
        b.max_ms,
        b.early,
        b.lost,
        b.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_bench_smoke() {
    let report = run(200, 2_000, 3_000, 200).await;
    print(&report);
    let l = &report.lateness;
    assert_eq!((l.early, l.lost, l.duplicates), (0, 0, 0));
    let b = &report.behind;
    assert_eq!((b.early, b.lost, b.duplicates), (0, 0, 0));
    assert!(report.publish.iter().all(|p| p.per_s > 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-delay"]
async fn delay_bench_full() {
    let jobs = env_usize("POSTIE_BENCH_JOBS", 10_000);
    let pending = env_usize("POSTIE_BENCH_PENDING", 1_000_000);
    let publishes = env_usize("POSTIE_BENCH_PUBLISH", 5_000);
    let report = run(jobs, pending, 60_000, publishes).await;
    print(&report);
    std::fs::create_dir_all("target/bench").unwrap();
    let l = &report.lateness;
    let json = serde_json::json!({
        "jobs": l.jobs, "spread_ms": report.spread_ms,
        "lateness_ms": {"p50": l.p50_ms, "p99": l.p99_ms, "max": l.max_ms},
        "early": l.early, "lost": l.lost, "duplicates": l.duplicates,
        "pending": report.pending, "parked_s": report.parked_s,
        "broker_mem_used_bytes": {"before": report.broker_mem_before, "pending": report.broker_mem_pending},
        "behind": {"jobs": report.behind.jobs, "lateness_ms": {"p50": report.behind.p50_ms, "p99": report.behind.p99_ms, "max": report.behind.max_ms},
                   "early": report.behind.early, "lost": report.behind.lost, "duplicates": report.behind.duplicates},
        "publish_per_s": report.publish.iter().map(|p| serde_json::json!({"window": p.window, "jobs": p.jobs, "per_s": p.per_s})).collect::<Vec<_>>(),
    });
    std::fs::write(
        "target/bench/delay.json",
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    assert_eq!((l.early, l.lost, l.duplicates), (0, 0, 0));
    let b = &report.behind;
    assert_eq!((b.early, b.lost, b.duplicates), (0, 0, 0));
}
