//! Whole-service outages: RabbitMQ restarted (with jobs pending in the ladder).
//! These tests stop and start the shared services, so nothing may run beside them:
//! they are the slow tier's `alone` profile (.config/nextest.toml, one test at a
//! time, after every other test), never in the fast tier.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker;
use postie::testing::headers::HEADER_PUBLISHED_AT;
use support::{job, message_id, TestEnv};

fn rabbitmqctl(args: &[&str]) {
    let status = support::rabbitmqctl_command(args)
        .status()
        .expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

/// Stops the RabbitMQ application for `down`, then starts it and waits until it runs.
async fn restart_rabbitmq(down: Duration) {
    rabbitmqctl(&["stop_app"]);
    tokio::time::sleep(down).await;
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup", "--timeout", "60"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_pending_in_the_ladder_survive_a_broker_restart() {
    const JOBS: usize = 40;
    let env = TestEnv::new("brokerrestart").await;
    let _postie = env.spawn_process(&[]);
    let mut due = BTreeMap::new();
    for i in 0..JOBS {
        let key = format!("br-{i}");
        let published = chrono::Utc::now().timestamp_millis();
        let delay = 4_000 + (i as i64 * 250); // 4 s .. 14 s
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay));
        headers.insert(
            HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(published),
        );
        env.publish_raw(
            job(&key, "x@example.com").to_string().as_bytes(),
            broker::job_properties().with_headers(headers),
        )
        .await;
        due.insert(message_id(&key), published + delay);
    }
    // Let the relay put them into the ladder, then take the broker away.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(env.sink.count().await, 0, "nothing is due yet");
    let restarted = Instant::now();
    restart_rabbitmq(Duration::from_secs(3)).await;
    eprintln!(
        "broker back after {:.1}s",
        restarted.elapsed().as_secs_f64()
    );

    env.wait_for_emails(
        "every job after the restart",
        JOBS,
        Duration::from_secs(120),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        seen.entry(m.message_id).or_default().push(m.received_at_ms);
    }
    assert_eq!(seen.len(), JOBS, "lost jobs");
    for (id, arrivals) in &seen {
        assert_eq!(arrivals.len(), 1, "{id} duplicated");
        assert!(
            arrivals[0] >= due[id],
            "{id} sent {} ms early",
            due[id] - arrivals[0]
        );
    }
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
}

/// Publishes `n` jobs, starts one postie process with slow SMTP, runs `outage`
/// once a quarter is sent, and checks every job is then sent exactly once with
/// nothing dead-lettered. Returns (seconds from the outage's end to the next email).
async fn run_through_outage<F, Fut>(name: &str, n: usize, outage: F) -> f64
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let env = TestEnv::new(name).await;
    // About 40 emails/s, so the run is still going when the outage starts and ends.
    env.sink
        .set_faults(serde_json::json!([{"stage": "data_end", "action": {"delay_ms": 100}}]))
        .await;
    let bodies: Vec<_> = (0..n)
        .map(|i| job(&format!("{name}-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let postie = env.spawn_process(&[
        ("POSTIE__WORKER__CONCURRENCY", "4"),
        ("POSTIE__AMQP__PREFETCH", "4"),
    ]);
    env.wait_for_emails("a quarter sent", n / 4, Duration::from_secs(120))
        .await;
    outage().await;
    let back = Instant::now();
    let before = env.sink.count().await;
    assert!(
        before < n,
        "the run finished during the outage; slow it down"
    );
    env.emails_or_log(
        &postie,
        "the next email after the outage",
        before + 1,
        Duration::from_secs(120),
    )
    .await;
    let recovery = back.elapsed().as_secs_f64();
    env.emails_or_log(&postie, "every job", n, Duration::from_secs(300))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *per_id.entry(m.message_id).or_default() += 1;
    }
    assert_eq!(per_id.len(), n, "lost jobs; log:\n{}", postie.log());
    let duplicates: usize = per_id.values().map(|c| c - 1).sum();
    assert_eq!(duplicates, 0, "duplicate emails");
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead-lettered because of the outage"
    );
    recovery
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_stopped_and_started_mid_run_loses_nothing() {
    let recovery =
        run_through_outage("rmqdown", 400, || restart_rabbitmq(Duration::from_secs(5))).await;
    eprintln!("FIGURES rabbitmq-restart: 400 jobs, broker down 5 s; next email {recovery:.1}s after it was back; lost 0, duplicates 0, dead-lettered 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_restarted_mid_run_loses_nothing() {
    let recovery = run_through_outage("pgrestart", 400, || async {
        assert!(support::restart_postgres(), "pg_ctlcluster restart failed");
    })
    .await;
    eprintln!("FIGURES postgresql-restart: 400 jobs, PostgreSQL restarted; next email {recovery:.1}s after it was back; lost 0, duplicates 0, dead-lettered 0");
}
