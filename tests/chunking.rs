//! BDAT (RFC 3030, `smtp.chunking`) against the SMTP test server started with
//! `--chunking`, a real broker and PostgreSQL: an email for one recipient goes as
//! MAIL FROM, RCPT TO, `BDAT <size> LAST` and the body in one write.
//!
//! - Emails for one recipient arrive in one chunk, once each, their text as written;
//!   an email for two recipients takes the DATA path; `smtp.chunking = false` too.
//! - A refusal at each step (MAIL, RCPT, BDAT, after the chunk) means the relay took
//!   nothing: retried or dead-lettered as after DATA, never sent twice.
//! - Silence at each step (a dropped connection, a hang) after the write is uncertain:
//!   the job is tried again on the same relay and is sent; a second copy arrives only
//!   where the relay recorded the first, the duplicate README's "one duplicate postie
//!   cannot rule out" names.
//! - A refused recipient of two: the attempt with both delivers nothing; the retry
//!   sends to the other alone.
//! - A pooled connection the relay closed costs no attempt.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

/// A world whose relay takes BDAT.
async fn chunking_env(name: &str) -> TestEnv {
    TestEnv::with_sink(name, &["--chunking"]).await
}

/// Serves `env` in-process until `what` holds, then stops.
async fn serve_until<F, Fut>(env: &TestEnv, settings: postie::config::Settings, what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let serving = env.serve(settings);
    eventually(what, WAIT, || {
        let fut = done();
        async move { fut.await.then_some(()) }
    })
    .await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_emails_for_one_recipient_go_in_one_chunk_each_as_written() {
    let env = chunking_env("chsend").await;
    let keys: Vec<String> = (0..20).map(|i| format!("ch-send-{i}")).collect();
    let mut jobs: Vec<Value> = keys.iter().map(|k| job(k, "c@example.com")).collect();
    let mut dotted = job("ch-dots", "d@example.com");
    dotted["text"] = json!(".first\n..second\nmiddle\n.\nlast.");
    jobs.push(dotted);
    let mut two = job("ch-two", "a@example.com");
    two["to"] = json!(["a@example.com", "b@example.com"]);
    jobs.push(two);
    env.publish_many(&jobs).await;
    serve_until(&env, env.settings(), "every email", || async {
        env.sink.count().await == jobs.len()
    })
    .await;
    let messages = env.sink.messages(true).await;
    for message in &messages {
        let two = message.message_id == message_id("ch-two");
        assert_eq!(
            message.chunked, !two,
            "one recipient goes in a chunk, two after DATA: {message:?}"
        );
    }
    let per_id = env.emails_per_id().await;
    for key in keys.iter().map(String::as_str).chain(["ch-dots", "ch-two"]) {
        assert_eq!(per_id.get(&message_id(key)), Some(&1), "{key}");
        let row = env.inbox_row(key).await.unwrap();
        assert_eq!((row.status.as_str(), row.attempts), ("sent", 1), "{key}");
    }
    let dotted = messages
        .iter()
        .find(|m| m.message_id == message_id("ch-dots"))
        .unwrap();
    let raw = dotted.raw.clone().unwrap();
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(
        body.trim_end(),
        ".first\r\n..second\r\nmiddle\r\n.\r\nlast.",
        "raw message:\n{raw}"
    );
    assert!(env.take_dead_letters().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_smtp_chunking_false_sends_after_data() {
    let env = chunking_env("choff").await;
    env.publish(&job("ch-off", "o@example.com")).await;
    let mut settings = env.settings();
    settings.smtp.chunking = false;
    serve_until(&env, settings, "the email", || async {
        env.sink.count().await == 1
    })
    .await;
    let messages = env.sink.messages(false).await;
    assert!(!messages[0].chunked, "{messages:?}");
}

/// One job for `to` while the relay applies `rule`; waits for `done` (emails at the
/// relay, dead letters) and returns the world for the test's assertions.
async fn one_job_under(name: &str, to: &str, rule: Value, done: Done) -> TestEnv {
    let env = chunking_env(name).await;
    env.sink.set_faults(json!([rule])).await;
    env.publish(&job(name, to)).await;
    serve_until(&env, env.settings(), "the job's end", || async {
        match done {
            Done::Emails(n) => env.sink.count().await >= n && sent(&env, name).await,
            Done::Dead => env.depth(env.topology.dead_queue()).await == 1,
        }
    })
    .await;
    // Room for a late second copy, the failure these tests are about.
    tokio::time::sleep(Duration::from_secs(2)).await;
    env
}

#[derive(Clone, Copy)]
enum Done {
    /// This many emails at the relay and the job recorded sent.
    Emails(usize),
    /// One dead letter.
    Dead,
}

async fn sent(env: &TestEnv, key: &str) -> bool {
    env.inbox_row(key)
        .await
        .is_some_and(|row| row.status == "sent")
}

/// A refusal before the chunk is taken: tried again, sent once, one attempt more.
async fn refused_then_sent(name: &str, stage: &str) {
    let reply = "451 4.3.0 local error in processing";
    let rule = json!({"stage": stage, "action": {"reply": reply}, "times": 1});
    let env = one_job_under(name, "r@example.com", rule, Done::Emails(1)).await;
    assert_eq!(
        env.sink.count().await,
        1,
        "sent once after a 451 at {stage}"
    );
    let row = env.inbox_row(name).await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 2), "{row:?}");
    assert!(env.sink.messages(false).await[0].chunked);
    assert!(env.take_dead_letters().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_451_to_mail_is_retried_and_sent_once() {
    refused_then_sent("ch-mail451", "mail").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_451_to_bdat_is_retried_and_sent_once() {
    refused_then_sent("ch-bdat451", "data").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_451_after_the_chunk_is_retried_and_sent_once() {
    refused_then_sent("ch-end451", "data_end").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_refused_recipient_dead_letters_and_nothing_is_delivered() {
    let rule = json!({"stage": "rcpt", "action": {"reply": "550 5.1.1 no such user"}});
    let env = one_job_under("ch-rcpt550", "nobody@example.com", rule, Done::Dead).await;
    let dead = env.take_dead_letters().await;
    assert!(dead[0].reason().contains("550"), "{}", dead[0].reason());
    let row = env.inbox_row("ch-rcpt550").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("dead", 1));
    assert_eq!(env.sink.count().await, 0, "the chunk after a refused RCPT");
}

/// Two recipients, one refused for good: the attempt with both delivers nothing (it
/// went after DATA, never as a chunk), and the retry, the refused one now suppressed,
/// sends it to the other alone, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_refused_recipient_of_two_lets_nothing_through_to_the_other() {
    let env = chunking_env("chtwo550").await;
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.1.1 no such user"}}]))
        .await;
    let key = "ch-two550";
    let mut two = job(key, "ok@example.com");
    two["to"] = json!(["ok@example.com", "nobody@example.com"]);
    env.publish(&two).await;
    serve_until(&env, env.settings(), "the job sent", || async {
        sent(&env, key).await
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let messages = env.sink.messages(false).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].rcpt_to, ["ok@example.com"], "{messages:?}");
    let row = env.inbox_row(key).await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 2), "{row:?}");
    assert!(env.take_dead_letters().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_permanent_refusal_after_the_chunk_dead_letters() {
    let rule = json!({"stage": "data_end", "action": {"reply": "554 5.6.0 rejected"}});
    let env = one_job_under("ch-end554", "p@example.com", rule, Done::Dead).await;
    assert_eq!(env.sink.count().await, 0);
    let row = env.inbox_row("ch-end554").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("dead", 1));
}

/// Silence after the write: uncertain, tried again on the same relay and sent;
/// `copies` emails arrive with the job's Message-ID (2 only where the relay recorded
/// the first), and nothing is dead.
async fn silent_then_sent(name: &str, rule: Value, copies: usize) {
    let env = one_job_under(name, "s@example.com", rule, Done::Emails(copies)).await;
    assert_eq!(
        env.emails_per_id().await.get(&message_id(name)),
        Some(&copies)
    );
    assert_eq!(env.inbox_row(name).await.unwrap().status, "sent");
    assert!(env.take_dead_letters().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_connection_dropped_at_bdat_is_tried_again_and_sent_once() {
    let rule = json!({"stage": "data", "action": {"drop": true}, "times": 1});
    silent_then_sent("ch-bdatdrop", rule, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_relay_hung_at_rcpt_is_tried_again_and_sent_once() {
    let rule = json!({"stage": "rcpt", "action": {"hang": true}, "times": 1});
    silent_then_sent("ch-rcpthang", rule, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_relay_hung_after_the_chunk_is_tried_again_and_sent_once() {
    let rule = json!({"stage": "data_end", "action": {"hang": true}, "times": 1});
    silent_then_sent("ch-endhang", rule, 1).await;
}

/// The relay records the email and the connection drops before its 250: uncertain,
/// tried again on the same relay, so it arrives twice with one Message-ID (the one
/// duplicate postie cannot rule out), and the job is sent, not dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_reply_lost_after_the_relay_took_the_email_is_uncertain_and_tried_again() {
    let rule = json!({"stage": "data_end", "action": {"drop": true, "deliver": true}, "times": 1});
    silent_then_sent("ch-lost250", rule, 2).await;
}

/// A pooled connection the relay closed since its last email (reused within 2 s,
/// without a NOOP): MAIL FROM meets the closed connection and the email goes at once
/// on a new one, one attempt, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ch_a_pooled_connection_the_relay_closed_costs_no_attempt() {
    let env = chunking_env("chstale").await;
    let serving = env.serve(env.settings());
    env.publish(&job("ch-stale-1", "a@example.com")).await;
    env.wait_for_emails("the first email", 1, WAIT).await;
    env.sink
        .set_faults(json!([{"stage": "mail", "action": {"drop": true}, "times": 1}]))
        .await;
    env.publish(&job("ch-stale-2", "b@example.com")).await;
    env.wait_for_emails("the second email", 2, WAIT).await;
    let envr = &env;
    eventually("the second recorded", WAIT, || async move {
        sent(envr, "ch-stale-2").await.then_some(())
    })
    .await;
    serving.stop().await;
    let row = env.inbox_row("ch-stale-2").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 1), "{row:?}");
    assert_eq!(env.sink.stats().await.connections, 2);
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.get(&message_id("ch-stale-2")), Some(&1));
}
