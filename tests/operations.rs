//! Operating postie: `/metrics` values after a small run, `/healthz` and `/readyz`
//! (also during a PostgreSQL outage), SIGTERM during a run, an SMTP relay down
//! (the circuit breaker pauses instead of dead-lettering), and the broker
//! connection cut, frozen, closed by an operator, and the consumer cancelled.
//!
//! Sizes (issue 46): the fast tier runs SIGTERM mid-run with 400 jobs, the relay down
//! for 10 s past the breaker opening and the broker path's failures with 200 jobs; the
//! `slow_` twins run the figures the docs quote: 1,000 jobs, 30 s, 400 jobs.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{eventually, free_port, job, proxy::Proxy, sample, TestEnv};

use support::http_get as get;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened_and_health_endpoints_answer() {
    let env = TestEnv::new("metrics").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "flaky", "action": {"reply": "451 4.3.0 later"}, "times": 1},
            {"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.1.1 no such user"}}
        ]))
        .await;
    let port = free_port();
    let mut settings = env.settings();
    settings.http.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let serving = env.serve(settings);
    let base = format!("http://127.0.0.1:{port}");

    for key in ["m-1", "m-2", "m-3"] {
        env.publish(&job(key, "ok@example.com")).await;
    }
    let envr = &env;
    // After the first send (a duplicate racing its original's live claim is parked
    // first, and would count twice in jobs_received).
    eventually(
        "the first three",
        Duration::from_secs(60),
        move || async move { (envr.sink.count().await == 3).then_some(()) },
    )
    .await;
    env.publish(&job("m-1", "ok@example.com")).await; // duplicate
    env.publish(&job("m-flaky", "flaky@example.com")).await; // one retry, then sent
    env.publish(&job("m-nobody", "nobody@example.com")).await; // 5xx
    env.publish_raw(b"not json", postie::testing::broker::job_properties())
        .await; // invalid

    let base_ref = &base;
    let text = eventually(
        "the counters",
        Duration::from_secs(60),
        move || async move {
            let (status, text) = get(&format!("{base_ref}/metrics")).await;
            let done = status == 200
                && sample(&text, "postie_emails_sent_total") == Some(4.0)
                && sample(&text, "postie_duplicates_suppressed_total") == Some(1.0)
                && sample(&text, "postie_dead_lettered_total{reason=\"permanent\"}") == Some(1.0)
                && sample(&text, "postie_dead_lettered_total{reason=\"invalid\"}") == Some(1.0);
            done.then_some(text)
        },
    )
    .await;
    assert_eq!(
        sample(&text, "postie_retries_total{step=\"0\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "postie_invalid_jobs_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "postie_jobs_received_total"),
        Some(8.0),
        "{text}"
    );
    assert_eq!(sample(&text, "postie_deferred_total"), Some(0.0), "{text}");
    assert_eq!(sample(&text, "postie_in_flight"), Some(0.0), "{text}");
    assert_eq!(sample(&text, "postie_consumer_paused"), Some(0.0), "{text}");
    assert_eq!(
        sample(&text, "postie_smtp_send_duration_seconds_count"),
        Some(6.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "postie_delivery_lateness_seconds_count"),
        Some(4.0),
        "{text}"
    );
    assert!(text.contains("postie_queue_depth{queue=\""), "{text}");
    assert!(
        text.contains("postie_relayed_total{route=\"now\"}"),
        "{text}"
    );
    assert_eq!(get(&format!("{base}/healthz")).await.0, 200);
    let (status, body) = get(&format!("{base}/readyz")).await;
    assert_eq!(status, 200, "{body}");
    // The node in use, redacted.
    assert!(body.starts_with("ready\nbroker: amqp"), "{body}");
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_a_database_outage_and_recovers() {
    let env = TestEnv::new("readyz").await;
    let pg = Proxy::start("127.0.0.1:5432").await;
    let port = free_port();
    let mut settings = env.settings();
    settings.database.url = format!("postgres://postgres@{}/{}", pg.addr(), env.db_name).into();
    settings.http.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let serving = env.serve(settings);
    let ready = format!("http://127.0.0.1:{port}/readyz");
    let ready_ref = &ready;
    eventually("ready", Duration::from_secs(30), move || async move {
        (get(ready_ref).await.0 == 200).then_some(())
    })
    .await;

    pg.down();
    env.publish(&job("during-outage", "x@example.com")).await;
    let body = eventually("not ready", Duration::from_secs(30), move || async move {
        let (status, body) = get(ready_ref).await;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.contains("database unreachable"), "{body}");
    pg.up();
    eventually("ready again", Duration::from_secs(60), move || async move {
        (get(ready_ref).await.0 == 200).then_some(())
    })
    .await;
    let envr = &env;
    eventually(
        "the held job sent",
        Duration::from_secs(60),
        move || async move { (envr.sink.count().await == 1).then_some(()) },
    )
    .await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_run_drains_exits_0_and_a_restart_finishes_exactly_once() {
    sigterm_mid_run(400).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_sigterm_mid_run_drains_exits_0_and_a_restart_finishes_exactly_once() {
    sigterm_mid_run(1_000).await;
}

/// `jobs` published, SIGTERM once 50 are sent: postie drains within its drain timeout
/// and exits 0 before the run ends, and a restart sends every job exactly once. With
/// 64 sends at a time and 150 ms each, about 50 + 64 are sent before the restart, so
/// 400 still leave most of the run to the restart; the bounds do not depend on the size.
async fn sigterm_mid_run(jobs: usize) {
    let env = TestEnv::new("sigterm").await;
    env.sink
        .set_faults(json!([{"stage": "data_end", "action": {"delay_ms": 150}}]))
        .await;
    let bodies: Vec<_> = (0..jobs)
        .map(|i| job(&format!("term-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let drain = [("POSTIE__WORKER__DRAIN_TIMEOUT", "10s")];
    let mut first = env.spawn_process(&drain);
    env.wait_for_emails("the run under way", 50, Duration::from_secs(60))
        .await;
    let asked = Instant::now();
    let status = first
        .terminate(Duration::from_secs(30))
        .expect("exits after SIGTERM");
    let took = asked.elapsed();
    assert!(
        status.success(),
        "exit status {status:?}; log:\n{}",
        first.log()
    );
    assert!(
        took < Duration::from_secs(10),
        "drain took {took:?}, over the drain timeout"
    );
    let sent_before_restart = env.sink.count().await;
    assert!(
        sent_before_restart < jobs,
        "the run ended before SIGTERM; make it slower"
    );

    let _second = env.spawn_process(&drain);
    env.wait_for_emails(
        "every job after the restart",
        jobs,
        Duration::from_secs(180),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *per_id.entry(m.message_id).or_default() += 1;
    }
    assert_eq!(per_id.len(), jobs, "lost");
    assert!(
        per_id.values().all(|n| *n == 1),
        "duplicates: {:?}",
        per_id.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    eprintln!("FIGURES sigterm: stopped in {:.2}s with {sent_before_restart} of {jobs} sent; all {jobs} sent once after restart", took.as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_smtp_relay_down_for_10_s_pauses_instead_of_dead_lettering() {
    smtp_relay_down(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_an_smtp_relay_down_for_30_s_pauses_instead_of_dead_lettering() {
    smtp_relay_down(Duration::from_secs(30)).await;
}

/// The relay down for `outage` after the breaker opened (the test's retry steps,
/// 1+2+5 s, are 8 s: any outage past them would dead-letter a job that is not held
/// back): nothing is dead-lettered, and once the relay is back every job is sent once
/// and the breaker closes. The bounds do not depend on the outage.
async fn smtp_relay_down(outage: Duration) {
    const JOBS: usize = 60;
    let env = TestEnv::new("smtpdown").await;
    let relay = Proxy::start(env.sink.smtp_addr()).await;
    let mut settings = env.settings();
    let retrying: Duration = settings.topology.retry_steps.iter().sum();
    assert!(
        outage > retrying + Duration::from_secs(1),
        "an outage of {outage:?} is not past every retry step ({retrying:?})"
    );
    settings.transport.url = Some(format!("smtp://{}", relay.addr()).into());
    let port = free_port();
    settings.http.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let serving = env.serve(settings);
    let bodies: Vec<_> = (0..JOBS / 2)
        .map(|i| job(&format!("sd-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    env.wait_for_emails("the first half", JOBS / 2, Duration::from_secs(60))
        .await;

    relay.down();
    let bodies: Vec<_> = (JOBS / 2..JOBS)
        .map(|i| job(&format!("sd-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let metrics_ref = &metrics;
    eventually(
        "the circuit to open",
        Duration::from_secs(30),
        move || async move {
            let (_, text) = get(metrics_ref).await;
            (sample(&text, "postie_smtp_circuit_open") == Some(1.0)).then_some(())
        },
    )
    .await;
    // The console's view of the breaker (sql/0018), as the prober wrote it.
    let breaker = || async {
        let db = env.db().await;
        db.query("SELECT provider, open FROM postie_breakers", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, bool>(1)))
            .collect::<Vec<_>>()
    };
    eventually(
        "the open breaker written",
        Duration::from_secs(10),
        || async { (breaker().await == [("smtp".to_string(), true)]).then_some(()) },
    )
    .await;
    tokio::time::sleep(outage).await; // past every retry step
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead-lettered because of the outage"
    );
    relay.up();
    let back = Instant::now();
    env.wait_for_emails(
        "every job after the relay is back",
        JOBS,
        Duration::from_secs(120),
    )
    .await;
    let recovery = back.elapsed();
    eventually(
        "the closed breaker written",
        Duration::from_secs(10),
        || async { (breaker().await == [("smtp".to_string(), false)]).then_some(()) },
    )
    .await;
    serving.stop().await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *per_id.entry(m.message_id).or_default() += 1;
    }
    assert_eq!(per_id.len(), JOBS, "lost");
    assert!(per_id.values().all(|n| *n == 1), "duplicates");
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    eprintln!(
        "FIGURES smtp-down: {} s outage, all {JOBS} sent {:.1}s after the relay came back; dead-lettered 0",
        outage.as_secs(),
        recovery.as_secs_f64()
    );
}

/// Emails the sink holds, by Message-ID.
async fn emails_by_id(env: &TestEnv) -> BTreeMap<String, usize> {
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *per_id.entry(m.message_id).or_default() += 1;
    }
    per_id
}

/// Waits (up to 120 s) for one more email than the sink holds now; returns the seconds.
async fn next_email(env: &TestEnv, postie: &support::PostieProcess, what: &str) -> f64 {
    let next = env.sink.count().await + 1;
    env.emails_or_log(
        postie,
        &format!("an email after {what}"),
        next,
        Duration::from_secs(120),
    )
    .await
}

/// The broker-side failures that are not a restart: the TCP connection cut, the path
/// frozen (no byte crosses and nothing closes; only heartbeats can tell), the
/// connection closed by an operator through the management API, and the send
/// consumer cancelled by the broker (its queue deleted and re-created). postie
/// notices each, reconnects, and every job is sent exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connection_cut_frozen_closed_and_consumer_cancelled_lose_nothing() {
    broker_path_failures(200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_broker_connection_cut_frozen_closed_and_consumer_cancelled_lose_nothing() {
    broker_path_failures(400).await;
}

/// [`broker_connection_cut_frozen_closed_and_consumer_cancelled_lose_nothing`] with
/// `jobs` jobs. Four sends at a time of 100 ms each (40/s at most), and the failures
/// come one after the other, each as soon as an email shows the last one over: most
/// jobs are still in the send queue when it is deleted. The bounds do not depend on
/// the size.
async fn broker_path_failures(jobs: usize) {
    let env = TestEnv::new("brokercut").await;
    let broker = Proxy::start(&support::amqp_host_port()).await;
    let instance = format!("{}-cut", env.prefix);
    // A 2 s heartbeat, so a frozen path is noticed in about 4 s.
    let url = format!("amqp://guest:guest@{}/%2f?heartbeat=2", broker.addr());
    env.sink
        .set_faults(json!([{"stage": "data_end", "action": {"delay_ms": 100}}]))
        .await;
    let bodies: Vec<_> = (0..jobs)
        .map(|i| job(&format!("cut-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let postie = env.spawn_process(&[
        ("POSTIE__AMQP__URL", url.as_str()),
        ("POSTIE__WORKER__INSTANCE_ID", instance.as_str()),
        ("POSTIE__WORKER__CONCURRENCY", "4"),
        ("POSTIE__AMQP__PREFETCH", "4"),
    ]);
    let mut figures = Vec::new();
    next_email(&env, &postie, "start-up").await;

    // 1. Cut: every connection closed, new ones refused for 3 s.
    broker.down();
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.up();
    let t = next_email(&env, &postie, "the cut").await;
    figures.push(format!("cut 3 s: next email {t:.1}s after"));

    // 2. Frozen for 8 s: only the heartbeat notices.
    broker.freeze();
    let frozen = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    broker.thaw();
    let t = next_email(&env, &postie, "the freeze").await;
    figures.push(format!(
        "frozen 8 s: next email {:.1}s after it began, {t:.1}s after the thaw",
        frozen.elapsed().as_secs_f64()
    ));

    // 3. An operator closes postie's connection in the management UI.
    let name = {
        let instance = instance.clone();
        eventually(
            "postie's connection listed",
            Duration::from_secs(30),
            move || {
                let instance = instance.clone();
                async move {
                    let list: serde_json::Value = reqwest::Client::new()
                        .get(format!("{}/api/connections", support::management_url()))
                        .basic_auth("guest", Some("guest"))
                        .send()
                        .await
                        .ok()?
                        .json()
                        .await
                        .ok()?;
                    list.as_array()?
                        .iter()
                        .find(|c| c["client_properties"]["connection_name"] == instance.as_str())
                        .and_then(|c| c["name"].as_str().map(str::to_string))
                }
            },
        )
        .await
    };
    let closed = reqwest::Client::new()
        .delete(format!(
            "{}/api/connections/{}",
            support::management_url(),
            urlencode(&name)
        ))
        .basic_auth("guest", Some("guest"))
        .header("X-Reason", "closed by the test")
        .send()
        .await
        .unwrap();
    assert!(closed.status().is_success(), "close: {}", closed.status());
    let t = next_email(&env, &postie, "the forced close").await;
    figures.push(format!("closed by an operator: next email {t:.1}s after"));

    // 4. The broker cancels the send consumer: its queue is deleted (the jobs still
    // in it are the operator's loss, so they are put back by hand), and postie
    // re-declares it on the next session.
    let send = env.topology.send_queue();
    let (envr, sendr) = (&env, &send);
    eventually(
        "postie consuming again",
        Duration::from_secs(60),
        move || async move { (envr.consumers(sendr).await >= 1).then_some(()) },
    )
    .await;
    let remaining_ids = {
        let sent = emails_by_id(&env).await;
        (0..jobs)
            .filter(|i| !sent.contains_key(&support::message_id(&format!("cut-{i}"))))
            .collect::<Vec<_>>()
    };
    env.delete_queue(send).await;
    let cancelled = Instant::now();
    eventually(
        "postie re-declares the send queue",
        Duration::from_secs(60),
        move || async move { envr.queue_exists(sendr).await.then_some(()) },
    )
    .await;
    figures.push(format!(
        "consumer cancelled with {} of {jobs} unsent: queue re-declared {:.1}s after",
        remaining_ids.len(),
        cancelled.elapsed().as_secs_f64()
    ));
    let bodies: Vec<_> = remaining_ids
        .iter()
        .map(|i| job(&format!("cut-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;

    let deadline = Instant::now() + Duration::from_secs(300);
    while emails_by_id(&env).await.len() < jobs {
        assert!(
            Instant::now() < deadline,
            "not every job sent; postie's log:\n{}",
            postie.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_id = emails_by_id(&env).await;
    assert_eq!(per_id.len(), jobs, "lost");
    let duplicates: usize = per_id.values().map(|c| c - 1).sum();
    assert_eq!(duplicates, 0, "duplicate emails");
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead-lettered"
    );
    let log = postie.log();
    assert!(
        log.matches("reconnected to RabbitMQ").count() >= 4,
        "four reconnections expected; log:\n{log}"
    );
    eprintln!(
        "FIGURES broker-path: {jobs} jobs; {}; lost 0, duplicates 0, dead-lettered 0",
        figures.join("; ")
    );
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The keys that moved from `smtp.*` to `transport.*` still read under their old
/// names (and `POSTIE__SMTP__…` variables), each with one warning line once logging
/// is up; a key set under both names stops start-up with one line. `postie console
/// --new-token` loads the settings as every command does, and needs no service.
#[test]
fn old_smtp_key_names_warn_once_each_and_both_names_stop_start_up() {
    let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let old = env(&[
        ("POSTIE__SMTP__TIMEOUT", "7s"),
        ("POSTIE__SMTP__DEFAULT_FROM", "Shop <noreply@shop.example>"),
        ("POSTIE__SMTP__CHUNKING", "false"),
    ]);
    let run = support::run_postie(&["console", "--new-token"], &old);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.stdout.lines().count(), 1, "the token: {}", run.stdout);
    let warnings: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("is the old name of"))
        .collect();
    assert_eq!(warnings.len(), 2, "{}", run.stderr);
    for key in ["timeout", "default_from"] {
        let said = format!("smtp.{key} is the old name of transport.{key}");
        assert_eq!(
            warnings.iter().filter(|l| l.contains(&said)).count(),
            1,
            "{}",
            run.stderr
        );
        assert!(
            warnings.iter().any(|l| l.contains("WARN")),
            "{}",
            run.stderr
        );
    }
    let new = env(&[
        ("POSTIE__TRANSPORT__TIMEOUT", "7s"),
        ("POSTIE__SMTP__CHUNKING", "false"),
    ]);
    let run = support::run_postie(&["console", "--new-token"], &new);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(!run.stderr.contains("old name"), "{}", run.stderr);
    let both = env(&[
        ("POSTIE__SMTP__TIMEOUT", "7s"),
        ("POSTIE__TRANSPORT__TIMEOUT", "7s"),
    ]);
    let run = support::run_postie(&["console", "--new-token"], &both);
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert_eq!(
        run.stderr.trim_end(),
        "postie: configuration error: smtp.timeout and transport.timeout are both set, and \
         they are one key (smtp.timeout is its old name): keep transport.timeout alone"
    );
    assert!(run.stdout.is_empty(), "{}", run.stdout);
}
