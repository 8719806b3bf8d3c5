//! The core path end to end, against a real RabbitMQ, a real PostgreSQL and a real
//! SMTP server process: happy path, duplicates, transient and permanent SMTP
//! failures, retry exhaustion and replay, bad input, and a PostgreSQL outage.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use postie::testing::headers::HEADER_ATTEMPT;
use serde_json::json;
use support::{eventually, job, message_id, proxy::Proxy, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_job_is_sent_once_with_its_headers_and_acked() {
    let env = TestEnv::new("happy").await;
    let serving = env.serve(env.settings());
    env.publish(&json!({
        "order_id": "42", "type": "order_confirmation", "user_id": "u-7",
        "from": "Shop <noreply@shop.example>",
        "to": ["alice@example.com"], "cc": ["carol@example.com"], "bcc": ["audit@example.com"],
        "reply_to": "help@shop.example",
        "subject": "Your order #42", "text": "plain body", "html": "<p>html body</p>",
        "headers": {"X-Campaign": "spring"}
    }))
    .await;

    let env = &env;
    let messages = eventually("the email", WAIT, move || async move {
        let m = env.sink.messages(true).await;
        (!m.is_empty()).then_some(m)
    })
    .await;
    // A clean stop closes the channel: an unacked delivery would be back in the queue.
    serving.stop().await;

    assert_eq!(messages.len(), 1);
    let m = &messages[0];
    assert_eq!(m.message_id, message_id("42:order_confirmation"));
    assert_eq!(m.mail_from, "noreply@shop.example");
    let rcpt: BTreeSet<_> = m.rcpt_to.iter().map(String::as_str).collect();
    assert_eq!(
        rcpt,
        BTreeSet::from([
            "alice@example.com",
            "audit@example.com",
            "carol@example.com"
        ])
    );
    let raw = m.raw.as_deref().unwrap();
    for expected in [
        "Subject: Your order #42",
        "X-Campaign: spring",
        "Reply-To: help@shop.example",
        "Cc: carol@example.com",
        "plain body",
        "<p>html body</p>",
    ] {
        assert!(raw.contains(expected), "missing {expected:?} in\n{raw}");
    }
    assert!(
        !raw.contains("audit@example.com"),
        "Bcc leaked into the message:\n{raw}"
    );

    let row = env
        .inbox_row("42:order_confirmation")
        .await
        .expect("inbox row");
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 1));
    assert_eq!(env.depth(env.topology.send_queue()).await, 0);
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_publishes_of_one_key_send_one_email_and_count_four_duplicates() {
    let env = TestEnv::new("dupes").await;
    let serving = env.serve(env.settings());
    for _ in 0..5 {
        env.publish(&job("order-7:shipped", "bob@example.com"))
            .await;
    }
    let env = &env;
    eventually("4 suppressed duplicates", WAIT, move || async move {
        let row = env.inbox_row("order-7:shipped").await?;
        (row.duplicates == 4).then_some(())
    })
    .await;
    serving.stop().await;
    let messages = env.sink.messages(false).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].message_id, message_id("order-7:shipped"));
    assert_eq!(env.depth(env.topology.send_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_4xx_is_retried_through_the_retry_queues_then_sent() {
    let env = TestEnv::new("tempfail").await;
    // A 4xx that is not a throttle (none of smtp.throttle_patterns: "try again later"
    // is one, and a throttle is retried without counting an attempt; tests/rate_limit.rs).
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "flaky", "action": {"reply": "451 4.3.0 local error in processing"}, "times": 2}]))
        .await;
    let serving = env.serve(env.settings());
    env.publish(&job("k-flaky", "flaky@example.com")).await;
    let env = &env;
    eventually("the email after two 451s", WAIT, move || async move {
        (env.sink.count().await == 1).then_some(())
    })
    .await;
    serving.stop().await;
    let row = env.inbox_row("k-flaky").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 3), "{row:?}");
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    assert_eq!(env.sink.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_5xx_goes_to_the_dlq_at_once_with_the_reason() {
    let env = TestEnv::new("permfail").await;
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.1.1 no such user"}}]))
        .await;
    let serving = env.serve(env.settings());
    env.publish(&job("k-nobody", "nobody@example.com")).await;
    let env = &env;
    eventually("one dead letter", WAIT, move || async move {
        (env.depth(env.topology.dead_queue()).await == 1).then_some(())
    })
    .await;
    serving.stop().await;
    let dead = env.take_dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason().contains("550"),
        "reason: {}",
        dead[0].reason()
    );
    assert_eq!(
        dead[0].headers.get("postie-dead-kind").map(String::as_str),
        Some("permanent")
    );
    let row = env.inbox_row("k-nobody").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("dead", 1));
    assert_eq!(env.sink.count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_retries_dead_letter_and_a_replay_starts_a_fresh_cycle() {
    let env = TestEnv::new("exhaust").await;
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "down", "action": {"reply": "421 4.4.2 service down"}}]))
        .await;
    let serving = env.serve(env.settings());
    env.publish(&job("k-down", "down@example.com")).await;
    let envr = &env;
    eventually("the dead letter", WAIT, move || async move {
        (envr.depth(envr.topology.dead_queue()).await == 1).then_some(())
    })
    .await;
    let mut dead = env.take_dead_letters().await;
    assert_eq!(dead.len(), 1);
    let letter = dead.pop().unwrap();
    // 3 retry steps in the test settings → 4 attempts.
    assert!(
        letter.reason().contains("gave up after 4 attempts"),
        "reason: {}",
        letter.reason()
    );
    assert_eq!(
        letter.headers.get("postie-dead-kind").map(String::as_str),
        Some("retries_exhausted")
    );
    assert!(
        !letter.headers.contains_key(HEADER_ATTEMPT),
        "a dead letter must not carry the retry counter"
    );
    assert_eq!(env.inbox_row("k-down").await.unwrap().attempts, 4);

    // The relay is fixed; an operator moves the dead letter back to the work queue.
    env.sink.clear_faults().await;
    env.publish_to_queue(
        env.topology.send_queue(),
        &letter.body,
        letter.properties.clone(),
    )
    .await;
    eventually("the replayed email", WAIT, move || async move {
        (envr.sink.count().await == 1).then_some(())
    })
    .await;
    serving.stop().await;
    let row = env.inbox_row("k-down").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 5), "{row:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_reasons_and_blocks_nothing() {
    let env = TestEnv::new("badinput").await;
    let serving = env.serve(env.settings());
    let mut crlf = job("k-crlf", "a@example.com");
    crlf["subject"] = "hi\r\nBcc: victim@example.com".into();
    let mut no_rcpt = job("k-norcpt", "a@example.com");
    no_rcpt["to"] = json!([]);
    let mut bad_addr = job("k-badaddr", "a@example.com");
    bad_addr["to"] = json!(["alice at example dot com"]);
    let mut no_key = job("unused", "a@example.com");
    no_key.as_object_mut().unwrap().remove("key");
    let mut oversized = job("k-big", "a@example.com");
    oversized["text"] = "x".repeat(600 * 1024).into();

    let bad: Vec<(Vec<u8>, &str)> = vec![
        (b"{\"key\": \"k-broken\", ".to_vec(), "not a valid job"),
        (no_key.to_string().into_bytes(), "no idempotency key"),
        (no_rcpt.to_string().into_bytes(), "no recipient"),
        (bad_addr.to_string().into_bytes(), "not a valid address"),
        (crlf.to_string().into_bytes(), "CR/LF"),
        (oversized.to_string().into_bytes(), "over the limit"),
    ];
    for (i, (body, _)) in bad.iter().enumerate() {
        env.publish(&job(&format!("good-{i}"), "ok@example.com"))
            .await;
        env.publish_raw(body, postie::testing::broker::job_properties())
            .await;
    }
    env.publish(&job("good-last", "ok@example.com")).await;

    let envr = &env;
    eventually("6 dead letters and 7 emails", WAIT, move || async move {
        let dead = envr.depth(envr.topology.dead_queue()).await;
        (dead == 6 && envr.sink.count().await == 7).then_some(())
    })
    .await;
    let reasons = env.dead_reasons().await;
    for (_, expected) in &bad {
        assert!(
            reasons.iter().any(|r| r.contains(expected)),
            "no reason contains {expected:?}: {reasons:#?}"
        );
    }
    assert!(
        reasons.iter().all(|r| !r.contains("victim@example.com")),
        "{reasons:?}"
    );

    // Still serving.
    env.publish(&job("good-after", "ok@example.com")).await;
    eventually("an email after the bad input", WAIT, move || async move {
        (envr.sink.count().await == 8).then_some(())
    })
    .await;
    serving.stop().await;
    let ids: BTreeSet<String> = env
        .sink
        .messages(false)
        .await
        .into_iter()
        .map(|m| m.message_id)
        .collect();
    assert_eq!(ids.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_loses_and_dead_letters_nothing() {
    let env = TestEnv::new("pgdown").await;
    let pg = Proxy::start("127.0.0.1:5432").await;
    let mut settings = env.settings();
    settings.database.url = format!("postgres://postgres@{}/{}", pg.addr(), env.db_name).into();
    let serving = env.serve(settings);

    let first: Vec<_> = (0..20)
        .map(|i| job(&format!("pg-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&first).await;
    let envr = &env;
    eventually("the first emails", WAIT, move || async move {
        (envr.sink.count().await >= 5).then_some(())
    })
    .await;

    pg.down();
    let second: Vec<_> = (20..40)
        .map(|i| job(&format!("pg-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&second).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead-lettered during the outage"
    );
    pg.up();

    eventually("all 40 emails after the outage", WAIT, move || async move {
        (envr.sink.count().await >= 40).then_some(())
    })
    .await;
    serving.stop().await;
    let messages = env.sink.messages(false).await;
    let ids: BTreeSet<_> = messages.iter().map(|m| m.message_id.clone()).collect();
    assert_eq!(ids.len(), 40, "lost emails");
    assert_eq!(messages.len(), 40, "duplicate emails");
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    assert_eq!(env.depth(env.topology.send_queue()).await, 0);
}

/// `postie topology | head -0`: output into a pipe closed by the reader ends the
/// command quietly (exit 0, no panic), as Unix tools do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_output_into_a_closed_pipe_exits_quietly() {
    let env = TestEnv::new("epipe").await;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_postie"))
        .arg("topology")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.env_vars())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn postie");
    // The reader goes away before postie has printed anything (it declares first).
    drop(child.stdout.take());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

/// `postie serve 2> file`: logs that go to a pipe or a file carry no ANSI colour
/// codes (colour is for terminals only). The last line, logged as postie exits,
/// reaches the pipe although a thread of postie's own writes the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_into_a_pipe_carry_no_colour_codes() {
    let env = TestEnv::new("nocolour").await;
    let mut serve = env.spawn_process(&[("RUST_LOG", "debug,lapin=off")]);
    let served = &serve;
    eventually(
        "postie serve to log that it serves",
        WAIT,
        move || async move { served.log().contains("postie serving").then_some(()) },
    )
    .await;
    let status = serve.terminate(WAIT);
    assert!(status.is_some_and(|s| s.success()), "{}", serve.log());
    let served = &serve;
    let log = eventually("postie to log that it stopped", WAIT, move || async move {
        let log = served.log();
        log.contains("postie stopped").then_some(log)
    })
    .await;
    assert!(
        !log.contains('\u{1b}'),
        "ESC (ANSI colour) in a log written to a pipe:\n{log}"
    );
}
