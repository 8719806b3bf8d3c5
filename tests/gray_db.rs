//! Gray failures of the dependencies, with real services: PostgreSQL turned read-only
//! (a failover to a standby), a broker that accepts connections but refuses the
//! declaration, a publishing channel the broker closes.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use support::proxy::Proxy;
use support::{free_port, job, message_id, pg_admin, TestEnv};

/// Turns the test's own database read-only (`on`) or back, and ends its sessions so
/// that every new one takes the setting (as a failover to a standby would).
async fn set_read_only(env: &TestEnv, on: bool) {
    let admin = pg_admin("postgres").await;
    let db = &env.db_name;
    let sql = if on {
        format!("ALTER DATABASE {db} SET default_transaction_read_only = on")
    } else {
        format!("ALTER DATABASE {db} RESET default_transaction_read_only")
    };
    admin.batch_execute(&sql).await.unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&db.as_str()],
        )
        .await
        .unwrap();
}

/// `/readyz`'s status code, or None if the instance does not answer.
async fn readyz(port: u16) -> Option<u16> {
    let url = format!("http://127.0.0.1:{port}/readyz");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    Some(client.get(url).send().await.ok()?.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gd_a_read_only_database_holds_jobs_and_dead_letters_none() {
    const JOBS: usize = 600;
    let env = TestEnv::new("gd-readonly").await;
    // About 40 emails/s over the two instances, so the outage falls mid-run.
    env.sink
        .set_faults(serde_json::json!([{"stage": "data_end", "action": {"delay_ms": 100}}]))
        .await;
    let bodies: Vec<_> = (0..JOBS)
        .map(|i| job(&format!("gd-ro-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    let ports = [free_port(), free_port()];
    let instances: Vec<_> = ports
        .iter()
        .map(|port| {
            let listen = format!("127.0.0.1:{port}");
            env.spawn_process(&[
                ("POSTIE__WORKER__CONCURRENCY", "2"),
                ("POSTIE__AMQP__PREFETCH", "2"),
                ("POSTIE__HTTP__LISTEN", listen.as_str()),
            ])
        })
        .collect();
    env.wait_for_emails("a sixth sent", JOBS / 6, Duration::from_secs(120))
        .await;

    set_read_only(&env, true).await;
    let started = Instant::now();
    let sent_at_start = env.sink.count().await;
    let mut not_ready_seen = [false, false];
    while started.elapsed() < Duration::from_secs(20) {
        for (seen, port) in not_ready_seen.iter_mut().zip(ports) {
            *seen |= readyz(port).await.is_some_and(|code| code != 200);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let sent_during = env.sink.count().await - sent_at_start;
    let dead_during = env.depth(env.topology.dead_queue()).await;
    set_read_only(&env, false).await;

    let logs = || {
        instances
            .iter()
            .map(|p| p.log())
            .collect::<Vec<_>>()
            .join("\n")
    };
    // Every job ends: sent, or (the failure this test guards against) dead.
    let dead_queue = env.topology.dead_queue();
    support::eventually(
        "every job sent or dead",
        Duration::from_secs(300),
        || async {
            let ended = env.sink.count().await + env.depth(dead_queue).await as usize;
            (ended >= JOBS).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        *per_id.entry(m.message_id).or_default() += 1;
    }
    let dead = env.take_dead_letters().await;
    let duplicates: usize = per_id.values().map(|c| c - 1).sum();
    eprintln!(
        "FIGURES read-only: {JOBS} jobs, 2 instances, database read-only 20 s: \
         sent {} distinct, duplicates {duplicates}, dead {} (dead during the outage {dead_during}), \
         sent during the outage {sent_during}",
        per_id.len(),
        dead.len()
    );
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason()).take(3).collect();
    assert!(dead.is_empty(), "dead-lettered: {reasons:?}");
    assert_eq!(per_id.len(), JOBS, "lost jobs; logs:\n{}", logs());
    assert_eq!(duplicates, 0, "duplicate emails");
    let logs = logs();
    assert!(
        logs.contains("the database is read-only (25006)"),
        "no log line names the cause; logs:\n{logs}"
    );
    assert_eq!(
        not_ready_seen,
        [true, true],
        "both instances report not ready while the database is read-only"
    );
}

/// A channel of the test's own on the test's broker.
async fn test_channel(env: &TestEnv) -> (lapin::Connection, lapin::Channel) {
    let conn = postie::testing::broker::connect(
        &postie::config::AmqpAddresses::parse(&secrecy::SecretString::from(env.amqp_url.clone()))
            .unwrap(),
        "postie-test-gd",
        Duration::from_secs(10),
    )
    .await
    .map(|c| c.connection)
    .unwrap();
    let channel = conn.create_channel().await.unwrap();
    (conn, channel)
}

/// The times (Unix ms) of the log lines that contain `what`.
fn logged_at(log: &str, what: &str) -> Vec<i64> {
    log.lines()
        .filter(|line| line.contains(what))
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|stamp| chrono::DateTime::parse_from_rfc3339(stamp).ok())
        .map(|t| t.timestamp_millis())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gd_a_broker_that_refuses_the_declaration_is_redialled_ever_more_slowly() {
    const CAP_MS: i64 = 4_000;
    let env = TestEnv::new("gd-redial").await;
    let postie = env.spawn_process(&[("POSTIE__WORKER__OUTAGE_BACKOFF_MAX", "4s")]);
    env.publish(&job("gd-redial-before", "x@example.com")).await;
    env.emails_or_log(&postie, "the first job", 1, Duration::from_secs(60))
        .await;

    // The dead-letter queue redeclared as a classic queue: postie's declaration (a
    // quorum queue) now gets 406 PRECONDITION_FAILED on every session. Deleting the
    // send queue (empty by now) ends the running session.
    let (_conn, channel) = test_channel(&env).await;
    env.delete_queue(env.topology.dead_queue()).await;
    channel
        .queue_declare(
            env.topology.dead_queue().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    env.delete_queue(env.topology.send_queue()).await;
    tokio::time::sleep(Duration::from_secs(30)).await;

    let failed = logged_at(&postie.log(), "broker session failed; reconnecting");
    let gaps: Vec<i64> = failed.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!(
        "FIGURES refused declaration: {} failed sessions in 30 s, gaps (ms) {gaps:?}",
        failed.len()
    );
    // Growing from 100-200 ms to the cap (each wait random in [cap/2, cap]): in 30 s
    // about a dozen attempts, not 150.
    assert!(
        (5..=20).contains(&failed.len()),
        "{} failed sessions in 30 s; log:\n{}",
        failed.len(),
        postie.log()
    );
    assert!(
        gaps[0] < 1_000,
        "the first redial waits at most 200 ms: {gaps:?}"
    );
    let last = &gaps[gaps.len() - 3..];
    assert!(
        last.iter()
            .all(|gap| (CAP_MS / 2..=CAP_MS + 1_500).contains(gap)),
        "the redial interval did not reach its cap: {gaps:?}"
    );

    // The operator fixes the queue: the next session declares everything, and jobs flow.
    env.delete_queue(env.topology.dead_queue()).await;
    env.publish(&job("gd-redial-after", "x@example.com")).await;
    env.emails_or_log(&postie, "the job after the fix", 2, Duration::from_secs(60))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gd_a_publish_channel_closed_by_the_broker_is_replaced() {
    const JOBS: usize = 20;
    let env = TestEnv::new("gd-pubchan").await;
    // Every job's first attempt is refused with a 4xx: its outcome is a republish to
    // the retry exchange, which is gone: the broker closes the publishing channel (404).
    env.sink
        .set_faults(serde_json::json!([{"stage": "rcpt", "action": {"reply": "451 4.3.0 try later"}, "times": JOBS}]))
        .await;
    let postie = env.spawn_process(&[]);
    let send_queue = env.topology.send_queue();
    support::eventually("postie consuming", Duration::from_secs(60), || async {
        (env.consumers(send_queue).await > 0).then_some(())
    })
    .await;
    let (_conn, channel) = test_channel(&env).await;
    channel
        .exchange_delete(
            env.topology.retry_exchange().into(),
            ExchangeDeleteOptions::default(),
        )
        .await
        .unwrap();
    let bodies: Vec<_> = (0..JOBS)
        .map(|i| job(&format!("gd-pc-{i}"), "x@example.com"))
        .collect();
    env.publish_many(&bodies).await;
    support::eventually("a republish refused", Duration::from_secs(60), || async {
        let log = postie.log();
        (log.contains("republish refused") || log.contains("could not publish the outcome"))
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Nothing goes out while the exchange is gone, unless the session was rebuilt in
    // the meantime (a missed heartbeat on a loaded machine): its declaration puts the
    // exchange back. Either way every job must end sent once, below.
    let early = env.sink.count().await;
    if early > 0 {
        eprintln!("gd: {early} sent before the test restored the exchange (a session rebuilt it)");
    }

    // The exchange is back: the republishes go through on a new channel.
    let (_conn2, channel2) = test_channel(&env).await;
    env.topology.declare(&channel2).await.unwrap();
    env.emails_or_log(&postie, "every job", JOBS, Duration::from_secs(90))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.len(), JOBS);
    assert!(per_id.values().all(|&n| n == 1), "duplicates: {per_id:?}");
    assert!(env.take_dead_letters().await.is_empty(), "dead-lettered");
    assert!(
        postie
            .log()
            .contains("the broker closed the publishing channel; publishing on a new one"),
        "no replacement logged"
    );
}

/// A database that stops answering (its network path frozen: connections stay open,
/// no byte comes back): each worker statement waits at most
/// `database.statement_timeout`, then the instance reports the database unreachable
/// and holds its jobs; thawed, every job is sent once and none is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gd_a_database_that_stops_answering_is_an_outage_within_the_statement_timeout() {
    let env = TestEnv::new("gd-frozen").await;
    let pg = Proxy::start("127.0.0.1:5432").await;
    let port = free_port();
    let url = format!("postgres://postgres@{}/{}", pg.addr(), env.db_name);
    let listen = format!("127.0.0.1:{port}");
    let postie = env.spawn_process(&[
        ("POSTIE__DATABASE__URL", url.as_str()),
        ("POSTIE__DATABASE__STATEMENT_TIMEOUT", "2s"),
        ("POSTIE__HTTP__LISTEN", listen.as_str()),
    ]);
    env.publish(&job("gd-frozen-0", "x@example.com")).await;
    env.emails_or_log(&postie, "the first email", 1, Duration::from_secs(60))
        .await;
    // Let the first email's bookkeeping (its completion, its event, start-up's
    // maintenance) give its connections back: the freeze is to find them open and
    // idle, as the scenario says, not all in use and a new one being dialled.
    tokio::time::sleep(Duration::from_secs(3)).await;

    pg.freeze();
    let frozen_at = Instant::now();
    for i in 1..=5 {
        env.publish(&job(&format!("gd-frozen-{i}"), "x@example.com"))
            .await;
    }
    let mut reported = None;
    while frozen_at.elapsed() < Duration::from_secs(30) {
        if readyz(port).await == Some(503) {
            reported = Some(frozen_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let reported = reported.unwrap_or_else(|| {
        panic!(
            "still ready 30 s into the freeze; postie's log:\n{}",
            postie.log()
        )
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        env.sink.count().await,
        1,
        "nothing claimed, so nothing sent"
    );
    pg.thaw();
    env.emails_or_log(
        &postie,
        "every job after the thaw",
        6,
        Duration::from_secs(90),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let per_id = env.emails_per_id().await;
    for i in 0..=5 {
        assert_eq!(per_id.get(&message_id(&format!("gd-frozen-{i}"))), Some(&1));
    }
    assert_eq!(per_id.len(), 6);
    assert!(env.take_dead_letters().await.is_empty());
    assert!(
        postie.log().contains("no answer within 2s"),
        "the cause named; log:\n{}",
        postie.log()
    );
    println!(
        "FIGURES frozen database: not ready {} ms into the freeze (statement_timeout 2 s); \
         6 of 6 sent once after the thaw, 0 dead",
        reported.as_millis()
    );
}
