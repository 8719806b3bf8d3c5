//! What the delayed-message plugin cannot give: per-recipient throttling, cancel and
//! reschedule by key, and pending visibility (ladder mode).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use postie::config::{Settings, ThrottlePolicy, ThrottleRule};
use serde_json::json;
use support::{eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Publishes `body` with `x-delay`; returns the due time.
async fn publish_delayed(env: &TestEnv, body: &serde_json::Value, delay_ms: i64) -> i64 {
    let published = now_ms();
    env.publish_raw(
        body.to_string().as_bytes(),
        support::delayed_properties(delay_ms, published),
    )
    .await;
    published + delay_ms
}

fn typed(key: &str, kind: &str, user: &str) -> serde_json::Value {
    let mut body = job(key, "someone@example.com");
    body["type"] = kind.into();
    body["user_id"] = user.into();
    body
}

fn with_throttle(
    mut settings: Settings,
    kind: &str,
    limit: u32,
    window: Duration,
    policy: ThrottlePolicy,
) -> Settings {
    settings.throttle.insert(
        kind.into(),
        ThrottleRule {
            limit,
            window,
            policy,
        },
    );
    settings
}

/// Runs a `postie` sub-command against this test's world; returns stdout.
fn postie(env: &TestEnv, args: &[&str]) -> String {
    env.postie(args)
        .unwrap_or_else(|e| panic!("postie {args:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_drop_two_instances_fifty_jobs_one_email() {
    let env = TestEnv::new("thrdrop").await;
    let settings = || {
        with_throttle(
            env.settings(),
            "promo",
            1,
            Duration::from_secs(3600),
            ThrottlePolicy::Drop,
        )
    };
    let (a, b) = (env.serve(settings()), env.serve(settings()));
    let bodies: Vec<_> = (0..50)
        .map(|i| typed(&format!("promo-{i}"), "promo", "u-1"))
        .collect();
    env.publish_many(&bodies).await;
    let envr = &env;
    eventually("all 50 settled", WAIT, move || async move {
        let client = envr.db().await;
        let row = client
            .query_one("SELECT count(*) FILTER (WHERE status = 'throttled'), count(*) FILTER (WHERE status = 'sent') FROM postie_inbox", &[])
            .await
            .ok()?;
        (row.get::<_, i64>(0) + row.get::<_, i64>(1) == 50).then_some(())
    })
    .await;
    a.stop().await;
    b.stop().await;
    assert_eq!(
        env.sink.count().await,
        1,
        "exactly one email for the user in the window"
    );
    assert_eq!(env.inbox_count("status = 'throttled'").await, 49);
    // Another user is not affected.
    let c = env.serve(settings());
    env.publish(&typed("promo-other", "promo", "u-2")).await;
    eventually("the other user's email", WAIT, move || async move {
        (envr.sink.count().await == 2).then_some(())
    })
    .await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_defer_sends_all_one_window_apart_never_early() {
    const JOBS: usize = 5;
    const WINDOW_MS: i64 = 2_000;
    let env = TestEnv::new("thrdefer").await;
    let settings = || {
        with_throttle(
            env.settings(),
            "digest",
            1,
            Duration::from_millis(WINDOW_MS as u64),
            ThrottlePolicy::Defer,
        )
    };
    let (a, b) = (env.serve(settings()), env.serve(settings()));
    let mut due = BTreeMap::new();
    for i in 0..JOBS {
        let key = format!("digest-{i}");
        due.insert(
            message_id(&key),
            publish_delayed(&env, &typed(&key, "digest", "u-9"), 0).await,
        );
    }
    env.wait_for_emails("every deferred email", JOBS, Duration::from_secs(90))
        .await;
    a.stop().await;
    b.stop().await;
    let got = env.arrivals().await;
    assert_eq!(got.len(), JOBS);
    let mut times: Vec<i64> = got
        .values()
        .map(|t| {
            assert_eq!(t.len(), 1, "duplicate");
            t[0]
        })
        .collect();
    for (id, at) in got.iter().map(|(id, t)| (id, t[0])) {
        assert!(at >= due[id], "{id} early");
    }
    times.sort();
    // The throttle takes each slot a full window after the previous one; the sink sees
    // the emails a few ms after their slot, so allow that much jitter.
    for pair in times.windows(2) {
        assert!(
            pair[1] - pair[0] >= WINDOW_MS - 250,
            "two emails {} ms apart: {times:?}",
            pair[1] - pair[0]
        );
    }
}

/// The throttle's window arithmetic on a clock the test sets (`postie_window_take`'s
/// `p_now`): at most 3 per recipient in any 10 s (the window is half open: a send
/// leaves it exactly 10 s later), a refusal says when the window next has room, each
/// recipient counts apart, and a recipient who waited a window gets all 3 back.
#[tokio::test]
async fn throttle_window_arithmetic_on_an_injected_clock() {
    let env = TestEnv::new("thrclock").await;
    let client = env.db().await;
    let t0 = chrono::DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let t0_ms = t0.timestamp_millis();
    let take = |to: &'static str, at_ms: i64| {
        let client = &client;
        async move {
            let at = t0 + chrono::Duration::milliseconds(at_ms);
            let row = client
                .query_one(
                    "SELECT allowed, next_ms FROM postie_window_take('reminder', $1, 3, 10000, $2)",
                    &[&to, &at],
                )
                .await
                .expect("postie_window_take");
            let allowed: bool = row.get(0);
            let next: Option<i64> = row.get(1);
            (allowed, next.map(|n| n - t0_ms))
        }
    };
    for at in [0, 1_000, 2_000] {
        assert_eq!(take("a", at).await, (true, None), "send at +{at} ms");
    }
    assert_eq!(take("a", 3_000).await, (false, Some(10_000)), "the 4th");
    assert_eq!(take("b", 3_000).await, (true, None), "another recipient");
    assert_eq!(take("a", 9_999).await, (false, Some(10_000)), "1 ms early");
    assert_eq!(take("a", 10_000).await, (true, None), "the first left");
    assert_eq!(take("a", 10_500).await, (false, Some(11_000)), "full again");
    assert_eq!(take("a", 12_000).await, (true, None), "+1 s and +2 s left");
    for at in [40_000, 40_001, 40_002] {
        assert_eq!(take("a", at).await, (true, None), "after a window: 3 again");
    }
    assert_eq!(take("a", 40_003).await, (false, Some(50_000)));
    let kept: Vec<chrono::DateTime<chrono::Utc>> = client
        .query_one(
            "SELECT sends FROM postie_throttle WHERE kind = 'reminder' AND recipient = 'a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        kept.len(),
        3,
        "only the sends inside the window are kept: {kept:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_before_due_after_send_and_before_the_job_exists() {
    let env = TestEnv::new("cancel").await;
    let serving = env.serve(env.settings());
    let envr = &env;

    // Before due: scheduled, then cancelled from the CLI.
    publish_delayed(&env, &job("c-before-due", "x@example.com"), 4_000).await;
    eventually("scheduled", WAIT, move || async move {
        envr.inbox_row("c-before-due")
            .await
            .filter(|r| r.status == "scheduled")
    })
    .await;
    let said = postie(&env, &["cancel", "c-before-due"]);
    assert!(said.contains("cancelled"), "{said}");

    // After send: the CLI says so.
    env.publish(&job("c-after-send", "x@example.com")).await;
    eventually("sent", WAIT, move || async move {
        envr.inbox_row("c-after-send")
            .await
            .filter(|r| r.status == "sent")
    })
    .await;
    let said = postie(&env, &["cancel", "c-after-send"]);
    assert!(said.contains("already sent"), "{said}");

    // Before the job exists: a cancel message over AMQP leaves a tombstone that wins.
    env.publish(&json!({"cancel": "c-tombstone"})).await;
    eventually("tombstone", WAIT, move || async move {
        envr.inbox_row("c-tombstone")
            .await
            .filter(|r| r.status == "cancelled")
    })
    .await;
    env.publish(&job("c-tombstone", "x@example.com")).await;

    tokio::time::sleep(Duration::from_secs(6)).await; // past c-before-due's due time
    serving.stop().await;
    let got = env.arrivals().await;
    assert_eq!(
        got.keys().cloned().collect::<Vec<_>>(),
        vec![message_id("c-after-send")],
        "only the uncancelled job is sent"
    );
    assert_eq!(
        env.inbox_row("c-before-due").await.unwrap().status,
        "cancelled"
    );
    assert_eq!(
        env.inbox_row("c-tombstone").await.unwrap().status,
        "cancelled"
    );
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reschedule_earlier_and_later_by_revision() {
    let env = TestEnv::new("resched").await;
    let serving = env.serve(env.settings());

    // Earlier: revision 0 in 8 s, moved to revision 1 in 1 s.
    let due_old = publish_delayed(&env, &job("r-earlier", "x@example.com"), 8_000).await;
    env.publish(&json!({"cancel": "r-earlier", "revision": 0}))
        .await;
    let mut rev1 = job("r-earlier", "x@example.com");
    rev1["revision"] = 1.into();
    let due_new = publish_delayed(&env, &rev1, 1_000).await;

    // Later: revision 0 in 2 s, moved to revision 1 in 5 s.
    let _ = publish_delayed(&env, &job("r-later", "x@example.com"), 2_000).await;
    env.publish(&json!({"cancel": "r-later", "revision": 0}))
        .await;
    let mut later = job("r-later", "x@example.com");
    later["revision"] = 1.into();
    let due_later = publish_delayed(&env, &later, 5_000).await;

    let envr = &env;
    eventually("both rescheduled emails", WAIT, move || async move {
        (envr.sink.count().await >= 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(
        (due_old - now_ms()).max(0) as u64 + 2_000,
    ))
    .await; // past the old due times
    serving.stop().await;
    let got = env.arrivals().await;
    let earlier = &got[&message_id("r-earlier")];
    let later_at = &got[&message_id("r-later")];
    assert_eq!(
        (earlier.len(), later_at.len(), got.len()),
        (1, 1, 2),
        "{got:?}"
    );
    assert!(
        earlier[0] >= due_new && earlier[0] < due_old - 3_000,
        "moved earlier: sent at {} (new due {due_new}, old {due_old})",
        earlier[0]
    );
    assert!(
        later_at[0] >= due_later,
        "moved later: sent {} ms before its new due time",
        due_later - later_at[0]
    );
}

/// `postie pending` lists and counts one snapshot: while the relay records jobs one
/// commit at a time, every answer lists exactly as many jobs as it counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_lists_what_it_counts_while_jobs_are_recorded() {
    let env = TestEnv::new("pendingsnap").await;
    let database = env.settings().database;
    let inbox = postie::testing::inbox::Inbox::new(&database.plan().unwrap(), &database).unwrap();
    inbox.migrate().await.unwrap();
    let writer = inbox.clone();
    let recording = tokio::spawn(async move {
        for i in 0..300 {
            let job = postie::testing::inbox::Scheduled {
                key: format!("snap-{i}"),
                revision: 0,
                due_ms: now_ms() + 600_000,
                lane: None,
                body: None,
            };
            writer.schedule_many(&[job]).await.unwrap();
        }
    });
    let mut answers = 0;
    while !recording.is_finished() {
        let (jobs, total) = inbox.pending(None, None, 1_000).await.unwrap();
        assert_eq!(jobs.len() as i64, total, "listed against counted");
        answers += 1;
    }
    recording.await.unwrap();
    let (jobs, total) = inbox.pending(None, None, 1_000).await.unwrap();
    assert_eq!((jobs.len(), total), (300, 300));
    assert!(answers > 10, "only {answers} answers while recording");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_agrees_with_what_is_sent() {
    let env = TestEnv::new("pending").await;
    let serving = env.serve(env.settings());
    let mut due = BTreeMap::new();
    for i in 0..6 {
        let key = format!("p-{i}");
        due.insert(
            key.clone(),
            publish_delayed(&env, &job(&key, "x@example.com"), 4_000 + i * 200).await,
        );
    }
    let envr = &env;
    let listed = eventually("6 pending", WAIT, move || async move {
        let out = envr.postie(&["pending"]).ok()?; // fails until serve has migrated
        out.contains("6 pending").then_some(out)
    })
    .await;
    for (key, due_ms) in &due {
        let line = listed
            .lines()
            .find(|l| l.ends_with(&format!(" {key}")))
            .unwrap_or_else(|| panic!("{key} not listed:\n{listed}"));
        let at = chrono::DateTime::parse_from_rfc3339(line.split_whitespace().next().unwrap())
            .unwrap()
            .timestamp_millis();
        assert!(
            (at - due_ms).abs() <= 5,
            "{key}: listed due {at}, published due {due_ms}"
        );
    }
    let cutoff = chrono::DateTime::from_timestamp_millis(due["p-2"] + 100)
        .unwrap()
        .to_rfc3339();
    let before = postie(&env, &["pending", "--due-before", &cutoff]);
    assert!(before.contains("3 pending"), "{before}");
    postie(&env, &["cancel", "p-1"]);
    postie(&env, &["cancel", "p-4"]);
    let after_cancel = postie(&env, &["pending"]);
    assert!(
        after_cancel.contains("4 pending")
            && !after_cancel.contains(" p-1\n")
            && !after_cancel.contains(" p-4\n"),
        "{after_cancel}"
    );

    eventually("the four sent", WAIT, move || async move {
        (envr.sink.count().await >= 4).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    serving.stop().await;
    let sent: Vec<String> = env.arrivals().await.keys().cloned().collect();
    let mut expected: Vec<String> = ["p-0", "p-2", "p-3", "p-5"]
        .iter()
        .map(|k| message_id(k))
        .collect();
    expected.sort();
    assert_eq!(sent, expected);
    assert!(postie(&env, &["pending"]).contains("0 pending"));
}

/// Finding 1 of the protocol's model (issue 34, `tests/model`): the relay records a
/// newer revision while an older one is being sent (a reschedule that arrives during
/// the send). It is kept, with its due time and body (sql/0017): if the older send
/// fails, or ends dead, the row waits `scheduled` for the newer revision (which the
/// reconciler re-publishes if the broker lost it), the older revision is stale and
/// gets no event, and the newer one is claimed; if the older send succeeded, the key
/// is sent and the newer revision finds it done. Before the fix the record was
/// dropped: the older revision's retry was claimed and its superseded content sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_recorded_while_an_older_one_is_sending_is_kept() {
    use postie::testing::inbox::{Claim, Completion, Inbox, Scheduled};
    let env = TestEnv::new("resched-sending").await;
    let settings = env.settings();
    let inbox = Inbox::new(&settings.database.plan().unwrap(), &settings.database).unwrap();
    inbox.migrate().await.unwrap();
    let db = env.db().await;
    let lease = Duration::from_secs(30);
    let record = |key: &str, revision: i32, due_ms: i64| Scheduled {
        key: key.into(),
        revision,
        due_ms,
        lane: None,
        body: Some(format!("revision {revision}").into_bytes()),
    };
    let now_ms = now_ms();
    let cases = [
        ("rs-retrying", Completion::Retrying { error: "451 later" }),
        ("rs-dead", Completion::Dead { error: "550 no" }),
        (
            "rs-sent",
            Completion::Sent {
                message_id: "<m@postie.local>",
                due_ms: now_ms,
                provider: "smtp",
                provider_message_id: None,
            },
        ),
    ];
    for (key, completion) in cases {
        inbox
            .schedule_many(&[record(key, 0, now_ms)])
            .await
            .unwrap();
        let Claim::Claimed { fence, .. } = inbox.claim(key, "w0", lease, 0).await.unwrap() else {
            panic!("{key}: revision 0 is claimable");
        };
        // The producer reschedules: the relay records revision 1 during the send.
        let due_1 = now_ms + 3_600_000;
        inbox.schedule_many(&[record(key, 1, due_1)]).await.unwrap();
        let row = db
            .query_one(
                "SELECT status, revision, rescheduled, body,
                        (extract(epoch FROM due_at) * 1000)::bigint
                   FROM postie_inbox WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap();
        let kept: (&str, i32, bool, Vec<u8>, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        assert_eq!(
            kept,
            ("sending", 1, true, b"revision 1".to_vec(), due_1),
            "{key}"
        );

        assert!(inbox
            .complete(key, fence, Some("order"), completion)
            .await
            .unwrap());
        let row = db
            .query_one(
                "SELECT status, revision, rescheduled, body IS NOT NULL,
                        (SELECT count(*) FROM postie_events e WHERE e.key = i.key)
                   FROM postie_inbox i WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap();
        let after: (&str, i32, bool, bool, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        if matches!(completion, Completion::Sent { .. }) {
            assert_eq!(after, ("sent", 1, false, false, 1), "{key}");
            assert_eq!(
                inbox.claim(key, "w1", lease, 1).await.unwrap(),
                Claim::AlreadySent,
                "{key}: an email that left is not sent again for the newer revision"
            );
        } else {
            assert_eq!(
                after,
                ("scheduled", 1, false, true, 0),
                "{key}: the newer revision waits, no event for the stale one"
            );
            assert_eq!(
                inbox.claim(key, "w1", lease, 0).await.unwrap(),
                Claim::Stale,
                "{key}: the older revision's retry is stale"
            );
            assert!(
                matches!(
                    inbox.claim(key, "w1", lease, 1).await.unwrap(),
                    Claim::Claimed {
                        takeover: false,
                        ..
                    }
                ),
                "{key}: the newer revision is claimed"
            );
        }
    }
}
