//! The x-delay contract in ladder mode against the real broker (README, "Delays"), the
//! auto-mode probe, and plugin mode's start-up errors on a broker without the plugin.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use postie::config::DelayMode;
use postie::testing::broker;
use postie::testing::broker::{probe_plugin, resolve_mode};
use postie::testing::headers::HEADER_PUBLISHED_AT;
use secrecy::SecretString;
use support::{amqp_url, eventually, job, message_id, sample, TestEnv};

/// The one line `postie` prints when it gives up.
fn final_error(stderr: &str) -> &str {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("postie: "))
        .collect();
    assert_eq!(lines.len(), 1, "expected one error line in {stderr}");
    lines[0]
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Publishes `key` with `x-delay` = `delay_ms`; returns the due time (Unix ms).
async fn publish_delayed(env: &TestEnv, key: &str, delay_ms: i64) -> i64 {
    let published = now_ms();
    let body = job(key, "later@example.com").to_string();
    env.publish_raw(
        body.as_bytes(),
        support::delayed_properties(delay_ms, published),
    )
    .await;
    published + delay_ms.max(0)
}

/// Checks every key arrived exactly once and not before its due time; returns
/// lateness in ms per key.
async fn check_on_time(env: &TestEnv, due: &BTreeMap<String, i64>) -> Vec<i64> {
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        seen.entry(m.message_id).or_default().push(m.received_at_ms);
    }
    let mut lateness = Vec::new();
    for (key, due_ms) in due {
        let arrivals = seen
            .get(&message_id(key))
            .unwrap_or_else(|| panic!("{key} was never sent"));
        assert_eq!(arrivals.len(), 1, "{key} was sent {} times", arrivals.len());
        assert!(
            arrivals[0] >= *due_ms,
            "{key} was sent {} ms early",
            due_ms - arrivals[0]
        );
        lateness.push(arrivals[0] - due_ms);
    }
    lateness
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ladder_jobs_delayed_0_to_8_s_are_all_sent_and_none_early() {
    let env = TestEnv::new("ladder08").await;
    let serving = env.serve(env.settings());
    let mut due = BTreeMap::new();
    // Spread over 0..8 s, including 0, negative, sub-resolution and odd values.
    let delays = [
        0, -500, 50, 99, 100, 101, 999, 1000, 1500, 2048, 2999, 3333, 4095, 4500, 5000, 6001, 7000,
        7777, 7999, 8000,
    ];
    for (i, delay) in delays.iter().enumerate() {
        let key = format!("delay-{i}");
        due.insert(key.clone(), publish_delayed(&env, &key, *delay).await);
    }
    let n = delays.len();
    env.wait_for_emails("every delayed email", n, Duration::from_secs(90))
        .await;
    serving.stop().await;
    let mut lateness = check_on_time(&env, &due).await;
    lateness.sort();
    eprintln!(
        "FIGURES ladder08: {n} jobs, lateness ms min {} median {} max {}",
        lateness[0],
        lateness[n / 2],
        lateness[n - 1]
    );
    // The inbox keeps the same due times.
    assert_eq!(env.inbox_count("sent_at < due_at").await, 0);
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_or_too_long_x_delay_is_dead_lettered_at_intake() {
    let env = TestEnv::new("baddelay").await;
    let serving = env.serve(env.settings());
    let cases: Vec<(AMQPValue, &str)> = vec![
        (AMQPValue::LongString("tomorrow".into()), "not an integer"),
        (AMQPValue::Double(1.5), "not an integer"),
        (AMQPValue::LongLongInt(11 * 60 * 1000), "over the maximum"),
    ];
    for (i, (value, _)) in cases.iter().enumerate() {
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), value.clone());
        let body = job(&format!("bad-delay-{i}"), "x@example.com").to_string();
        env.publish_raw(
            body.as_bytes(),
            broker::job_properties().with_headers(headers),
        )
        .await;
    }
    env.publish(&job("good", "x@example.com")).await;
    let envr = &env;
    eventually(
        "3 dead letters and the good email",
        Duration::from_secs(60),
        move || async move {
            (envr.depth(envr.topology.dead_queue()).await == 3 && envr.sink.count().await == 1)
                .then_some(())
        },
    )
    .await;
    serving.stop().await;
    let reasons = env.dead_reasons().await;
    for (_, expected) in &cases {
        assert!(
            reasons.iter().any(|r| r.contains(expected)),
            "{expected}: {reasons:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_loses_nothing() {
    const JOBS: usize = 300;
    let env = TestEnv::new("relaykill").await;
    let mut victim = env.spawn_process(&[]);
    let _other = env.spawn_process(&[]);
    let mut due = BTreeMap::new();
    for i in 0..JOBS {
        let key = format!("rk-{i}");
        due.insert(
            key.clone(),
            publish_delayed(&env, &key, (i as i64 * 37) % 3000).await,
        );
        if i == JOBS / 2 {
            victim.kill9();
        }
    }
    let _replacement = env.spawn_process(&[]);
    env.wait_for_emails("every job after the kill", JOBS, Duration::from_secs(120))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await; // would-be duplicates show up
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *seen.entry(m.message_id).or_default() += 1;
    }
    let taken_over = env.taken_over_ids().await;
    for (key, due_ms) in &due {
        let n = seen.get(&message_id(key)).copied().unwrap_or(0);
        assert!(n >= 1, "{key} lost");
        assert!(
            n == 1 || taken_over.contains(&message_id(key)),
            "{key} duplicated outside the known window"
        );
        let _ = due_ms;
    }
    assert_eq!(
        env.inbox_count("sent_at < due_at").await,
        0,
        "sent before due"
    );
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_relayed_earliest_due_first() {
    // 1,500 jobs due in 9 minutes wait in the intake ahead of 20 due within 2 s.
    // Relayed in queue order, every far job would be recorded before the first near
    // one; the relay takes its prefetch window earliest due first. The window is
    // what worker.inflight_bytes (128 MiB) holds of max_body_bytes: 1,920 at 64 KiB.
    const FAR: usize = 1_500;
    const NEAR: usize = 20;
    let env = TestEnv::new("relayorder").await;
    support::bench::publish_delayed(&env, "far", std::iter::repeat_n(9 * 60_000, FAR)).await;
    let due =
        support::bench::publish_delayed(&env, "near", (0..NEAR as i64).map(|i| i * 100)).await;
    let _postie = env.spawn_process(&[("POSTIE__WORKER__MAX_BODY_BYTES", "65536")]);
    env.wait_for_emails("the near jobs", NEAR, Duration::from_secs(120))
        .await;
    let envr = &env;
    eventually(
        "every far job recorded as scheduled",
        Duration::from_secs(120),
        move || async move {
            (envr.inbox_count("key LIKE 'far-%'").await == FAR as i64).then_some(())
        },
    )
    .await;
    let far_first = env
        .inbox_count(
            "key LIKE 'far-%' AND created_at < \
             (SELECT max(created_at) FROM postie_inbox WHERE key LIKE 'near-%')",
        )
        .await;
    assert!(
        far_first < FAR as i64 / 2,
        "{far_first} of {FAR} far jobs were relayed before the last near one"
    );
    let arrivals = env.sink.messages(false).await;
    let lateness = support::bench::Lateness::measure(&due, &arrivals);
    assert_eq!(
        (lateness.lost, lateness.early, lateness.duplicates),
        (0, 0, 0),
        "{lateness:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_ladder_on_a_broker_without_the_plugin() {
    let url = SecretString::from(amqp_url());
    assert!(
        !probe_plugin(&url, Duration::from_secs(10)).await.unwrap(),
        "this broker has no delayed-message plugin"
    );
    let env = TestEnv::new("auto").await; // declares <p>.delayed as direct (ladder)
    let existing = env.settings().topology;
    let mut fresh = existing.clone();
    fresh.prefix = format!("{}.fresh", env.prefix);
    for (topology, why) in [
        (&existing, "an existing direct entry exchange means ladder"),
        (&fresh, "a fresh broker without the plugin means ladder"),
    ] {
        let mode = resolve_mode(DelayMode::Auto, topology, &url, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(mode, DelayMode::Ladder, "{why}");
    }
    // `postie topology` prints the choice.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_postie"))
        .arg("topology")
        .envs(env.env_vars())
        .env("POSTIE__DELAY__MODE", "auto")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("delay mode: ladder (configured: auto)"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_mode_without_the_plugin_fails_start_up_with_the_fix() {
    let env = TestEnv::new("plugin").await;
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_postie"))
        .arg("serve")
        .envs(env.env_vars())
        .env("POSTIE__DELAY__MODE", "plugin")
        .env("POSTIE__TOPOLOGY__PREFIX", format!("{}.plugin", env.prefix))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve must fail: {stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "serve must fail fast, not retry"
    );
    let last = final_error(&stderr);
    assert!(
        last.contains("no delayed-message plugin") && last.contains("delay.mode = ladder"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_modes_on_a_live_broker_is_a_clear_error() {
    let env = TestEnv::new("mismatch").await;
    let prefix = format!("{}.mm", env.prefix);
    // Someone declared the entry exchange with another type (as plugin mode would).
    let conn = broker::connect(
        &postie::config::AmqpAddresses::parse(&SecretString::from(amqp_url())).unwrap(),
        "test",
        Duration::from_secs(10),
    )
    .await
    .map(|c| c.connection)
    .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let durable = lapin::options::ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .exchange_declare(
            format!("{prefix}.delayed").as_str().into(),
            lapin::ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_postie"))
        .arg("serve")
        .envs(env.env_vars())
        .env("POSTIE__TOPOLOGY__PREFIX", &prefix)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let channel = conn.create_channel().await.unwrap();
    let _ = channel
        .exchange_delete(
            format!("{prefix}.delayed").as_str().into(),
            Default::default(),
        )
        .await;
    assert!(!out.status.success());
    let last = final_error(&stderr);
    assert!(
        last.contains(&format!(
            "exchange {prefix}.delayed already exists with another type"
        )) && last.contains("delay.mode"),
        "{stderr}"
    );
}

/// Publishes a job with a 4 s delay straight to the send queue, as if moved there by
/// hand: no due time stamped by the relay. Returns its publish time.
async fn publish_early(env: &TestEnv, key: &str) -> i64 {
    let published = now_ms();
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(4_000));
    headers.insert(
        HEADER_PUBLISHED_AT.into(),
        AMQPValue::LongLongInt(published),
    );
    let body = job(key, "x@example.com").to_string();
    env.publish_to_queue(
        env.topology.send_queue(),
        body.as_bytes(),
        broker::job_properties().with_headers(headers),
    )
    .await;
    published
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_job_moved_straight_to_the_work_queue_still_waits() {
    // No due time stamped by the relay: the worker finds it early and sends it back
    // through the intake, the path a delay longer than one ladder pass also takes.
    let env = TestEnv::new("early").await;
    let serving = env.serve(env.settings());
    let published = publish_early(&env, "moved-in").await;
    let envr = &env;
    let messages = eventually("the email", Duration::from_secs(60), move || async move {
        let m = envr.sink.messages(false).await;
        (!m.is_empty()).then_some(m)
    })
    .await;
    serving.stop().await;
    assert_eq!(messages.len(), 1);
    assert!(
        messages[0].received_at_ms >= published + 4_000,
        "sent {} ms early",
        published + 4_000 - messages[0].received_at_ms
    );
}

/// A job found before its due time is counted as an early arrival, not as deferred
/// (which names another instance's live claim), and is still sent on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mx_an_early_arrival_counts_as_early_not_deferred() {
    let env = TestEnv::new("mx-early").await;
    let port = support::free_port();
    let mut settings = env.settings();
    settings.http.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let serving = env.serve(settings);
    publish_early(&env, "mx-early").await;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let url = &url;
    let text = eventually(
        "the email sent",
        Duration::from_secs(60),
        move || async move {
            let text = reqwest::get(url).await.ok()?.text().await.ok()?;
            (sample(&text, "postie_emails_sent_total") == Some(1.0)).then_some(text)
        },
    )
    .await;
    serving.stop().await;
    assert_eq!(env.sink.count().await, 1);
    let early = sample(&text, "postie_early_arrivals_total").unwrap_or(0.0);
    assert!(early >= 1.0, "{text}");
    assert_eq!(sample(&text, "postie_deferred_total"), Some(0.0), "{text}");
}

/// PostgreSQL is the schedule of record: when the ladder loses jobs (here purged from
/// its queues, as a lost broker node can strand them), the reconciler re-publishes
/// each once it is overdue by the grace period. Every job is sent once, none early,
/// and its kept body is dropped once it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_lost_from_the_ladder_are_re_published_after_the_grace() {
    const JOBS: usize = 20;
    let env = TestEnv::new("reconcile").await;
    let mut settings = env.settings();
    settings.delay.reconcile_grace = Duration::from_secs(2);
    let serving = env.serve(settings);
    let mut due = BTreeMap::new();
    for i in 0..JOBS {
        let key = format!("lost-{i}");
        due.insert(key.clone(), publish_delayed(&env, &key, 6_000).await);
    }
    // Wait until every job is parked in the ladder and recorded with its body.
    let envr = &env;
    eventually(
        "every job scheduled with its body",
        Duration::from_secs(60),
        move || async move {
            // The table appears once postie has migrated.
            let row = envr
                .db()
                .await
                .query_one(
                    "SELECT count(*) FROM postie_inbox \
                     WHERE status = 'scheduled' AND body IS NOT NULL",
                    &[],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) == JOBS as i64).then_some(())
        },
    )
    .await;
    // The ladder loses them all.
    let broker::DelayLayout::Ladder(ladder) = env.topology.delay() else {
        panic!("the tests run in ladder mode");
    };
    let conn = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut purged = 0;
    for k in 0..ladder.levels() {
        purged += channel
            .queue_purge(
                env.topology.delay_level(k).as_str().into(),
                Default::default(),
            )
            .await
            .unwrap();
    }
    assert_eq!(purged as usize, JOBS, "every job was in the ladder");
    let _ = conn.close(200, "done".into()).await;

    env.wait_for_emails("every lost job", JOBS, Duration::from_secs(120))
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;
    let lateness = check_on_time(&env, &due).await;
    // Not before due + grace: the reconciler only takes overdue jobs.
    assert!(
        lateness.iter().all(|&late| late >= 2_000),
        "re-published before the grace ran out: {lateness:?}"
    );
    assert_eq!(
        env.inbox_count("body IS NOT NULL").await,
        0,
        "bodies kept after sending"
    );
    assert_eq!(env.inbox_count("status = 'sent'").await, JOBS as i64);
    assert_eq!(
        env.inbox_count("reconciled_at IS NOT NULL").await,
        JOBS as i64,
        "every re-published job is recorded as reconciled"
    );
    eprintln!(
        "FIGURES reconcile: {JOBS} jobs lost from the ladder, all re-published and sent once; lateness ms min {} max {}",
        lateness.iter().min().unwrap(),
        lateness.iter().max().unwrap()
    );
}
