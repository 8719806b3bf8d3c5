//! postie's headers are postie's (issue 45, item 4): a producer may set `x-delay`,
//! `postie-published-at` and `traceparent`, and every other `postie-*` header on its
//! publish is dropped at intake unless postie sealed it (`headers::Seal`). Each test
//! forges one of postie's own headers on a producer's publish and checks that it
//! steers nothing: not the tenant cap (`postie-tenant-slot`), not the provider
//! (`postie-provider`, through `<p>.delayed` and straight into `<p>.work`, the door a
//! producer with write rights on it has, and the way a plugin-mode job reaches the
//! worker without the relay), not the retry budget (`postie-attempt`). postie's own
//! copies keep theirs: the tenant test's jobs without the header are paced by their
//! slots, which a deferred copy carries through the ladder.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable, LongString};
use postie::testing::broker;
use serde_json::json;
use support::sink::SmtpSink;
use support::{eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

/// Job properties with one extra header.
fn with_header(name: &str, value: AMQPValue) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(name.into(), value);
    broker::job_properties().with_headers(headers)
}

/// Emails per key prefix among the sink's messages.
async fn per_prefix(sink: &SmtpSink, keys: &BTreeMap<String, String>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for message in sink.messages(false).await {
        if let Some(key) = keys.get(&message.message_id) {
            let prefix = key.split('-').next().unwrap_or_default().to_string();
            *counts.entry(prefix).or_default() += 1;
        }
    }
    counts
}

/// The scenario: a tenant cap of 2/s, 40 jobs with `postie-tenant-slot: 1`
/// and 40 of another tenant without it, published at once. Before the fix the forged
/// ones skipped the cap (all 40 within 6 s, the others 13); now both are paced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_tenant_slot_is_paced_like_a_job_without_one() {
    let env = TestEnv::with_settings(
        "intake-tenant",
        &[
            ("POSTIE__TOPOLOGY__DEFAULT_LANE", "mail"),
            ("POSTIE__TOPOLOGY__LANES__MAIL__TENANT_RATE_LIMIT", "2/s"),
        ],
    )
    .await;
    let serving = env.serve(env.settings());
    const N: usize = 40;
    let mut keys = BTreeMap::new();
    let mut jobs = Vec::new();
    for i in 0..N {
        for (tenant, forged) in [("forged", true), ("plain", false)] {
            let key = format!("{tenant}-{i}");
            let mut body = job(&key, "t@example.com");
            body["tenant"] = tenant.into();
            let properties = match forged {
                true => with_header("postie-tenant-slot", AMQPValue::LongLongInt(1)),
                false => broker::job_properties(),
            };
            keys.insert(message_id(&key), key);
            jobs.push((body, properties));
        }
    }
    env.publish_many_with(&jobs).await;
    // Six seconds from the first email, whenever the instance is up.
    eventually("the first emails", WAIT, || async {
        (env.sink.count().await > 0).then_some(())
    })
    .await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let counts = per_prefix(&env.sink, &keys).await;
    let (forged, plain) = (counts.get("forged"), counts.get("plain"));
    let (forged, plain) = (forged.copied().unwrap_or(0), plain.copied().unwrap_or(0));
    println!(
        "FIGURES tenant cap 2/s, {N} jobs each, in the {:.1} s from the first email: with a forged postie-tenant-slot {forged}, without {plain}",
        started.elapsed().as_secs_f64()
    );
    // 2/s for 6 s and a second's burst: about 13 each. A forged slot skipped the cap
    // and sent all 40 in that time.
    assert!(
        forged <= plain + 4 && forged <= 20,
        "the forged slot skipped the tenant cap: {forged} sent in 6 s, {plain} without it"
    );
    // postie's own slots still hold across the ladder: a deferred job is not deferred
    // again when its slot comes (it would be, for ever, if its sealed slot were lost).
    assert!(
        plain >= 6,
        "jobs deferred to their slots did not come back: {plain} in 6 s"
    );
    serving.stop().await;
}

/// `postie-provider: second` on a producer's publish, through the contract exchange
/// and straight into `<p>.work`: both sent by the first provider, which is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_provider_pin_is_ignored_at_every_door() {
    let second = SmtpSink::start().await;
    let env = TestEnv::new("intake-provider").await;
    let providers = format!(
        "{}?name=first,{}?name=second",
        env.sink.smtp_url(),
        second.smtp_url()
    );
    let mut vars: std::collections::HashMap<String, String> = env.env_vars().into_iter().collect();
    vars.remove("POSTIE__TRANSPORT__URL");
    vars.insert("POSTIE__TRANSPORT__PROVIDERS".into(), providers);
    let settings = postie::config::Settings::load_from(None, Some(vars)).expect("valid settings");
    let serving = env.serve(settings);
    let pinned = || {
        with_header(
            "postie-provider",
            AMQPValue::LongString(LongString::from("second")),
        )
    };
    let through_intake = job("pin-intake", "p@example.com");
    env.publish_raw(through_intake.to_string().as_bytes(), pinned())
        .await;
    // The other door: a producer allowed to write to `<p>.work` reaches the worker
    // without the relay, as every job does in plugin mode.
    let addresses = postie::config::AmqpAddresses::parse(&env.amqp_url.clone().into()).unwrap();
    let conn = broker::connect(&addresses, "intake-test", Duration::from_secs(10))
        .await
        .expect("RabbitMQ for tests")
        .connection;
    let channel = broker::confirm_channel(&conn).await.unwrap();
    let straight = job("pin-work", "p@example.com");
    broker::publish_confirmed(
        &channel,
        env.topology.work_exchange(),
        broker::ROUTING_KEY,
        true,
        straight.to_string().as_bytes(),
        pinned(),
    )
    .await
    .expect("published to the work exchange");
    eventually("both emails", WAIT, || async {
        (env.sink.count().await + second.count().await >= 2).then_some(())
    })
    .await;
    let ids = |messages: Vec<support::sink::SinkMessage>| -> Vec<String> {
        messages.into_iter().map(|m| m.message_id).collect()
    };
    let (by_first, by_second) = (
        ids(env.sink.messages(false).await),
        ids(second.messages(false).await),
    );
    println!("FIGURES forged postie-provider: first sent {by_first:?}, second {by_second:?}");
    assert!(
        by_second.is_empty(),
        "a producer's postie-provider chose the provider: {by_second:?}"
    );
    let mut expected = vec![message_id("pin-intake"), message_id("pin-work")];
    let mut by_first = by_first;
    by_first.sort();
    expected.sort();
    assert_eq!(by_first, expected, "both sent once, by the first provider");
    let _ = conn.close(200, "done".into()).await;
    serving.stop().await;
}

/// `postie-attempt` forged at the last step: one 450 would dead-letter the job as
/// out of retries. The forged count is dropped, so it is retried and sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_attempt_count_spends_none_of_the_jobs_retries() {
    let env = TestEnv::new("intake-attempt").await;
    env.sink
        .set_faults(json!([{
            "stage": "rcpt",
            "rcpt_contains": "forged-attempt",
            "action": {"reply": "450 4.2.1 mailbox busy"},
            "times": 1
        }]))
        .await;
    let serving = env.serve(env.settings());
    // The test world has three retry steps (1s, 2s, 5s): 3 attempts made already.
    let body = job("attempt-forged", "forged-attempt@example.com");
    env.publish_raw(
        body.to_string().as_bytes(),
        with_header("postie-attempt", AMQPValue::LongLongInt(3)),
    )
    .await;
    let outcome = eventually("the job sent or dead-lettered", WAIT, || async {
        if env.sink.count().await > 0 {
            return Some("sent".to_string());
        }
        let row = env.inbox_row("attempt-forged").await?;
        (row.status == "dead").then(|| format!("dead: {:?}", row.last_error))
    })
    .await;
    println!("FIGURES forged postie-attempt 3 of 3, then one 450: {outcome}");
    assert_eq!(
        outcome, "sent",
        "the forged attempt count spent the job's retries"
    );
    let dead: Vec<String> = (env.take_dead_letters().await.iter())
        .map(|letter| letter.reason().to_string())
        .collect();
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");
    serving.stop().await;
}
