//! Retention (issue 14): finished rows are pruned after `inbox.retention`, in-flight
//! rows never; a key pruned is a new key; maintenance runs on exactly one of several
//! instances and moves when that one is killed; a large prune does not fail sends.
//!
//! Figures go to stderr (`--nocapture`).

mod support;

use std::time::{Duration, Instant};

use support::{eventually, free_port, job, message_id, run_postie, sample, TestEnv};

async fn get(url: &str) -> Option<String> {
    let response = reqwest::get(url).await.ok()?;
    response.text().await.ok()
}

/// Runs `statement` (no results) in the test's database.
async fn sql(env: &TestEnv, statement: &str) {
    env.db()
        .await
        .batch_execute(statement)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
}

/// Waits until the instance under test has migrated the inbox.
async fn inbox_table(env: &TestEnv) {
    eventually(
        "the inbox table",
        Duration::from_secs(60),
        move || async move {
            env.db()
                .await
                .query_opt("SELECT to_regclass('postie_inbox')::text", &[])
                .await
                .ok()
                .flatten()
                .and_then(|r| r.get::<_, Option<String>>(0))
        },
    )
    .await;
}

/// Inserts `n` rows of `status`, last changed `age` ago, with keys `prefix-<i>`.
async fn insert_rows(env: &TestEnv, prefix: &str, status: &str, n: i64, age: &str) {
    env.db()
        .await
        .execute(
            "INSERT INTO postie_inbox (key, status, owner, lease_until, due_at, updated_at)
             SELECT $1 || '-' || g, $2,
                    CASE WHEN $2 = 'sending' THEN 'gone' END,
                    CASE WHEN $2 = 'sending' THEN now() - $4::text::interval END,
                    CASE WHEN $2 = 'scheduled' THEN now() + interval '1 day' END,
                    now() - $4::text::interval
               FROM generate_series(1, $3::bigint) g",
            &[&prefix, &status, &n, &age],
        )
        .await
        .unwrap_or_else(|e| panic!("inserting {status} rows: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_key_is_pruned_after_retention_and_then_sent_again() {
    let env = TestEnv::new("retain").await;
    let mut settings = env.settings();
    // Long enough for the row to be read after each send on a busy machine.
    settings.inbox.retention = Duration::from_secs(5);
    settings.inbox.prune_interval = Duration::from_secs(1);
    let serving = env.serve(settings);
    let key = "order-1:confirmation";
    env.publish(&job(key, "a@example.com")).await;
    env.wait_for_emails("the first send", 1, Duration::from_secs(60))
        .await;
    // Inside the window: suppressed.
    env.publish(&job(key, "a@example.com")).await;
    let envr = &env;
    eventually(
        "the duplicate suppressed",
        Duration::from_secs(30),
        move || async move {
            let row = envr.inbox_row(key).await?;
            (row.duplicates == 1).then_some(())
        },
    )
    .await;
    assert_eq!(
        env.sink.count().await,
        1,
        "a duplicate inside the window was sent"
    );
    // After the window: the row is pruned, and the same key is a new job.
    let started = Instant::now();
    eventually(
        "the key pruned",
        Duration::from_secs(30),
        move || async move { envr.inbox_row(key).await.is_none().then_some(()) },
    )
    .await;
    let pruned_after = started.elapsed();
    env.publish(&job(key, "a@example.com")).await;
    env.wait_for_emails("the key sent again", 2, Duration::from_secs(60))
        .await;
    assert_eq!(env.emails_per_id().await.get(&message_id(key)), Some(&2));
    // The sink has the email before postie records it sent: wait for the record.
    eventually(
        "the key recorded sent again",
        Duration::from_secs(30),
        move || async move {
            let row = envr.inbox_row(key).await.expect("row again");
            (row.status == "sent").then_some(())
        },
    )
    .await;
    serving.stop().await;
    eprintln!(
        "FIGURES retain: sent key pruned {:.1}s after the duplicate (retention 5s, prune every 1s)",
        pruned_after.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_rows_are_never_pruned_and_prune_reports_what_it_deletes() {
    let env = TestEnv::new("inflight").await;
    let mut vars = env.env_vars();
    vars.push(("POSTIE__INBOX__RETENTION".into(), "2s".into()));
    vars.push(("POSTIE__INBOX__TOMBSTONE_RETENTION".into(), "1d".into()));
    let postie = |args: &[&str], vars: &[(String, String)]| {
        let run = run_postie(args, vars);
        assert_eq!(run.code, Some(0), "postie {args:?}: {}", run.stderr);
        run.stdout
    };
    postie(&["migrate"], &vars);
    for status in ["sending", "retrying", "scheduled"] {
        insert_rows(&env, status, status, 10, "30 days").await;
    }
    for status in ["sent", "dead", "throttled"] {
        insert_rows(&env, status, status, 10, "1 hour").await;
        insert_rows(&env, &format!("young-{status}"), status, 5, "0 seconds").await;
    }
    // A tombstone (a cancel for a key never seen) and a cancelled job.
    let cancel = postie(&["cancel", "never-seen"], &vars);
    assert!(!cancel.is_empty());
    insert_rows(&env, "cancelled-job", "cancelled", 4, "1 hour").await;
    env.db()
        .await
        .batch_execute(
            "UPDATE postie_inbox SET updated_at = now() - interval '1 hour' WHERE key = 'never-seen';
             UPDATE postie_inbox SET attempts = 1 WHERE key LIKE 'cancelled-job-%'",
        )
        .await
        .unwrap();

    // The rates' rows: kept for their day (and feedback as long as finished jobs),
    // then pruned.
    env.db()
        .await
        .batch_execute(
            "INSERT INTO postie_send_tally (minute, type, sent) VALUES
                 (now() - interval '3 days', 'order', 5), (date_trunc('minute', now()), 'order', 7);
             INSERT INTO postie_feedback (source, notification_id, kind, address, evidence, received_at)
                 VALUES ('smtp', 'old', 'bounce', 'x@example.com', '550', now() - interval '3 days'),
                        ('smtp', 'new', 'bounce', 'x@example.com', '550', now())",
        )
        .await
        .unwrap();
    let dry = postie(&["prune", "--dry-run"], &vars);
    assert!(
        dry.contains("would delete: 34 finished rows") && dry.contains("0 tombstones"),
        "{dry}"
    );
    assert!(
        dry.contains("2 bounce and complaint records and send tallies"),
        "{dry}"
    );
    assert_eq!(env.inbox_count("true").await, 30 + 30 + 15 + 1 + 4);
    let done = postie(&["prune"], &vars);
    assert!(done.contains("deleted: 34 finished rows"), "{done}");
    for (table, left) in [
        ("postie_send_tally", "sent = 7"),
        ("postie_feedback", "notification_id = 'new'"),
    ] {
        let rows = env
            .db()
            .await
            .query(&format!("SELECT {left} FROM {table}"), &[])
            .await
            .unwrap();
        assert!(
            rows.len() == 1 && rows[0].get::<_, bool>(0),
            "{table}: only the recent row is left"
        );
    }
    assert_eq!(
        env.inbox_count("status IN ('sending', 'retrying', 'scheduled')")
            .await,
        30,
        "an in-flight row was pruned"
    );
    assert_eq!(env.inbox_count("key LIKE 'young-%'").await, 15);
    assert_eq!(
        env.inbox_count("key = 'never-seen'").await,
        1,
        "tombstone kept (1d)"
    );

    // Tombstones follow their own retention.
    vars.retain(|(k, _)| k != "POSTIE__INBOX__TOMBSTONE_RETENTION");
    let done = postie(&["prune"], &vars);
    assert!(done.contains("1 tombstones"), "{done}");
    assert_eq!(env.inbox_count("key = 'never-seen'").await, 0);
    assert_eq!(
        env.inbox_count("status IN ('sending', 'retrying', 'scheduled')")
            .await,
        30
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_of_three_runs_maintenance_and_another_takes_over_when_it_dies() {
    let env = TestEnv::new("leader").await;
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut instances: Vec<_> = ports
        .iter()
        .map(|port| {
            let listen = format!("127.0.0.1:{port}");
            env.spawn_process(&[
                ("POSTIE__HTTP__LISTEN", listen.as_str()),
                ("POSTIE__INBOX__PRUNE_INTERVAL", "1s"),
            ])
        })
        .collect();
    let leaders = |alive: Vec<u16>| async move {
        let mut flags = Vec::new();
        for port in alive {
            let text = get(&format!("http://127.0.0.1:{port}/metrics")).await?;
            flags.push(sample(&text, "postie_maintenance_leader")? as i64);
        }
        Some(flags)
    };
    let flags = eventually(
        "exactly one leader among three",
        Duration::from_secs(60),
        || async {
            let flags = leaders(ports.clone()).await?;
            (flags.iter().sum::<i64>() == 1).then_some(flags)
        },
    )
    .await;
    // It stays one over a few lock retries.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(leaders(ports.clone()).await, Some(flags.clone()));
    let leader = flags.iter().position(|f| *f == 1).unwrap();
    let text = get(&format!("http://127.0.0.1:{}/metrics", ports[leader]))
        .await
        .unwrap();
    assert!(text.contains("postie_queue_depth{queue=\""), "{text}");
    for (i, port) in ports.iter().enumerate() {
        if i != leader {
            let text = get(&format!("http://127.0.0.1:{port}/metrics"))
                .await
                .unwrap();
            assert!(
                !text.contains("postie_queue_depth{"),
                "a standby polls: {text}"
            );
        }
    }

    instances[leader].kill9();
    let killed = Instant::now();
    let rest: Vec<u16> = (0..3).filter(|i| *i != leader).map(|i| ports[i]).collect();
    let flags = eventually(
        "another instance takes maintenance over",
        Duration::from_secs(60),
        || async {
            let flags = leaders(rest.clone()).await?;
            (flags.iter().sum::<i64>() == 1).then_some(flags)
        },
    )
    .await;
    let took = killed.elapsed();
    // Still working: a job is sent.
    env.publish(&job("after-takeover", "a@example.com")).await;
    env.wait_for_emails("a send after the takeover", 1, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(leaders(rest.clone()).await, Some(flags));
    eprintln!(
        "FIGURES leader: maintenance taken over {:.1}s after SIGKILL of the leader (standbys try every 2s)",
        took.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_a_large_backlog_while_sending_fails_no_send() {
    const BACKLOG: i64 = 200_000;
    const JOBS: usize = 3_000;
    let env = TestEnv::new("backlog").await;
    // The instance itself keeps everything (default 30 days); `postie prune` with a
    // one-hour retention deletes the backlog in the middle of the run.
    let serving = env.serve(env.settings());
    inbox_table(&env).await;
    insert_rows(&env, "old", "sent", BACKLOG, "2 hours").await;
    sql(&env, "ANALYZE postie_inbox").await;
    let before = size(&env).await;
    let bodies: Vec<_> = (0..JOBS)
        .map(|i| job(&format!("load-{i}"), "a@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    env.wait_for_emails("a steady flow", JOBS / 4, Duration::from_secs(300))
        .await;
    let mut vars = env.env_vars();
    vars.push(("POSTIE__INBOX__RETENTION".into(), "1h".into()));
    let now_ms = || chrono::Utc::now().timestamp_millis();
    let prune_from = now_ms();
    let run = tokio::task::spawn_blocking(move || run_postie(&["prune"], &vars))
        .await
        .unwrap();
    let prune_to = now_ms();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout
            .contains(&format!("deleted: {BACKLOG} finished rows")),
        "{}",
        run.stdout
    );
    env.wait_for_emails("every job", JOBS, Duration::from_secs(300))
        .await;
    serving.stop().await;
    let after = size(&env).await;
    sql(&env, "VACUUM postie_inbox").await;
    let vacuumed = size(&env).await;

    assert_eq!(env.inbox_count("key LIKE 'old-%'").await, 0);
    assert_eq!(env.inbox_count("status = 'sent'").await, JOBS as i64);
    assert_eq!(env.inbox_count("status <> 'sent'").await, 0);
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "a send failed"
    );
    let arrivals = env.arrivals().await;
    assert_eq!(arrivals.len(), JOBS);
    assert!(
        arrivals.values().all(|at| at.len() == 1),
        "a duplicate email"
    );
    // Send rate before, during and after the prune, from the sink's arrival times.
    let mut times: Vec<i64> = arrivals.values().flatten().copied().collect();
    times.sort_unstable();
    let rate = |from: i64, to: i64| {
        let n = times.iter().filter(|t| **t >= from && **t < to).count();
        n as f64 * 1000.0 / (to - from).max(1) as f64
    };
    let (first, last) = (times[0], times[times.len() - 1]);
    let prune_s = (prune_to - prune_from) as f64 / 1000.0;
    let mb = |b: i64| b as f64 / 1_048_576.0;
    eprintln!(
        "FIGURES backlog: `postie prune` deleted {BACKLOG} rows in {prune_s:.2}s ({:.0} rows/s, process start included) \
         while sending; emails/s before {:.0}, during {:.0}, after {:.0}; \
         postie_inbox total/heap/indexes MB: {:.1}/{:.1}/{:.1} with the backlog, \
         {:.1}/{:.1}/{:.1} after the run, {:.1}/{:.1}/{:.1} after VACUUM; prune said: {}",
        BACKLOG as f64 / prune_s,
        rate(first, prune_from),
        rate(prune_from, prune_to),
        rate(prune_to, last + 1),
        mb(before.0), mb(before.1), mb(before.2),
        mb(after.0), mb(after.1), mb(after.2),
        mb(vacuumed.0), mb(vacuumed.1), mb(vacuumed.2),
        run.stdout.replace('\n', " "),
    );
}

/// Total, heap and index bytes of `postie_inbox`.
async fn size(env: &TestEnv) -> (i64, i64, i64) {
    let row = env
        .db()
        .await
        .query_one(
            "SELECT pg_total_relation_size('postie_inbox'),
                    pg_relation_size('postie_inbox'),
                    pg_indexes_size('postie_inbox')",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// The database leg of `make bench` (claim + mark sent of 20,000 new keys by 64 tasks
/// through postie's default pool of 16 connections) with the inbox pre-filled with
/// sent rows: 0, 10^5 and 10^6 by default (`POSTIE_PREFILL=0,100000,1000000,10000000`).
/// Slow and disk-hungry: `cargo test --release --test retention -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn database_leg_with_a_prefilled_inbox() {
    use postie::testing::inbox::{Claim, Completion, Inbox};
    const N: usize = 20_000;
    const TASKS: usize = 64;
    let sizes: Vec<i64> = std::env::var("POSTIE_PREFILL")
        .unwrap_or_else(|_| "0,100000,1000000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("a row count"))
        .collect();
    let env = TestEnv::new("prefill").await;
    let settings = env.settings();
    let inbox = Inbox::new(&settings.database.plan().unwrap(), &settings.database).unwrap();
    inbox.migrate().await.unwrap();
    let lease = settings.worker.lease;
    let mut filled = 0i64;
    for (round, rows) in sizes.into_iter().enumerate() {
        if rows > filled {
            env.db()
                .await
                .execute(
                    "INSERT INTO postie_inbox (key, status, message_id, sent_at, updated_at)
                     SELECT 'fill-' || g || ':order-confirmation', 'sent',
                            '<fill-' || g || '@postie.local>', now(), now()
                       FROM generate_series($1::bigint + 1, $2::bigint) g",
                    &[&filled, &rows],
                )
                .await
                .unwrap();
            // Measured after the fill's own writes are on disk, not under them.
            for statement in ["VACUUM ANALYZE postie_inbox", "CHECKPOINT"] {
                sql(&env, statement).await;
            }
            filled = rows;
        }
        let started = Instant::now();
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (inbox, next) = (inbox.clone(), next.clone());
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= N {
                            return;
                        }
                        let key = format!("db-{round}-{i}");
                        let Claim::Claimed { fence, .. } =
                            inbox.claim(&key, "bench", lease, 0).await.unwrap()
                        else {
                            panic!("{key} was not claimable");
                        };
                        let due = chrono::Utc::now().timestamp_millis();
                        let message_id = message_id(&key);
                        let sent = Completion::Sent {
                            message_id: &message_id,
                            due_ms: due,
                            provider: "smtp",
                            provider_message_id: None,
                        };
                        assert!(inbox.complete(&key, fence, None, sent).await.unwrap());
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let seconds = started.elapsed().as_secs_f64();
        let (total, _, indexes) = size(&env).await;
        eprintln!(
            "FIGURES prefill: {filled} rows before: claim + complete (sent) {:.0}/s ({N} keys, {TASKS} tasks); \
             postie_inbox {:.0} MB ({:.0} MB indexes)",
            N as f64 / seconds,
            total as f64 / 1_048_576.0,
            indexes as f64 / 1_048_576.0
        );
    }
}

/// Issue 14's size figure: one release `postie serve` sends `POSTIE_RETENTION_RUN_N`
/// emails (default 200,000) with `inbox.retention` 10 s and a prune every 5 s; the
/// inbox's rows and size are sampled while it runs and after the last prune.
/// `cargo test --release --test retention -- --ignored --nocapture size_after_a_run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn size_after_a_run_with_short_retention() {
    use support::bench::{broker_connection, publish_bodies};
    let n: usize = std::env::var("POSTIE_RETENTION_RUN_N")
        .ok()
        .map(|v| v.parse().expect("a job count"))
        .unwrap_or(200_000);
    let env = TestEnv::new("sizerun").await;
    let mut postie = env.spawn_process(&[
        ("POSTIE__INBOX__RETENTION", "10s"),
        ("POSTIE__INBOX__PRUNE_INTERVAL", "5s"),
    ]);
    inbox_table(&env).await;
    let conn = broker_connection("postie-size-run").await;
    let channel = postie::testing::broker::confirm_channel(&conn)
        .await
        .unwrap();
    let exchange = env.topology.work_exchange().to_owned();
    let started = Instant::now();
    let publishing = tokio::spawn(async move {
        let bodies = (0..n).map(|i| {
            job(&format!("run-{i}"), "a@example.com")
                .to_string()
                .into_bytes()
        });
        publish_bodies(
            &channel,
            &exchange,
            postie::testing::broker::ROUTING_KEY,
            bodies,
        )
        .await;
        conn
    });
    let mut peak = (0i64, 0i64, 0i64, 0i64);
    let mut next_report = 50_000;
    // Pruning leaves the space to autovacuum. Where the server runs none (this test
    // machine's PostgreSQL), the test vacuums every 10 s in its stead.
    let autovacuum = env
        .db()
        .await
        .query_one("SHOW autovacuum", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
        == "on";
    let mut next_vacuum = Instant::now() + Duration::from_secs(10);
    loop {
        if !autovacuum && Instant::now() >= next_vacuum {
            sql(&env, "VACUUM postie_inbox").await;
            next_vacuum = Instant::now() + Duration::from_secs(10);
        }
        let sent = env.sink.stats().await.accepted as usize;
        let (total, heap, indexes) = size(&env).await;
        let now_rows = env.inbox_count("true").await;
        if total > peak.0 {
            peak = (total, heap, indexes, now_rows);
        }
        if sent >= next_report {
            // The growth curve: a bounded inbox levels off.
            eprintln!(
                "size run: {sent} sent, {now_rows} rows, postie_inbox {:.1} MB ({:.1} MB indexes)",
                total as f64 / 1_048_576.0,
                indexes as f64 / 1_048_576.0
            );
            next_report += 50_000;
        }
        if sent >= n {
            break;
        }
        if let Ok(Some(status)) = postie.child.try_wait() {
            panic!("postie exited ({status}):\n{}", postie.log());
        }
        assert!(
            started.elapsed() < Duration::from_secs(1_800),
            "{sent} of {n} emails after 30 minutes"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = publishing.await.unwrap().close(200, "done".into()).await;
    // Retention 10 s plus one prune interval, and a margin, after the last send.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let left = env.inbox_count("true").await;
    let after = size(&env).await;
    postie.terminate(Duration::from_secs(30));
    sql(&env, "VACUUM postie_inbox").await;
    let vacuumed = size(&env).await;
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.len(), n, "every job sent");
    assert!(per_id.values().all(|c| *c == 1), "a duplicate email");
    assert_eq!(left, 0, "every row is older than retention and finished");
    let mb = |b: i64| b as f64 / 1_048_576.0;
    eprintln!(
        "FIGURES size run: {n} emails in {seconds:.0}s ({:.0}/s), retention 10s, prune every 5s, {}; \
         postie_inbox total/heap/indexes MB: peak {:.1}/{:.1}/{:.1} ({} rows then); \
         20 s after the last send {:.1}/{:.1}/{:.1} ({left} rows); after VACUUM {:.1}/{:.1}/{:.1}",
        n as f64 / seconds,
        if autovacuum {
            "autovacuum on"
        } else {
            "autovacuum off: VACUUM every 10 s by the test"
        },
        mb(peak.0),
        mb(peak.1),
        mb(peak.2),
        peak.3,
        mb(after.0),
        mb(after.1),
        mb(after.2),
        mb(vacuumed.0),
        mb(vacuumed.1),
        mb(vacuumed.2),
    );
}
