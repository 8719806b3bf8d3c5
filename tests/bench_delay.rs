//! Delay benchmark (ladder mode): lateness of N jobs with delays spread uniformly
//! over 0–60 s, and RabbitMQ's memory with P jobs pending in the ladder.
//!
//! `make bench-delay` runs the full size (N = 10,000, P = 100,000; override with
//! POSTIE_BENCH_JOBS / POSTIE_BENCH_PENDING) and writes target/bench/delay.json.
//! The smoke version below runs with the tests so the harness cannot rot.

mod support;

use std::time::{Duration, Instant};

use support::bench::{broker_memory, env_usize, publish_delayed, Lateness};
use support::{eventually, TestEnv};

struct Report {
    lateness: Lateness,
    spread_ms: i64,
    pending: usize,
    broker_mem_before: u64,
    broker_mem_pending: u64,
}

async fn run(jobs: usize, pending: usize, spread_ms: i64) -> Report {
    let env = TestEnv::new("benchdelay").await;
    let mut extra = support::bench::extra_postie_env();
    extra.push(("RUST_LOG".into(), "warn".into()));
    let postie_env: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let _postie = env.spawn_process(&postie_env);
    // Deterministic uniform spread (a fixed-step walk modulo the spread).
    let delays = (0..jobs).map(|i| (i as i64 * 7_919) % (spread_ms + 1));
    let due = publish_delayed(&env, "lat", delays).await;
    let envr = &env;
    env.wait_for_emails(
        "every delayed job",
        jobs,
        Duration::from_secs(spread_ms as u64 / 1000 + 600),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lateness = Lateness::measure(&due, &env.sink.messages(false).await);

    // Memory with `pending` jobs parked in the ladder (due in 9 minutes).
    let broker_mem_before = broker_memory().await;
    let started = Instant::now();
    publish_delayed(&env, "pend", std::iter::repeat_n(540_000, pending)).await;
    let intake = &env.topology.intake_queue();
    eventually(
        "the relay to park every pending job",
        Duration::from_secs(900),
        move || async move { (envr.depth(intake).await == 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let broker_mem_pending = broker_memory().await;
    eprintln!(
        "parked {pending} jobs in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Report {
        lateness,
        spread_ms,
        pending,
        broker_mem_before,
        broker_mem_pending,
    }
}

fn print(report: &Report) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
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
    println!("| pending in ladder | broker memory before | with them pending |");
    println!("|---|---|---|");
    println!(
        "| {} | {:.1} MiB | {:.1} MiB |",
        report.pending,
        mib(report.broker_mem_before),
        mib(report.broker_mem_pending)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_bench_smoke() {
    let report = run(200, 2_000, 3_000).await;
    print(&report);
    let l = &report.lateness;
    assert_eq!((l.early, l.lost, l.duplicates), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-delay"]
async fn delay_bench_full() {
    let jobs = env_usize("POSTIE_BENCH_JOBS", 10_000);
    let pending = env_usize("POSTIE_BENCH_PENDING", 100_000);
    let report = run(jobs, pending, 60_000).await;
    print(&report);
    std::fs::create_dir_all("target/bench").unwrap();
    let l = &report.lateness;
    let json = serde_json::json!({
        "jobs": l.jobs, "spread_ms": report.spread_ms,
        "lateness_ms": {"p50": l.p50_ms, "p99": l.p99_ms, "max": l.max_ms},
        "early": l.early, "lost": l.lost, "duplicates": l.duplicates,
        "pending": report.pending,
        "broker_mem_used_bytes": {"before": report.broker_mem_before, "pending": report.broker_mem_pending},
    });
    std::fs::write(
        "target/bench/delay.json",
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    assert_eq!((l.early, l.lost, l.duplicates), (0, 0, 0));
}
