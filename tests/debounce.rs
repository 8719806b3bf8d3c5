//! Debounce (issue 48, item 4), against the real broker, PostgreSQL and the SMTP test
//! server in ladder mode: 20 versions of one key over 10 s with `wait` 3 s give one
//! email with the last body, 3 s after the last version; with `max_wait` 5 s, one
//! email 5 s after the first, and the versions after it are duplicates of a sent key.
//! A producer's own `postie-revision` header skips nothing; a version the ladder loses
//! is re-published by the reconciler under its revision, not debounced again. The transition itself
//! (`inbox::machine`'s `debounce`) from each status; the hostile bodies, each a dead
//! letter with its reason that blocks nothing.

mod support;

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker;
use postie::testing::inbox::{Claim, Completion, Debounced, Debouncing, Inbox, Scheduled};
use support::{amqp_url, eventually, free_port, job, message_id, sample, TestEnv};

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Version `i` of `key`, debounced as `debounce` says.
fn version(key: &str, i: usize, debounce: &serde_json::Value) -> serde_json::Value {
    let mut body = job(key, "shopper@example.com");
    body["text"] = format!("cart version {i:02}").into();
    body["debounce"] = debounce.clone();
    body
}

/// Properties of a version published now, and that time (Unix ms); `forged` adds a
/// producer's own `postie-revision`, which must not be trusted.
fn published_now(forged: bool) -> (lapin::BasicProperties, i64) {
    let at = now_ms();
    let mut headers = FieldTable::default();
    headers.insert(
        postie::testing::headers::HEADER_PUBLISHED_AT.into(),
        AMQPValue::LongLongInt(at),
    );
    if forged {
        headers.insert("postie-revision".into(), AMQPValue::LongLongInt(1_000));
    }
    (broker::job_properties().with_headers(headers), at)
}

/// A counter of the instance's `/metrics`.
async fn counter(metrics: std::net::SocketAddr, name: &str) -> f64 {
    let url = format!("http://{metrics}/metrics");
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    sample(&text, name).unwrap_or(0.0)
}

/// `key`'s status and revision in the inbox.
async fn row(env: &TestEnv, key: &str) -> (String, i32) {
    let client = env.db().await;
    let row = client
        .query_one(
            "SELECT status, revision FROM postie_inbox WHERE key = $1",
            &[&key],
        )
        .await
        .expect("its row");
    (row.get(0), row.get(1))
}

/// The one email of `key`: its arrival (Unix ms) and the version its body carries.
async fn only_email(env: &TestEnv, key: &str) -> (i64, usize) {
    let id = message_id(key);
    let mine: Vec<_> = (env.sink.messages(true).await)
        .into_iter()
        .filter(|m| m.message_id == id)
        .collect();
    assert_eq!(mine.len(), 1, "{key}: {} emails", mine.len());
    let raw = mine[0].raw.as_deref().expect("the raw message");
    let at = raw.find("cart version ").expect("a version in the body") + "cart version ".len();
    let version = raw[at..at + 2].parse().expect("two digits");
    (mine[0].received_at_ms, version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_versions_give_one_email_with_the_last_body_after_the_wait_or_at_the_cap() {
    let env = TestEnv::new("debounce").await;
    let mut settings = env.settings();
    settings.http.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    let metrics = settings.http.listen.unwrap();
    let serving = env.serve(settings);
    let trailing = serde_json::json!({"wait": "3s"});
    let capped = serde_json::json!({"wait": "3s", "max_wait": "5s"});
    let (versions, step) = (20, Duration::from_millis(10_000 / 19));
    let mut published = Vec::new();
    for i in 0..versions {
        let at = now_ms();
        // Every third version of the trailing key carries a forged revision: were it
        // trusted, that version would be claimed at once, 3 s too early.
        let (forged, _) = published_now(i % 3 == 1);
        let body = version("cart-trailing", i, &trailing).to_string();
        env.publish_raw(body.as_bytes(), forged).await;
        let body = version("cart-capped", i, &capped).to_string();
        env.publish_raw(body.as_bytes(), published_now(false).0)
            .await;
        published.push(at);
        tokio::time::sleep(step).await;
    }
    env.wait_for_emails("both emails", 2, Duration::from_secs(60))
        .await;
    let (first, last) = (published[0], published[versions - 1]);

    let (sent, body) = only_email(&env, "cart-trailing").await;
    assert_eq!(body, versions - 1, "the last version's body wins");
    assert!(
        sent >= last + 3_000,
        "sent {} ms after the last version, before its wait",
        sent - last
    );
    let (capped_sent, capped_body) = only_email(&env, "cart-capped").await;
    assert!(
        capped_sent >= first + 5_000,
        "the capped key was sent {} ms after its first version, before max_wait",
        capped_sent - first
    );
    // Without the cap it would wait for its last version + 3 s (13 s).
    assert!(
        capped_sent < first + 10_000,
        "the capped key waited {} ms: max_wait did not hold",
        capped_sent - first
    );
    assert!(
        published[capped_body] <= capped_sent,
        "the capped email carries a version published after it was sent"
    );
    // The versions after the capped send: duplicates of a sent key, none sent.
    let (status, revision) = row(&env, "cart-trailing").await;
    assert_eq!(status, "sent");
    // Each version recorded is a new revision (the first 0, or 1 when the relay
    // recorded it as scheduled first); a version a worker takes after a later one
    // (two taken at once on a busy machine) is stale instead.
    assert!(
        revision >= versions as i32 / 2,
        "revision {revision}: not a revision per version"
    );
    let (_, capped_revision) = row(&env, "cart-capped").await;
    assert!(
        capped_revision < versions as i32,
        "versions after the send replaced it: revision {capped_revision}"
    );
    let duplicates = eventually(
        "the late versions refused",
        Duration::from_secs(30),
        || async {
            let n = counter(metrics, "postie_duplicates_suppressed_total").await;
            (n >= 1.0).then_some(n)
        },
    )
    .await;
    let stale = counter(metrics, "postie_stale_total").await;
    assert!(
        stale >= (versions - 1) as f64,
        "{stale} stale copies: every replaced version's copy is stale"
    );
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead letters"
    );
    serving.stop().await;
    eprintln!(
        "FIGURES debounce: 20 versions over {} ms, wait 3 s: one email, the last body, {} ms after the last version ({} ms late); max_wait 5 s: one email {} ms after the first version (version {capped_body:02}), {} later versions refused as duplicates, {stale} stale copies skipped",
        last - first,
        sent - last,
        sent - last - 3_000,
        capped_sent - first,
        duplicates,
    );
}

/// A debounced job's copies lost by the broker (here purged while no instance runs:
/// they were waiting in the relay's window, in the ladder or in a send queue) are
/// re-published by the reconciler with the revision the inbox recorded, and claimed
/// by it: not seen anew and debounced again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_version_is_re_published_under_its_revision() {
    let env = TestEnv::new("debouncelost").await;
    let settings = || {
        let mut settings = env.settings();
        settings.delay.reconcile_grace = Duration::from_secs(2);
        settings
    };
    let serving = env.serve(settings());
    let debounce = serde_json::json!({"wait": "5s"});
    let mut last_ms = 0;
    for i in 0..3 {
        let body = version("lost-cart", i, &debounce).to_string();
        let (properties, at) = published_now(false);
        env.publish_raw(body.as_bytes(), properties).await;
        last_ms = at;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Recorded by the worker: the row's latest arrival is the last version's.
    let envr = &env;
    let latest = format!("(extract(epoch FROM debounce_last_at) * 1000)::bigint = {last_ms}");
    let latest = &latest;
    eventually(
        "the last version recorded",
        Duration::from_secs(30),
        || async move { (envr.inbox_count(latest).await == 1).then_some(()) },
    )
    .await;
    serving.stop().await;
    let (status, recorded) = row(&env, "lost-cart").await;
    assert_eq!(status, "scheduled");
    // The broker loses every copy: only the inbox knows the key now. Purged for 2 s:
    // a copy a stopped instance held unacked is back in its queue a moment later, and
    // one between two levels of the ladder is caught on a later pass.
    let conn = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut purged = 0;
    for _ in 0..40 {
        for queue in env.topology.queues() {
            purged += (channel.queue_purge(queue.as_str().into(), Default::default()))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The last version's copy at least (an older one a worker took after a newer,
    // both at once, was stale and left no copy).
    assert!(purged >= 1, "no copy was in the broker");
    let _ = conn.close(200, "done".into()).await;

    let serving = env.serve(settings());
    env.wait_for_emails("the lost key", 1, Duration::from_secs(60))
        .await;
    serving.stop().await;
    let (_, body) = only_email(&env, "lost-cart").await;
    assert_eq!(body, 2, "the last version's body");
    // Claimed by the revision it was recorded under: not a version seen anew.
    assert_eq!(row(&env, "lost-cart").await, ("sent".to_string(), recorded));
    let reconciled = env.inbox_count("reconciled_at IS NOT NULL").await;
    assert_eq!(reconciled, 1, "re-published by the reconciler");
}

/// A debounced job the relay recorded but no worker saw (its copy lost on the way to
/// the send queue) is re-published by the reconciler without a revision, so the
/// worker debounces it then: not sent at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_no_worker_saw_is_debounced_when_re_published() {
    let env = TestEnv::new("debounceunseen").await;
    let mut settings = env.settings();
    settings.delay.reconcile_grace = Duration::from_secs(1);
    let inbox = Inbox::connect(&settings.database).await.unwrap();
    inbox.migrate().await.unwrap();
    let published = now_ms() - 5_000;
    let body = version("unseen-cart", 0, &serde_json::json!({"wait": "60s"}));
    let recorded = Scheduled {
        key: "unseen-cart".into(),
        revision: 0,
        due_ms: published,
        lane: None,
        body: Some(body.to_string().into_bytes()),
    };
    inbox.schedule_many(&[recorded]).await.unwrap();
    let serving = env.serve(settings);
    let envr = &env;
    let debounced = "key = 'unseen-cart' AND reconciled = 1 AND revision = 1
                     AND debounce_last_at IS NOT NULL AND status = 'scheduled'";
    let sent_at_once = eventually(
        "re-published and debounced",
        Duration::from_secs(60),
        || async move {
            if envr.sink.count().await > 0 {
                return Some(true);
            }
            (envr.inbox_count(debounced).await == 1).then_some(false)
        },
    )
    .await;
    assert!(!sent_at_once, "re-published, it was sent without its wait");
    serving.stop().await;
    let due: i64 = (env.db().await)
        .query_one(
            "SELECT (extract(epoch FROM due_at) * 1000)::bigint FROM postie_inbox
              WHERE key = 'unseen-cart'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(due, published + 60_000, "due a wait after its arrival");
    assert_eq!(env.sink.count().await, 0, "sent without its wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_debounce_is_a_dead_letter_with_its_reason_that_blocks_nothing() {
    let env = TestEnv::new("debouncebad").await;
    let serving = env.serve(env.settings());
    let bad = [
        ("bad-wait", serde_json::json!({"wait": "soon"})),
        ("zero-wait", serde_json::json!({"wait": "0s"})),
        (
            "cap-below",
            serde_json::json!({"wait": "5s", "max_wait": "1s"}),
        ),
        ("past-max", serde_json::json!({"wait": "400d"})),
        ("unknown", serde_json::json!({"wait": "1s", "max": "2s"})),
    ];
    for (key, debounce) in &bad {
        let mut body = job(key, "shopper@example.com");
        body["debounce"] = debounce.clone();
        env.publish(&body).await;
    }
    env.publish(&job("after-them", "buyer@example.com")).await;
    env.wait_for_emails("the good job", 1, Duration::from_secs(30))
        .await;
    eventually("five dead letters", Duration::from_secs(30), || async {
        let depth = env.depth(env.topology.dead_queue()).await;
        (depth >= bad.len() as u32).then_some(())
    })
    .await;
    let reasons = env.dead_reasons().await.join("\n");
    for says in [
        "is not a duration",
        "must be more than zero",
        "must not be less than",
        "longer than delay.max",
        "unknown field `max`",
    ] {
        assert!(
            reasons.contains(says),
            "no reason says {says:?}:\n{reasons}"
        );
    }
    serving.stop().await;
}

/// The transition from each status, on the inbox alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debounce_transition_from_each_status() {
    let env = TestEnv::new("debouncesql").await;
    let inbox = Inbox::connect(&env.settings().database).await.unwrap();
    let at = now_ms();
    let debounce = |key, arrival_ms| Debouncing {
        key,
        revision: 0,
        arrival_ms,
        wait_ms: 3_000,
        max_wait_ms: Some(5_000),
        body: None,
        lane: None,
    };
    // No row: revision 0, due at arrival + wait.
    let first = inbox.debounce(&debounce("k", at)).await.unwrap();
    assert_eq!(
        first,
        Debounced::Replaced {
            revision: 0,
            due_ms: at + 3_000
        }
    );
    // A later version: the next revision, due at its arrival + wait, capped.
    let second = inbox.debounce(&debounce("k", at + 1_000)).await.unwrap();
    assert_eq!(
        second,
        Debounced::Replaced {
            revision: 1,
            due_ms: at + 4_000
        }
    );
    let third = inbox.debounce(&debounce("k", at + 4_000)).await.unwrap();
    assert_eq!(
        third,
        Debounced::Replaced {
            revision: 2,
            due_ms: at + 5_000
        }
    );
    // An older version arriving late is stale and changes nothing.
    let late = inbox.debounce(&debounce("k", at + 500)).await.unwrap();
    assert_eq!(late, Debounced::Stale);
    // The old revisions' claims are stale; the newest's claims.
    let lease = Duration::from_secs(30);
    assert_eq!(inbox.claim("k", "a", lease, 1).await.unwrap(), Claim::Stale);
    let Claim::Claimed { fence, .. } = inbox.claim("k", "a", lease, 2).await.unwrap() else {
        panic!("the newest revision claims");
    };
    // While it is being sent, a version is remembered, not sent instead.
    let during = inbox.debounce(&debounce("k", at + 4_500)).await.unwrap();
    assert_eq!(
        during,
        Debounced::Replaced {
            revision: 3,
            due_ms: at + 5_000
        }
    );
    assert_eq!(row(&env, "k").await.0, "sending");
    let sent = Completion::Sent {
        message_id: "<k@test>",
        due_ms: at + 5_000,
        provider: "smtp",
        provider_message_id: None,
    };
    assert!(inbox.complete("k", fence, None, sent).await.unwrap());
    // Sent: every later version is a duplicate.
    let after = inbox.debounce(&debounce("k", at + 9_000)).await.unwrap();
    assert_eq!(after, Debounced::AlreadySent);
    assert_eq!(
        inbox.claim("k", "a", lease, 3).await.unwrap(),
        Claim::AlreadySent
    );

    // A send that fails while a version waits: that version is the pending one.
    let other = inbox.debounce(&debounce("f", at)).await.unwrap();
    assert_eq!(
        other,
        Debounced::Replaced {
            revision: 0,
            due_ms: at + 3_000
        }
    );
    let Claim::Claimed { fence, .. } = inbox.claim("f", "a", lease, 0).await.unwrap() else {
        panic!("claims");
    };
    inbox.debounce(&debounce("f", at + 1_000)).await.unwrap();
    let failed = Completion::Retrying {
        error: "421 try later",
    };
    assert!(inbox.complete("f", fence, None, failed).await.unwrap());
    assert_eq!(row(&env, "f").await, ("scheduled".to_string(), 1));
    // A finished dead row starts a new series: its cap counts from the new arrival.
    let client = env.db().await;
    client
        .execute(
            "UPDATE postie_inbox SET status = 'dead' WHERE key = 'f'",
            &[],
        )
        .await
        .unwrap();
    let again = inbox.debounce(&debounce("f", at + 60_000)).await.unwrap();
    assert_eq!(
        again,
        Debounced::Replaced {
            revision: 2,
            due_ms: at + 63_000
        }
    );
}
