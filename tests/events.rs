//! Delivery events (issue 30, item 5) end to end: a real RabbitMQ, PostgreSQL and the
//! SMTP test server; the events read from a queue of the test's own bound to
//! `<p>.events`, as a producer would.
//!
//! - one job of each outcome (sent, dead after `550 5.7.1`, suppressed, cancelled
//!   before it was due, before it existed and while it was being sent, throttled by
//!   its type's drop policy)
//!   and a bounce written through `inbox::record_event` as the feedback ingestion
//!   will: one event each, with its routing key and fields, valid against
//!   `schema/email-event.v1.json`;
//! - 1,000 jobs (5 % to addresses the sink refuses with `550 5.1.1`) on three
//!   `postie serve` processes, one killed with -9 mid-run: an event for every key,
//!   exactly one event id per (key, outcome) (a dead job the killed instance
//!   recorded but did not ack is recorded again without a second event), and
//!   duplicates by event id only within the documented crash window (the killed
//!   instance's batch in flight). Prints the events per second and the time from
//!   outcome to event;
//! - the same outcome recorded twice for a key (a redelivery after a crash, a
//!   replay that fails again) writes one event; another outcome after it (a replay
//!   that is sent) writes its own.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postie::config::{ThrottlePolicy, ThrottleRule};
use postie::testing::ops::metrics::EventOutcome;
use serde_json::{json, Value};
use support::tap::{check_each, key_outcome, Received, Tap};
use support::{delayed_properties, eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(90);

fn typed(key: &str, to: &str, kind: &str) -> Value {
    let mut body = job(key, to);
    body["type"] = json!(kind);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_one_per_outcome_with_its_fields() {
    let env = TestEnv::new("events-out").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "policy", "action": {"reply": "550 5.7.1 rejected by policy"}}
        ]))
        .await;
    let tap = Tap::new(&env).await;
    env.postie(&["suppression", "add", "blocked@example.com"])
        .expect("suppression add");
    let mut settings = env.settings();
    settings.throttle.insert(
        "promo".into(),
        ThrottleRule {
            limit: 1,
            window: Duration::from_secs(3600),
            policy: ThrottlePolicy::Drop,
        },
    );
    let serving = env.serve(settings);

    env.publish(&typed("ev-sent", "ok@example.com", "receipt"))
        .await;
    env.publish(&typed("ev-dead", "policy@example.com", "order.shipped"))
        .await;
    env.publish(&job("ev-suppressed", "blocked@example.com"))
        .await;
    env.publish(&typed("ev-promo-1", "p@example.com", "promo"))
        .await;
    env.wait_for_status("ev-promo-1", "sent", WAIT).await;
    // Cancelled while it was being sent, then the send failed: `retrying`, with the
    // cancel on record. Its next delivery's claim answers `cancelled`, and ends it.
    env.db()
        .await
        .execute(
            "INSERT INTO postie_inbox (key, status, revision, cancelled_through, cancelled_at,
                                       attempts, last_error)
             VALUES ('ev-late-cancel', 'retrying', 0, 0, now(), 1, '451 try later')",
            &[],
        )
        .await
        .unwrap();
    env.publish(&typed("ev-late-cancel", "l@example.com", "reminder"))
        .await;
    env.wait_for_status("ev-late-cancel", "cancelled", WAIT)
        .await;
    env.publish(&typed("ev-promo-2", "p@example.com", "promo"))
        .await;
    // Cancelled while scheduled (ladder mode), and before its job existed.
    let now = chrono::Utc::now().timestamp_millis();
    env.publish_raw(
        typed("ev-cancel", "c@example.com", "reminder")
            .to_string()
            .as_bytes(),
        delayed_properties(60_000, now),
    )
    .await;
    env.wait_for_status("ev-cancel", "scheduled", WAIT).await;
    env.publish(&json!({"cancel": "ev-cancel"})).await;
    env.publish(&json!({"cancel": "ev-tombstone"})).await;
    env.wait_for_status("ev-tombstone", "cancelled", WAIT).await;
    env.wait_for_status("ev-sent", "sent", WAIT).await;

    // A bounce, written as the feedback ingestion writes it: in its transaction.
    let mut db = env.db().await;
    let tx = db.transaction().await.unwrap();
    let written = postie::testing::inbox::record_event(
        &tx,
        "ev-sent",
        EventOutcome::Bounced,
        Some("5.1.1 by DSN"),
    )
    .await
    .unwrap();
    assert!(written);
    tx.commit().await.unwrap();

    let expected: BTreeSet<(String, String)> = [
        ("ev-sent", "sent"),
        ("ev-dead", "dead"),
        ("ev-suppressed", "suppressed"),
        ("ev-promo-1", "sent"),
        ("ev-promo-2", "throttled"),
        ("ev-cancel", "cancelled"),
        ("ev-tombstone", "cancelled"),
        ("ev-late-cancel", "cancelled"),
        ("ev-sent", "bounced"),
    ]
    .map(|(k, o)| (k.to_owned(), o.to_owned()))
    .into();
    tap.wait_for(&expected, WAIT).await;
    // Anything extra (a second event of one outcome) would arrive within this.
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;

    let events = tap.events();
    check_each(&events);
    let got: Vec<(String, String)> = events.iter().map(key_outcome).collect();
    assert_eq!(got.len(), expected.len(), "{got:?}");
    assert_eq!(got.iter().cloned().collect::<BTreeSet<_>>(), expected);
    let by: BTreeMap<(String, String), &Value> =
        events.iter().map(|e| (key_outcome(e), &e.body)).collect();
    let of = |k: &str, o: &str| by[&(k.to_owned(), o.to_owned())];

    let sent = of("ev-sent", "sent");
    assert_eq!(sent["type"], "receipt");
    assert_eq!(sent["message_id"], message_id("ev-sent"));
    assert_eq!(sent["provider"], "smtp");
    assert_eq!(sent["reason"], Value::Null);
    assert_eq!(sent["attempts"], 1);
    let routing = |k: &str, o: &str| {
        events
            .iter()
            .find(|e| key_outcome(e) == (k.to_owned(), o.to_owned()))
            .unwrap()
            .routing_key
            .clone()
    };
    assert_eq!(routing("ev-sent", "sent"), "email.sent.receipt");

    let dead = of("ev-dead", "dead");
    assert_eq!(routing("ev-dead", "dead"), "email.dead.order_shipped");
    assert_eq!(dead["type"], "order.shipped");
    assert!(dead["reason"].as_str().unwrap().contains("5.7.1"), "{dead}");
    assert_eq!(dead["message_id"], message_id("ev-dead"));

    let suppressed = of("ev-suppressed", "suppressed");
    assert_eq!(
        routing("ev-suppressed", "suppressed"),
        "email.suppressed.none"
    );
    assert!(
        suppressed["reason"].as_str().unwrap().contains("manual"),
        "{suppressed}"
    );
    assert_eq!(suppressed["attempts"], 0);

    assert_eq!(of("ev-promo-2", "throttled")["type"], "promo");
    assert_eq!(routing("ev-cancel", "cancelled"), "email.cancelled.none");
    assert_eq!(of("ev-tombstone", "cancelled")["type"], Value::Null);
    let late = of("ev-late-cancel", "cancelled");
    assert_eq!(
        routing("ev-late-cancel", "cancelled"),
        "email.cancelled.reminder"
    );
    assert_eq!(late["attempts"], 1);
    assert_eq!(late["message_id"], message_id("ev-late-cancel"));

    let bounced = of("ev-sent", "bounced");
    assert_eq!(routing("ev-sent", "bounced"), "email.bounced.receipt");
    assert_eq!(bounced["message_id"], message_id("ev-sent"));
    assert_eq!(bounced["reason"], "5.1.1 by DSN");
    // Published, then deleted: the outbox is empty.
    assert_eq!(
        env.db()
            .await
            .query_one("SELECT count(*) FROM postie_events", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0
    );
}

/// The `p`-th percentile of sorted `values`.
fn percentile(sorted: &[i64], p: usize) -> i64 {
    sorted[((sorted.len() - 1) * p / 100).min(sorted.len() - 1)]
}

fn millis(rfc3339: &Value) -> i64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339.as_str().unwrap())
        .unwrap()
        .timestamp_millis()
}

/// Waits until every key of `keys` has an event; on a timeout, fails naming the
/// keys without one and their inbox rows.
async fn wait_for_keys(env: &TestEnv, tap: &Tap, keys: &BTreeSet<String>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let seen: BTreeSet<String> = tap.events().iter().map(|e| key_outcome(e).0).collect();
        let missing: Vec<&String> = keys.difference(&seen).collect();
        if missing.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let mut rows = Vec::new();
            for key in missing.iter().take(10) {
                let row = env.inbox_row(key).await;
                rows.push(format!("{key}: {row:?}"));
            }
            let outbox: i64 = env
                .db()
                .await
                .query_one("SELECT count(*) FROM postie_events", &[])
                .await
                .unwrap()
                .get(0);
            panic!(
                "{} keys without an event after {timeout:?} ({outbox} rows in the outbox): {rows:#?}",
                missing.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_for_a_thousand_jobs_on_three_instances_across_a_kill_9() {
    let n = support::bench::env_usize("POSTIE_EVENTS_JOBS", 1_000);
    let env = TestEnv::new("events-fleet").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "bad", "action": {"reply": "550 5.1.1 user unknown"}}
        ]))
        .await;
    let tap = Tap::new(&env).await;
    let extra = [("RUST_LOG", "warn,postie=warn")];
    let mut instances: Vec<_> = (0..3).map(|_| env.spawn_process(&extra)).collect();
    let (mut keys, mut bad) = (BTreeSet::new(), BTreeSet::new());
    let jobs: Vec<Value> = (0..n)
        .map(|i| {
            let key = format!("ev-{i:04}");
            keys.insert(key.clone());
            let to = if i % 20 == 7 {
                bad.insert(key.clone());
                format!("bad{i}@example.com")
            } else {
                format!("ok{i}@example.com")
            };
            typed(&key, &to, "bulk")
        })
        .collect();
    let started = Instant::now();
    env.publish_many(&jobs).await;

    // Kill one instance once about a third of the events are in.
    let tap_ref = &tap;
    eventually("a third of the events", WAIT, || async move {
        (tap_ref.events().len() >= n / 3).then_some(())
    })
    .await;
    let killed_at = tap.events().len();
    instances[0].kill9();
    wait_for_keys(&env, &tap, &keys, Duration::from_secs(240)).await;
    let all_in = started.elapsed();
    // Anything re-published after the kill would arrive within this.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for instance in instances.iter_mut().skip(1) {
        instance.terminate(Duration::from_secs(20));
    }

    let events = tap.events();
    check_each(&events);
    let mut per_pair: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_key: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for event in &events {
        let (key, outcome) = key_outcome(event);
        *per_pair.entry((key.clone(), outcome.clone())).or_default() += 1;
        per_key.entry(key).or_default().insert(outcome);
        *per_id
            .entry(event.body["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    let pair_dups: usize = per_pair.values().map(|c| c - 1).sum();
    let id_dups: usize = per_id.values().map(|c| c - 1).sum();
    // What each key's events say: a good address is sent; a bad one is dead (the
    // 5.1.1 also suppresses it), or suppressed when the killed instance had recorded
    // the suppression but not the dead letter and another instance's claim found it,
    // or both when it had recorded the dead letter but not acked it.
    let mut shapes: BTreeMap<String, usize> = BTreeMap::new();
    for (key, outcomes) in &per_key {
        let shape = outcomes.iter().cloned().collect::<Vec<_>>().join("+");
        let allowed: &[&str] = if bad.contains(key) {
            &["dead", "suppressed", "dead+suppressed"]
        } else {
            &["sent"]
        };
        assert!(allowed.contains(&shape.as_str()), "{key}: {shape}");
        *shapes
            .entry(format!(
                "{}:{shape}",
                if bad.contains(key) { "bad" } else { "good" }
            ))
            .or_default() += 1;
    }

    // Outcome to receipt, and outcome to publish, over each event's first copy.
    let mut first: BTreeMap<&str, &Received> = BTreeMap::new();
    for event in &events {
        first
            .entry(event.body["id"].as_str().unwrap())
            .or_insert(event);
    }
    let mut to_receipt: Vec<i64> = first
        .values()
        .map(|e| e.at_ms - millis(&e.body["occurred_at"]))
        .collect();
    let mut to_publish: Vec<i64> = first
        .values()
        .map(|e| millis(&e.body["published_at"]) - millis(&e.body["occurred_at"]))
        .collect();
    to_receipt.sort_unstable();
    to_publish.sort_unstable();
    let span_ms = events.iter().map(|e| e.at_ms).max().unwrap()
        - events.iter().map(|e| e.at_ms).min().unwrap();
    eprintln!(
        "events: {n} jobs on 3 instances, one killed with -9 after {killed_at} events; \
         {} events received for {} keys, all in after {:.1} s; outcomes per key \
         {shapes:?}; duplicates by (key, outcome) {pair_dups}, by event id {id_dups}; \
         {:.0} events/s over {} ms from first to last; outcome to receipt p50 {} ms, \
         p99 {} ms, max {} ms; outcome to publish p50 {} ms, p99 {} ms",
        events.len(),
        per_key.len(),
        all_in.as_secs_f64(),
        first.len() as f64 / (span_ms.max(1) as f64 / 1000.0),
        span_ms,
        percentile(&to_receipt, 50),
        percentile(&to_receipt, 99),
        to_receipt.last().unwrap(),
        percentile(&to_publish, 50),
        percentile(&to_publish, 99),
    );
    assert_eq!(per_key.len(), n);
    // The outbox row is written with the outcome, fenced, and only for an outcome
    // other than the one the row last recorded (0016): a job the killed instance
    // recorded `dead` but did not ack is delivered again and may be recorded `dead`
    // again, without a second event. So each (key, outcome) has exactly one event id;
    // any other duplicate is a re-published copy of the same id.
    let mut ids_per_pair: BTreeMap<(String, String), BTreeSet<&str>> = BTreeMap::new();
    for event in &events {
        ids_per_pair
            .entry(key_outcome(event))
            .or_default()
            .insert(event.body["id"].as_str().unwrap());
    }
    let recorded_again: Vec<_> = ids_per_pair
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(pair, ids)| (pair.clone(), ids.len()))
        .collect();
    eprintln!("events: (key, outcome) pairs with more than one event id: {recorded_again:?}");
    assert!(
        recorded_again.is_empty(),
        "one event id per (key, outcome): {recorded_again:?}"
    );
    // Re-published copies: at most the killed instance's batch in flight.
    assert!(
        id_dups <= 256,
        "{id_dups} duplicates by event id, beyond one batch"
    );
}

/// A key recorded `dead` twice (its delivery redelivered after a crash, or a replay
/// that fails again) has one `dead` event; a replay that is then sent has its `sent`
/// event. Both completion statements: the batch (`complete`) and, through a
/// refused batch's fallback, one by one, share the rule; the batch is what runs here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_one_per_key_and_outcome_when_an_outcome_is_recorded_again() {
    use postie::testing::inbox::{Claim, Completion};
    let env = TestEnv::new("events-again").await;
    let settings = env.settings();
    let plan = settings.database.plan().unwrap();
    let inbox = postie::testing::inbox::Inbox::new(&plan, &settings.database).unwrap();
    inbox.migrate().await.unwrap();
    let lease = Duration::from_secs(30);
    let claim = |key: &'static str| {
        let inbox = &inbox;
        async move {
            match inbox.claim(key, "t", lease, 0).await.unwrap() {
                Claim::Claimed { fence, .. } => fence,
                other => panic!("{key}: {other:?}"),
            }
        }
    };
    for _ in 0..2 {
        let fence = claim("ev-again").await;
        let dead = Completion::Dead {
            error: "550 5.7.1 refused",
        };
        assert!(inbox
            .complete("ev-again", fence, Some("order"), dead)
            .await
            .unwrap());
    }
    let fence = claim("ev-again").await;
    let id = message_id("ev-again");
    let sent = Completion::Sent {
        message_id: &id,
        due_ms: 0,
        provider: "smtp",
        provider_message_id: None,
    };
    assert!(inbox
        .complete("ev-again", fence, Some("order"), sent)
        .await
        .unwrap());
    let rows: Vec<(String, String)> = env
        .db()
        .await
        .query(
            "SELECT outcome, type FROM postie_events WHERE key = 'ev-again' ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        [
            ("dead".to_string(), "order".to_string()),
            ("sent".to_string(), "order".to_string())
        ],
        "one event per outcome, the second dead none"
    );
}

/// Claims and `sent` completions of `n` keys on 16 tasks: pairs per second.
async fn claim_and_complete(inbox: &postie::testing::inbox::Inbox, round: &str, n: usize) -> f64 {
    use postie::testing::inbox::{Claim, Completion};
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (inbox, next, round) = (inbox.clone(), next.clone(), round.to_owned());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    let key = format!("{round}-{i}");
                    let lease = Duration::from_secs(30);
                    let Claim::Claimed { fence, .. } =
                        inbox.claim(&key, "bench", lease, 0).await.unwrap()
                    else {
                        panic!("{key} was not claimable");
                    };
                    let id = message_id(&key);
                    let sent = Completion::Sent {
                        message_id: &id,
                        due_ms: 0,
                        provider: "smtp",
                        provider_message_id: None,
                    };
                    assert!(inbox
                        .complete(&key, fence, Some("bench"), sent)
                        .await
                        .unwrap());
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// What the event row costs the send path: claim + `sent` completion with
/// `events.enabled` on and off, alternating rounds on one database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: the completion's event row"]
async fn events_statement_cost() {
    let n = support::bench::env_usize("POSTIE_EVENTS_BENCH_KEYS", 3_000);
    let env = TestEnv::new("events-bench").await;
    let mut settings = env.settings();
    settings.database.pool_size = 16;
    let plan = settings.database.plan().unwrap();
    let on = postie::testing::inbox::Inbox::new(&plan, &settings.database).unwrap();
    on.migrate().await.unwrap();
    let off = postie::testing::inbox::Inbox::new(&plan, &settings.database)
        .unwrap()
        .with_events(false);
    let mut results: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    claim_and_complete(&on, "warm", n / 3).await;
    for round in 0..4 {
        for (name, inbox) in [("on", &on), ("off", &off)] {
            let rate = claim_and_complete(inbox, &format!("{name}{round}"), n).await;
            results.entry(name).or_default().push(rate);
        }
    }
    let events: i64 = env
        .db()
        .await
        .query_one("SELECT count(*) FROM postie_events", &[])
        .await
        .unwrap()
        .get(0);
    eprintln!("events bench: claim + complete (sent), {n} keys a round, 16 tasks, pairs/s: {results:?}; {events} events written");

    // One completion at a time, on and off alternating key by key (so that the
    // machine's load falls on both alike): each completion's round trip.
    let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let on = postie::testing::inbox::Inbox::new(&plan, &settings.database).unwrap();
    let off = postie::testing::inbox::Inbox::new(&plan, &settings.database)
        .unwrap()
        .with_events(false);
    for i in 0..n {
        let (name, inbox) = if i % 2 == 1 {
            ("on", &on)
        } else {
            ("off", &off)
        };
        let key = format!("seq-{i}");
        let lease = Duration::from_secs(30);
        let Ok(postie::testing::inbox::Claim::Claimed { fence, .. }) =
            inbox.claim(&key, "b", lease, 0).await
        else {
            panic!("{key} was not claimable");
        };
        let id = message_id(&key);
        let sent = postie::testing::inbox::Completion::Sent {
            message_id: &id,
            due_ms: 0,
            provider: "smtp",
            provider_message_id: None,
        };
        let started = Instant::now();
        assert!(inbox
            .complete(&key, fence, Some("bench"), sent)
            .await
            .unwrap());
        times
            .entry(name)
            .or_default()
            .push(started.elapsed().as_secs_f64() * 1000.0);
    }
    for (name, t) in &mut times {
        t.sort_by(f64::total_cmp);
        let at = |p: usize| t[(t.len() - 1) * p / 100];
        eprintln!(
            "events bench: one completion (sent) at a time, events {name}: p50 {:.3} ms, \
             p90 {:.3} ms, p99 {:.3} ms over {}",
            at(50),
            at(90),
            at(99),
            t.len()
        );
    }

    // The publisher's pace: the outbox drained by one instance.
    let backlog = n as i64 * 5;
    let db = env.db().await;
    db.execute("DELETE FROM postie_events", &[]).await.unwrap();
    db.execute(
        "INSERT INTO postie_events (key, outcome, type, attempts)
         SELECT 'drain-' || g, 'sent', 'bulk', 1 FROM generate_series(1, $1::bigint) g",
        &[&backlog],
    )
    .await
    .unwrap();
    let tap = Tap::new(&env).await;
    let started = Instant::now();
    let serving = env.serve(env.settings());
    let tap_ref = &tap;
    eventually(
        "the outbox drained",
        Duration::from_secs(300),
        || async move { (tap_ref.events().len() as i64 >= backlog).then_some(()) },
    )
    .await;
    let took = started.elapsed();
    serving.stop().await;
    eprintln!(
        "events bench: {backlog} waiting events published by one instance in {:.2} s          ({:.0} events/s, from its start, batches of 256)",
        took.as_secs_f64(),
        backlog as f64 / took.as_secs_f64()
    );
}
