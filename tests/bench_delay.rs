//! Delay benchmark (ladder mode): lateness of N jobs with delays spread uniformly
//! over 0–60 s, and RabbitMQ's memory with P jobs pending in the ladder.
//!
//! `make bench-delay` runs the full size (N = 10,000, P = 100,000; override with
//! POSTIE_BENCH_JOBS / POSTIE_BENCH_PENDING) and writes target/bench/delay.json.
//! The smoke version below runs with the tests so the harness cannot rot.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::amqp;
use postie::delay::HEADER_PUBLISHED_AT;
use postie::job::IdempotencyKey;
use support::{eventually, job, TestEnv};

struct Report {
    jobs: usize,
    spread_ms: i64,
    p50_ms: i64,
    p99_ms: i64,
    max_ms: i64,
    early: usize,
    lost: usize,
    duplicates: usize,
    pending: usize,
    broker_mem_before: u64,
    broker_mem_pending: u64,
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn broker_memory() -> u64 {
    let nodes: serde_json::Value = reqwest::Client::new()
        .get("http://127.0.0.1:15672/api/nodes")
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .expect("management API")
        .json()
        .await
        .unwrap();
    nodes[0]["mem_used"].as_u64().unwrap_or(0)
}

/// Publishes `n` jobs with the given delays; returns the due time per Message-ID.
async fn publish(env: &TestEnv, prefix: &str, delays: impl Iterator<Item = i64>) -> BTreeMap<String, i64> {
    let mut due = BTreeMap::new();
    let mut batch = Vec::new();
    for (i, delay) in delays.enumerate() {
        let key = format!("{prefix}-{i}");
        let published = chrono::Utc::now().timestamp_millis();
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay));
        headers.insert(HEADER_PUBLISHED_AT.into(), AMQPValue::LongLongInt(published));
        batch.push((job(&key, "bench@example.com"), amqp::job_properties().with_headers(headers)));
        due.insert(IdempotencyKey::parse(&key).unwrap().message_id("postie.local"), published + delay);
        if batch.len() == 1000 {
            env.publish_many_with(&batch).await;
            batch.clear();
        }
    }
    env.publish_many_with(&batch).await;
    due
}

async fn run(jobs: usize, pending: usize, spread_ms: i64) -> Report {
    let env = TestEnv::new("benchdelay").await;
    let _postie = env.spawn_process(&[("RUST_LOG", "warn")]);
    // Deterministic uniform spread (a fixed-step walk modulo the spread).
    let delays = (0..jobs).map(|i| (i as i64 * 7_919) % (spread_ms + 1));
    let due = publish(&env, "lat", delays).await;
    let envr = &env;
    eventually("every delayed job", Duration::from_secs(spread_ms as u64 / 1000 + 600), move || async move {
        (envr.sink.count().await >= jobs).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut arrivals: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        arrivals.entry(m.message_id).or_default().push(m.received_at_ms);
    }
    let mut lateness: Vec<i64> = Vec::new();
    let (mut early, mut lost, mut duplicates) = (0, 0, 0);
    for (id, due_ms) in &due {
        match arrivals.get(id) {
            None => lost += 1,
            Some(times) => {
                duplicates += times.len() - 1;
                let late = times[0] - due_ms;
                if late < 0 {
                    early += 1;
                }
                lateness.push(late);
            }
        }
    }
    lateness.sort();
    let pct = |p: f64| lateness[((lateness.len() as f64 - 1.0) * p).round() as usize];

    // Memory with `pending` jobs parked in the ladder (due in 9 minutes).
    let broker_mem_before = broker_memory().await;
    let started = Instant::now();
    publish(&env, "pend", std::iter::repeat_n(540_000, pending)).await;
    let intake = &env.topology.intake_queue();
    eventually("the relay to park every pending job", Duration::from_secs(900), move || async move {
        (envr.depth(intake).await == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let broker_mem_pending = broker_memory().await;
    eprintln!("parked {pending} jobs in {:.1}s", started.elapsed().as_secs_f64());
    Report {
        jobs,
        spread_ms,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        max_ms: *lateness.last().unwrap(),
        early,
        lost,
        duplicates,
        pending,
        broker_mem_before,
        broker_mem_pending,
    }
}

fn print(report: &Report) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("| jobs | delays | lateness p50 | p99 | max | early | lost | duplicates |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | 0–{} s | {} ms | {} ms | {} ms | {} | {} | {} |",
        report.jobs, report.spread_ms / 1000, report.p50_ms, report.p99_ms, report.max_ms, report.early, report.lost, report.duplicates
    );
    println!();
    println!("| pending in ladder | broker memory before | with them pending |");
    println!("|---|---|---|");
    println!("| {} | {:.1} MiB | {:.1} MiB |", report.pending, mib(report.broker_mem_before), mib(report.broker_mem_pending));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_bench_smoke() {
    let report = run(200, 2_000, 3_000).await;
    print(&report);
    assert_eq!((report.early, report.lost, report.duplicates), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-delay"]
async fn delay_bench_full() {
    let jobs = env_usize("POSTIE_BENCH_JOBS", 10_000);
    let pending = env_usize("POSTIE_BENCH_PENDING", 100_000);
    let report = run(jobs, pending, 60_000).await;
    print(&report);
    std::fs::create_dir_all("target/bench").unwrap();
    let json = serde_json::json!({
        "jobs": report.jobs, "spread_ms": report.spread_ms,
        "lateness_ms": {"p50": report.p50_ms, "p99": report.p99_ms, "max": report.max_ms},
        "early": report.early, "lost": report.lost, "duplicates": report.duplicates,
        "pending": report.pending,
        "broker_mem_used_bytes": {"before": report.broker_mem_before, "pending": report.broker_mem_pending},
    });
    std::fs::write("target/bench/delay.json", serde_json::to_string_pretty(&json).unwrap()).unwrap();
    assert_eq!((report.early, report.lost, report.duplicates), (0, 0, 0));
}
