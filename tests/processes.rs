//! Competing `postie serve` OS processes: exactly one email per key with three
//! instances racing, and lease takeover after one is killed with SIGKILL; and the
//! claim they race through (`postie_claim`), from every state a key can be in.
//!
//! Each test prints its figures (rate, takeover time) to stderr; run with
//! `--nocapture` to see them.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{eventually, job, message_id, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_send_exactly_one_email_per_key() {
    const JOBS: usize = 2_000;
    const UNIQUE: usize = 1_600; // 20% of the publishes repeat an earlier key
    let env = TestEnv::new("compete").await;
    let keys: Vec<String> = (0..UNIQUE)
        .map(|i| format!("order-{i}:confirmation"))
        .collect();
    let mut bodies: Vec<_> = keys.iter().map(|k| job(k, "buyer@example.com")).collect();
    // Duplicates spread through the stream: key i*4 repeated after it.
    for i in 0..(JOBS - UNIQUE) {
        bodies.insert(i * 5 + 3, job(&keys[i * 4], "buyer@example.com"));
    }
    assert_eq!(bodies.len(), JOBS);
    env.publish_many(&bodies).await;

    let started = Instant::now();
    let _instances: Vec<_> = (0..3).map(|_| env.spawn_process(&[])).collect();
    let envr = &env;
    env.wait_for_emails("every unique key sent", UNIQUE, Duration::from_secs(300))
        .await;
    let elapsed = started.elapsed();
    // Let the remaining duplicates drain, then check nothing more was sent.
    eventually(
        "the queue drained",
        Duration::from_secs(120),
        move || async move { (envr.depth(envr.topology.send_queue()).await == 0).then_some(()) },
    )
    .await;
    let duplicates_counted = eventually(
        "every duplicate counted",
        Duration::from_secs(120),
        move || async move {
            let client = envr.db().await;
            let row = client
                .query_one(
                    "SELECT coalesce(sum(duplicates), 0)::bigint FROM postie_inbox",
                    &[],
                )
                .await
                .ok()?;
            let n: i64 = row.get(0);
            (n as usize >= JOBS - UNIQUE).then_some(n)
        },
    )
    .await;

    let received = env.emails_per_id().await;
    let expected: BTreeSet<String> = keys.iter().map(|k| message_id(k)).collect();
    let got: BTreeSet<String> = received.keys().cloned().collect();
    assert_eq!(got, expected, "lost or unexpected emails");
    let duplicate_emails: usize = received.values().map(|n| n - 1).sum();
    assert_eq!(duplicate_emails, 0, "duplicate emails");
    assert_eq!(duplicates_counted as usize, JOBS - UNIQUE);
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    eprintln!(
        "FIGURES compete: {JOBS} jobs ({UNIQUE} unique) by 3 processes in {:.2}s from start: {:.0} emails/s, {:.0} deliveries/s; duplicates suppressed {duplicates_counted}; lost 0; duplicate emails {duplicate_emails}",
        elapsed.as_secs_f64(),
        UNIQUE as f64 / elapsed.as_secs_f64(),
        JOBS as f64 / elapsed.as_secs_f64(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_s_jobs_are_taken_over_after_the_lease() {
    const JOBS: usize = 60;
    let env = TestEnv::new("kill9").await;
    // Slow SMTP, so both instances hold claimed, unacked deliveries mid-send.
    env.sink
        .set_faults(json!([{"stage": "data", "action": {"delay_ms": 1500}}]))
        .await;
    // A small prefetch, so the instance that starts first cannot take every job.
    let small = [
        ("POSTIE__WORKER__CONCURRENCY", "8"),
        ("POSTIE__AMQP__PREFETCH", "8"),
    ];
    let mut victim = env.spawn_process(&small);
    let _survivor = env.spawn_process(&small);
    let keys: Vec<String> = (0..JOBS).map(|i| format!("kill-{i}")).collect();
    let bodies: Vec<_> = keys.iter().map(|k| job(k, "x@example.com")).collect();
    env.publish_many(&bodies).await;

    let envr = &env;
    eventually(
        "the victim to be mid-send",
        Duration::from_secs(60),
        move || async move {
            let client = envr.db().await;
            let row = client
                .query_one(
                    "SELECT count(DISTINCT owner) FROM postie_inbox WHERE status = 'sending'",
                    &[],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) >= 2).then_some(())
        },
    )
    .await;
    victim.kill9();
    let killed_at = Instant::now();
    env.sink.clear_faults().await;

    eventually(
        "every job sent",
        Duration::from_secs(120),
        move || async move { (envr.emails_per_id().await.len() >= JOBS).then_some(()) },
    )
    .await;
    let takeover_time = killed_at.elapsed();
    let takeovers = env.takeovers().await;
    let taken_over = env.taken_over_ids().await;
    assert!(takeovers >= 1, "the victim held no claim when killed");

    let received = env.emails_per_id().await;
    let expected: BTreeSet<String> = keys.iter().map(|k| message_id(k)).collect();
    assert_eq!(
        received.keys().cloned().collect::<BTreeSet<_>>(),
        expected,
        "lost emails"
    );
    // The only duplicate allowed: killed between the SMTP 250 and the `sent` commit,
    // which shows as a takeover of that key.
    let duplicated: Vec<_> = received
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id.clone())
        .collect();
    for id in &duplicated {
        assert!(
            taken_over.contains(id),
            "duplicate email {id} outside the known window"
        );
    }
    eprintln!(
        "FIGURES kill9: {JOBS} jobs, {takeovers} leases taken over, all sent {:.1}s after SIGKILL (lease 5s), duplicates in the known window {}",
        takeover_time.as_secs_f64(),
        duplicated.len()
    );
}

/// The relay records pending jobs in batches and acks an intake delivery only after
/// its record is committed and its copy confirmed: a relay killed mid-batch leaves
/// every job it had not finished in `<p>.intake`, and the next instance relays it.
/// Every job is sent once, none early, and none is left listed as pending.
/// The fast tier's twin: 1,000 jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_batch_loses_nothing_and_sends_nothing_early() {
    relay_killed_mid_batch(1_000).await;
}

/// The full size (slow tier): 3,000 jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_relay_killed_mid_batch_loses_nothing_and_sends_nothing_early() {
    relay_killed_mid_batch(3_000).await;
}

async fn relay_killed_mid_batch(jobs: usize) {
    let env = TestEnv::new("relaykill").await;
    // Due 8-12 s after publishing: nothing is due while the first relay runs.
    let due = support::bench::publish_delayed(
        &env,
        "rk",
        (0..jobs as i64).map(|i| 8_000 + (i % 41) * 100),
    )
    .await;
    let first_due = *due.values().min().unwrap();
    let intake = env.topology.intake_queue();
    assert_eq!(env.depth(intake).await as usize, jobs);

    // Small pools: the other tests of this file run at the same time, with three
    // processes of 16 connections each, under PostgreSQL's 100.
    let small_pool = [("POSTIE__DATABASE__POOL_SIZE", "4")];
    let mut first = env.spawn_process(&small_pool);
    let envr = &env;
    let intake_ref = &intake;
    eventually(
        "the first relay took part of the intake",
        Duration::from_secs(120),
        move || async move { (envr.depth(intake_ref).await as usize <= jobs - 300).then_some(()) },
    )
    .await;
    first.kill9();
    let killed_at = chrono::Utc::now().timestamp_millis();
    let left = env.depth(intake).await;
    let _second = env.spawn_process(&small_pool);
    env.wait_for_emails("every delayed job", jobs, Duration::from_secs(300))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let report = support::bench::Lateness::measure(&due, &env.sink.messages(false).await);
    assert_eq!(report.lost, 0, "lost jobs: {report:?}");
    assert_eq!(report.early, 0, "early emails: {report:?}");
    if killed_at < first_due {
        // Killed before anything was due: it was sending nothing.
        assert_eq!(report.duplicates, 0, "duplicates: {report:?}");
    }
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    assert_eq!(
        env.inbox_count("status = 'scheduled'").await,
        0,
        "rows still listed as pending"
    );
    eprintln!(
        "FIGURES relay kill: {jobs} delayed jobs, relay killed with {left} still in the intake; \
         lost {}, early {}, duplicates {}, lateness p50 {} ms p99 {} ms max {} ms",
        report.lost, report.early, report.duplicates, report.p50_ms, report.p99_ms, report.max_ms
    );
}

/// `postie_claim` from every state a key can be in, then a race: eight tasks claim the
/// same scheduled keys at once (as instances do with a ladder job delivered twice), and
/// each key is claimed exactly once, the others told it is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answers_for_every_state_and_one_task_wins_each_key() {
    use postie::testing::inbox::{Claim, Completion, Inbox, Scheduled};

    let env = TestEnv::new("claimstates").await;
    let database = env.settings().database;
    let inbox = Inbox::new(&database.plan().unwrap(), &database).unwrap();
    inbox.migrate().await.unwrap();
    let lease = Duration::from_secs(60);
    let scheduled = |key: &str, revision: i32| Scheduled {
        key: key.to_owned(),
        revision,
        due_ms: chrono::Utc::now().timestamp_millis(),
        lane: None,
        body: Some(b"{}".to_vec()),
    };
    // A claim no longer reports the key's prior attempts (no caller read them): the
    // attempts a completion recorded are read from the row instead.
    let claimed = |fence, attempts: i32, takeover| (Claim::Claimed { fence, takeover }, attempts);
    let claim = |key: &'static str, revision: i32, lease: Duration| {
        let inbox = inbox.clone();
        async move { inbox.claim(key, "test", lease, revision).await.unwrap() }
    };
    let db = env.db().await;
    let db = &db;
    let claim_counted = |key: &'static str, revision: i32, lease: Duration| {
        let claimed = claim(key, revision, lease);
        async move {
            let claim = claimed.await;
            let row = db
                .query_one("SELECT attempts FROM postie_inbox WHERE key = $1", &[&key])
                .await
                .unwrap();
            (claim, row.get::<_, i32>(0))
        }
    };
    let sent = Completion::Sent {
        message_id: "<m@x>",
        due_ms: 0,
        provider: "smtp",
        provider_message_id: None,
    };

    assert_eq!(claim_counted("new", 0, lease).await, claimed(1, 0, false));

    inbox
        .schedule_many(&[scheduled("scheduled", 0)])
        .await
        .unwrap();
    assert_eq!(
        claim_counted("scheduled", 0, lease).await,
        claimed(2, 0, false)
    );

    assert_eq!(
        claim_counted("retrying", 0, lease).await,
        claimed(1, 0, false)
    );
    let retrying = Completion::Retrying { error: "451 later" };
    assert!(inbox.complete("retrying", 1, None, retrying).await.unwrap());
    assert_eq!(
        claim_counted("retrying", 0, lease).await,
        claimed(2, 1, false)
    );

    assert_eq!(claim_counted("dead", 0, lease).await, claimed(1, 0, false));
    let dead = Completion::Dead { error: "550 no" };
    assert!(inbox.complete("dead", 1, None, dead).await.unwrap());
    assert_eq!(claim_counted("dead", 0, lease).await, claimed(2, 1, false));

    assert_eq!(
        claim_counted("throttled", 0, lease).await,
        claimed(1, 0, false)
    );
    let throttled = Completion::Throttled;
    assert!(inbox
        .complete("throttled", 1, None, throttled)
        .await
        .unwrap());
    assert_eq!(
        claim_counted("throttled", 0, lease).await,
        claimed(2, 0, false)
    );

    assert_eq!(claim_counted("sent", 0, lease).await, claimed(1, 0, false));
    assert!(inbox.complete("sent", 1, None, sent).await.unwrap());
    assert_eq!(claim("sent", 0, lease).await, Claim::AlreadySent);

    inbox
        .schedule_many(&[scheduled("cancelled", 0)])
        .await
        .unwrap();
    inbox.cancel("cancelled", None).await.unwrap();
    assert_eq!(claim("cancelled", 0, lease).await, Claim::Cancelled);
    assert_eq!(
        claim_counted("cancelled", 1, lease).await,
        claimed(2, 0, false)
    );

    inbox.schedule_many(&[scheduled("stale", 2)]).await.unwrap();
    assert_eq!(claim("stale", 1, lease).await, Claim::Stale);

    assert_eq!(claim_counted("busy", 0, lease).await, claimed(1, 0, false));
    match claim("busy", 0, lease).await {
        Claim::Busy { remaining } => assert!(remaining <= lease, "{remaining:?}"),
        other => panic!("a live lease answered {other:?}"),
    }

    let short = Duration::from_millis(1);
    assert_eq!(
        claim_counted("expired", 0, short).await,
        claimed(1, 0, false)
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        claim_counted("expired", 0, lease).await,
        claimed(2, 0, true)
    );
    assert!(
        !inbox.complete("expired", 1, None, sent).await.unwrap(),
        "the first holder's completion is fenced off"
    );

    const KEYS: usize = 50;
    const TASKS: usize = 8;
    let jobs: Vec<_> = (0..KEYS)
        .map(|i| scheduled(&format!("race-{i}"), 0))
        .collect();
    inbox.schedule_many(&jobs).await.unwrap();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                let mut won = Vec::new();
                for i in 0..KEYS {
                    let key = format!("race-{}", (i + t * 7) % KEYS);
                    match inbox.claim(&key, "racer", lease, 0).await.unwrap() {
                        Claim::Claimed { fence, .. } => won.push((key, fence)),
                        Claim::Busy { .. } => {}
                        other => panic!("{key}: {other:?}"),
                    }
                }
                won
            })
        })
        .collect();
    let mut winners = Vec::new();
    for task in tasks {
        winners.extend(task.await.unwrap());
    }
    let keys: BTreeSet<_> = winners.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(winners.len(), KEYS, "claims won: {winners:?}");
    assert_eq!(keys.len(), KEYS);
    assert!(winners.iter().all(|(_, fence)| *fence == 2), "{winners:?}");
}

/// Completions recorded in batches: 60 claims completed at once, each row as its own
/// statement would have recorded it; a completion whose fence moved records nothing
/// and says so; one whose text PostgreSQL refuses (a NUL byte) is refused alone, the
/// rest of its batch recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_at_once_are_recorded_each_by_its_own_fence() {
    use postie::testing::inbox::{Claim, Completion, Inbox};

    let env = TestEnv::new("batchdone").await;
    let database = env.settings().database;
    let inbox = Inbox::new(&database.plan().unwrap(), &database).unwrap();
    inbox.migrate().await.unwrap();
    let lease = Duration::from_secs(60);
    let keys: Vec<String> = (0..60).map(|i| format!("batch-{i:02}")).collect();
    let mut fences = Vec::new();
    for key in &keys {
        match inbox.claim(key, "test", lease, 0).await.unwrap() {
            Claim::Claimed { fence, .. } => fences.push(fence),
            other => panic!("{key}: {other:?}"),
        }
    }
    let done = futures_util::future::join_all(keys.iter().zip(&fences).enumerate().map(
        |(i, (key, &fence))| {
            let inbox = inbox.clone();
            async move {
                let message_id = format!("<{key}@x>");
                let provider_id = format!("pid-{key}");
                let completion = match i % 4 {
                    0 => Completion::Sent {
                        message_id: &message_id,
                        due_ms: 1_000,
                        provider: "ses",
                        provider_message_id: Some(&provider_id),
                    },
                    1 => Completion::Retrying { error: "451 later" },
                    2 => Completion::Dead {
                        error: "550 no such user",
                    },
                    _ => Completion::Unclaimed { why: "paused" },
                };
                match i {
                    // A fence another instance has moved on from.
                    7 => inbox.complete(key, fence + 1, None, completion).await,
                    // Text PostgreSQL refuses (22021).
                    9 => {
                        inbox
                            .complete(key, fence, None, Completion::Dead { error: "a\0b" })
                            .await
                    }
                    _ => inbox.complete(key, fence, None, completion).await,
                }
            }
        },
    ))
    .await;
    let db = env.db().await;
    for (i, (key, result)) in keys.iter().zip(done).enumerate() {
        let row = db
            .query_one(
                "SELECT status, attempts, last_error, message_id, body IS NULL, owner IS NULL, \
                        provider, provider_message_id \
                 FROM postie_inbox WHERE key = $1",
                &[key],
            )
            .await
            .unwrap();
        let status: String = row.get(0);
        let (attempts, error, message_id): (i32, Option<String>, Option<String>) =
            (row.get(1), row.get(2), row.get(3));
        let released: bool = row.get(5);
        let provider: (Option<String>, Option<String>) = (row.get(6), row.get(7));
        match i {
            7 => {
                assert!(!result.unwrap(), "{key}: a moved fence records nothing");
                assert_eq!(status, "sending", "{key}");
            }
            9 => {
                let error = result.unwrap_err();
                assert!(!error.is_outage(), "{key}: {error}");
                assert_eq!(status, "sending", "{key}");
            }
            _ => {
                assert!(result.unwrap(), "{key}");
                assert!(released, "{key}: the claim let go");
                let expected = match i % 4 {
                    0 => ("sent", 1, None, Some(format!("<{key}@x>"))),
                    1 => ("retrying", 1, Some("451 later".to_string()), None),
                    2 => ("dead", 1, Some("550 no such user".to_string()), None),
                    _ => ("retrying", 0, Some("paused".to_string()), None),
                };
                assert_eq!(
                    (status.as_str(), attempts, error, message_id),
                    expected,
                    "{key}"
                );
                let expected = match i % 4 {
                    0 => (Some("ses".to_string()), Some(format!("pid-{key}"))),
                    _ => (None, None),
                };
                assert_eq!(provider, expected, "{key}: who sent it, only for a send");
            }
        }
    }
}
