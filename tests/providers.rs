//! Provider APIs (issue 29) end to end: a real RabbitMQ, a real PostgreSQL and the
//! provider test server (tests/provider-server, a real HTTP process) speaking Amazon
//! SES v2, SendGrid v3, Postmark and Mailgun.
//!
//! - each provider: `POSTIE_PROVIDER_JOBS` jobs (500 by default) sent, the server
//!   received exactly one request per key, with postie's Message-ID and the job's
//!   header; every inbox row sent and naming the provider and the id it answered
//!   with; no dead letter;
//! - a 40/s quota answered with each provider's 429: everything sent, nothing dead;
//! - each provider's permanent rejections (invalid recipient, account suspended):
//!   dead letters whose reason carries the provider's own text;
//! - 5xx, a hang after the request was read, and a slow reply: retried (or waited
//!   for) and sent once; a reply without end read only up to postie's bound, then
//!   retried; refused credentials: nothing dead-lettered;
//! - the keys never reach postie's log (a `postie serve` process at debug level).
//!
//! Each test prints a `FIGURES` line (run with `--nocapture`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use secrecy::SecretString;
use serde_json::{json, Value};
use support::providers::{
    ProviderServer, MAILGUN_KEY, POSTMARK_TOKEN, PROVIDERS, SENDGRID_KEY, SES_SECRET,
};
use support::{eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(90);

fn jobs() -> usize {
    support::bench::env_usize("POSTIE_PROVIDER_JOBS", 500)
}

/// Inbox rows matching `condition`, or -1 while the table is not there yet (postie
/// migrates when it starts).
async fn rows(env: &TestEnv, condition: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM postie_inbox WHERE {condition}");
    match env.db().await.query_one(&sql, &[]).await {
        Ok(row) => row.get(0),
        Err(_) => -1,
    }
}

/// A job with a header of its own (checked at the server) and both bodies.
fn rich_job(key: &str, to: &str) -> Value {
    let mut body = job(key, to);
    body["html"] = json!(format!("<p>Hello about {key}</p>"));
    body["headers"] = json!({ "X-Campaign": "p29" });
    body
}

/// A test world whose postie sends through `provider` on a fresh provider server.
async fn world(name: &str, provider: &str) -> (TestEnv, ProviderServer, postie::config::Settings) {
    let env = TestEnv::new(name).await;
    let server = ProviderServer::start().await;
    let mut settings = env.settings();
    settings.transport.url = Some(SecretString::from(server.url(provider)));
    (env, server, settings)
}

/// Publishes `n` jobs `prefix-i` and waits for the server to have accepted them all;
/// returns the keys and the seconds from the first publish.
async fn send_all(
    env: &TestEnv,
    server: &ProviderServer,
    prefix: &str,
    n: usize,
) -> (Vec<String>, f64) {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let bodies: Vec<Value> = keys
        .iter()
        .map(|k| rich_job(k, &format!("{k}@example.com")))
        .collect();
    let started = Instant::now();
    env.publish_many(&bodies).await;
    eventually(
        &format!("{n} emails at the provider server"),
        WAIT,
        || async { (server.stats().await.accepted >= n as u64).then_some(()) },
    )
    .await;
    (keys, started.elapsed().as_secs_f64())
}

/// Exactly one accepted request per key, each with the key's Message-ID.
async fn assert_once_each(server: &ProviderServer, keys: &[String]) {
    let messages = server.messages(false).await;
    let mut per_id: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &messages {
        *per_id.entry(m.message_id.as_str()).or_default() += 1;
    }
    let expected: BTreeSet<String> = keys.iter().map(|k| message_id(k)).collect();
    let got: BTreeSet<String> = per_id.keys().map(|s| s.to_string()).collect();
    assert_eq!(got, expected, "lost or unexpected Message-IDs");
    let repeated: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "sent more than once: {repeated:?}");
    assert_eq!(messages.len(), keys.len());
    let ids: BTreeSet<&str> = messages.iter().map(|m| m.provider_id.as_str()).collect();
    assert_eq!(ids.len(), keys.len(), "the server's ids are unique");
}

async fn bulk(provider: &str) {
    let n = jobs();
    let (env, server, settings) = world(&format!("prov-{provider}"), provider).await;
    let serving = env.serve(settings);
    let (keys, seconds) = send_all(&env, &server, provider, n).await;
    // A moment for the last records to land, and for any duplicate to show.
    let envr = &env;
    eventually("every inbox row sent", WAIT, || async move {
        (rows(envr, "status = 'sent'").await == n as i64).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    serving.stop().await;
    assert_once_each(&server, &keys).await;
    // The inbox names the provider and the id it answered with, for each key.
    let recorded: BTreeMap<String, (String, String)> = env
        .db()
        .await
        .query(
            "SELECT message_id, provider, provider_message_id FROM postie_inbox",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    for m in server.messages(false).await {
        assert_eq!(
            recorded.get(&m.message_id),
            Some(&(provider.to_string(), m.provider_id.clone())),
            "{provider}: the inbox records who sent {} and the provider's id",
            m.message_id
        );
    }
    let sample = server.messages(true).await;
    let first = &sample[0];
    assert!(
        first.raw.contains("X-Campaign"),
        "the job's header: {}",
        first.raw
    );
    assert!(first.raw.contains("Hello about"), "the body: {}", first.raw);
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    assert_eq!(env.inbox_count("attempts > 1").await, 0);
    let stats = server.stats().await;
    eprintln!(
        "FIGURES providers {provider}: {n} jobs sent in {seconds:.1}s ({:.0} emails/s), {} requests, {} accepted, 0 duplicates, 0 dead",
        n as f64 / seconds,
        stats.requests,
        stats.accepted
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ses_sends_each_job_once_with_postie_s_message_id() {
    bulk("ses").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sendgrid_sends_each_job_once_with_postie_s_message_id() {
    bulk("sendgrid").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postmark_sends_each_job_once_with_postie_s_message_id() {
    bulk("postmark").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mailgun_sends_each_job_once_with_postie_s_message_id() {
    bulk("mailgun").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_answered_with_429_sends_everything_and_dead_letters_nothing() {
    const QUOTA: u32 = 40;
    const N: usize = 120;
    let mut figures = Vec::new();
    for provider in PROVIDERS {
        let (env, server, settings) = world(&format!("quota-{provider}"), provider).await;
        server.set_quota(Some(QUOTA)).await;
        let serving = env.serve(settings);
        let (keys, seconds) = send_all(&env, &server, provider, N).await;
        let envr = &env;
        eventually("every inbox row sent", WAIT, || async move {
            (rows(envr, "status = 'sent'").await == N as i64).then_some(())
        })
        .await;
        serving.stop().await;
        assert_once_each(&server, &keys).await;
        let stats = server.stats().await;
        assert!(
            stats.throttled > 0,
            "{provider}: the quota never answered 429"
        );
        assert_eq!(env.depth(env.topology.dead_queue()).await, 0, "{provider}");
        assert_eq!(env.inbox_count("status = 'dead'").await, 0, "{provider}");
        // A throttle is not the job's fault: no attempt counted for it.
        let retried = env.inbox_count("attempts > 1").await;
        assert_eq!(retried, 0, "{provider}: attempts counted for throttles");
        figures.push(format!(
            "{provider} {N} in {seconds:.1}s ({:.1}/s, minimum {:.1}s), 429 replies {}",
            N as f64 / seconds,
            N as f64 / QUOTA as f64,
            stats.throttled
        ));
    }
    eprintln!(
        "FIGURES providers quota {QUOTA}/s: {}; dead 0",
        figures.join("; ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_rejections_dead_letter_with_the_provider_s_text() {
    let expected = [
        (
            "ses",
            "AccountSuspendedException",
            "MessageRejected: Email address is not verified",
        ),
        (
            "sendgrid",
            "Your account has been suspended",
            "Does not contain a valid address.",
        ),
        (
            "postmark",
            "ErrorCode 412",
            "ErrorCode 406: You tried to send to recipient(s) that have been marked as inactive",
        ),
        (
            "mailgun",
            "account is disabled",
            "to parameter is not a valid address",
        ),
    ];
    let mut figures = Vec::new();
    for (provider, suspended, invalid) in expected {
        let (env, server, settings) = world(&format!("perm-{provider}"), provider).await;
        server
            .set_faults(json!([
                {"to_contains": "suspended", "action": {"suspended": true}},
                {"to_contains": "invalid", "action": {"reject": true}}
            ]))
            .await;
        let serving = env.serve(settings);
        env.publish(&job("k-suspended", "suspended@example.com"))
            .await;
        env.publish(&job("k-invalid", "invalid@example.com")).await;
        env.publish(&job("k-fine", "fine@example.com")).await;
        let envr = &env;
        eventually("two dead letters and one email", WAIT, || async move {
            let dead = envr.depth(envr.topology.dead_queue()).await;
            let sent = rows(envr, "status = 'sent'").await;
            (dead == 2 && sent == 1).then_some(())
        })
        .await;
        serving.stop().await;
        let dead = env.take_dead_letters().await;
        let reasons: BTreeMap<String, String> = dead
            .iter()
            .map(|d| {
                let body: Value = serde_json::from_slice(&d.body).unwrap();
                (
                    body["key"].as_str().unwrap().to_string(),
                    d.reason().to_string(),
                )
            })
            .collect();
        let reason = |key: &str| reasons.get(key).cloned().unwrap_or_default();
        assert!(
            reason("k-suspended").contains(suspended),
            "{provider}: {reasons:?}"
        );
        assert!(
            reason("k-invalid").contains(invalid),
            "{provider}: {reasons:?}"
        );
        for letter in &dead {
            assert_eq!(
                letter.headers.get("postie-dead-kind").map(String::as_str),
                Some("permanent"),
                "{provider}"
            );
        }
        assert_eq!(env.inbox_row("k-suspended").await.unwrap().attempts, 1);
        let messages = server.messages(false).await;
        assert_eq!(messages.len(), 1, "{provider}");
        assert_eq!(messages[0].message_id, message_id("k-fine"));
        figures.push(format!("{provider}: {:?}", reason("k-suspended")));
    }
    eprintln!(
        "FIGURES providers permanent: 8 dead letters, 4 sent; {}",
        figures.join("; ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_hangs_and_slow_replies_are_retried_or_waited_for_and_sent_once() {
    let mut figures = Vec::new();
    for provider in PROVIDERS {
        let (env, server, settings) = world(&format!("flaky-{provider}"), provider).await;
        server
            .set_faults(json!([
                {"to_contains": "busy", "action": {"status": 503}, "times": 2},
                {"to_contains": "hang", "action": {"hang": true}, "times": 1},
                {"to_contains": "slow", "action": {"delay_ms": 700}}
            ]))
            .await;
        let serving = env.serve(settings);
        for key in ["busy", "hang", "slow"] {
            env.publish(&job(&format!("k-{key}"), &format!("{key}@example.com")))
                .await;
        }
        let envr = &env;
        eventually("three sent", WAIT, || async move {
            (rows(envr, "status = 'sent'").await == 3).then_some(())
        })
        .await;
        serving.stop().await;
        let attempts =
            |key: &'static str| async move { envr.inbox_row(key).await.unwrap().attempts };
        assert_eq!(
            attempts("k-busy").await,
            3,
            "{provider}: two 503s, then sent"
        );
        assert_eq!(
            attempts("k-hang").await,
            2,
            "{provider}: the hang timed out, then sent"
        );
        assert_eq!(
            attempts("k-slow").await,
            1,
            "{provider}: a slow reply within transport.timeout"
        );
        let stats = server.stats().await;
        assert_eq!(
            (stats.accepted, stats.server_errors, stats.hung),
            (3, 2, 1),
            "{provider}"
        );
        let keys: Vec<String> = ["k-busy", "k-hang", "k-slow"].map(String::from).to_vec();
        assert_once_each(&server, &keys).await;
        assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
        figures.push(format!("{provider} ok"));
    }
    eprintln!(
        "FIGURES providers faults: 503 x2, hang x1, 700 ms replies: {}",
        figures.join(", ")
    );
}

/// A provider (or whatever answers at its address) that sends a reply without end:
/// postie reads no more than its bound (64 KiB, `mail::api::MAX_REPLY_BYTES`), counts
/// the send as uncertain (the request may have been accepted: retried on the same
/// provider, no attempt on another), and sends the job on the next try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_reply_is_read_only_up_to_its_bound_and_the_send_retried() {
    let (env, server, settings) = world("endless", "sendgrid").await;
    server
        .set_faults(
            json!([{"to_contains": "endless", "action": {"endless_reply": true}, "times": 1}]),
        )
        .await;
    let serving = env.serve(settings);
    env.publish(&job("k-endless", "endless@example.com")).await;
    let envr = &env;
    let error = eventually("the first try's failure", WAIT, || async move {
        let row = envr.inbox_row("k-endless").await?;
        (row.status == "retrying").then_some(row.last_error.unwrap_or_default())
    })
    .await;
    let written = server.stats().await.reply_bytes;
    eprintln!("FIGURES endless reply: {written} bytes written before postie hung up; {error}");
    assert!(
        error.contains("longer than 65536 bytes") && error.contains("may have been accepted"),
        "{error}"
    );
    // What the server could push: the bound, the sockets' buffers and a chunk or two,
    // never what a whole `transport.timeout` of reading would take.
    assert!(written < 16 << 20, "{written} bytes were written");
    eventually("the retry sent", WAIT, || async move {
        (rows(envr, "status = 'sent'").await == 1).then_some(())
    })
    .await;
    serving.stop().await;
    let stats = server.stats().await;
    assert_eq!((stats.endless, stats.accepted), (1, 1));
    assert_eq!(env.inbox_row("k-endless").await.unwrap().attempts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_dead_letter_nothing_and_keys_never_reach_the_log() {
    let server = ProviderServer::start().await;
    let mut figures = Vec::new();
    for provider in PROVIDERS {
        let env = TestEnv::new(&format!("keys-{provider}")).await;
        // A wrong key first: nothing may be dead-lettered for postie's own set-up.
        let wrong = server.url_with_keys(provider, false);
        let mut postie =
            env.spawn_process(&[("POSTIE__TRANSPORT__URL", &wrong), ("RUST_LOG", "debug")]);
        env.publish(&job(&format!("{provider}-wrong"), "a@example.com"))
            .await;
        let before = server.stats().await.auth_failed;
        let envr = &env;
        let server = &server;
        eventually("a refused request", WAIT, || async move {
            (server.stats().await.auth_failed > before).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            envr.depth(envr.topology.dead_queue()).await,
            0,
            "{provider}"
        );
        // Held for a dependency that refuses it, the delivery would keep a SIGTERM
        // waiting for `drain_timeout`: killed instead (the log is read to its end).
        postie.kill9();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut log = postie.log();
        // The right key, from the environment this time (so that no scrubbing of the
        // URL's password can hide a leak): sent, and the debug log names the id.
        let (url, vars) = server.url_and_env(provider);
        let mut extra: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        extra.extend([
            ("POSTIE__TRANSPORT__URL", url.as_str()),
            ("RUST_LOG", "debug"),
        ]);
        let mut postie = env.spawn_process(&extra);
        env.wait_for_status(&format!("{provider}-wrong"), "sent", WAIT)
            .await;
        postie.terminate(Duration::from_secs(20));
        log.push_str(&postie.log());
        for secret in [
            SES_SECRET,
            SENDGRID_KEY,
            POSTMARK_TOKEN,
            MAILGUN_KEY,
            "sendgrid-key-wrong",
        ] {
            assert!(!log.contains(secret), "{provider}: a key in the log");
        }
        assert!(!log.contains(&SES_SECRET.replace('/', "%2F")), "{provider}");
        assert!(
            log.contains("provider_message_id"),
            "{provider}: no provider id in\n{log}"
        );
        figures.push(format!("{provider} {} lines", log.lines().count()));
    }
    eprintln!(
        "FIGURES providers secrets: no key in the log ({})",
        figures.join(", ")
    );
}
