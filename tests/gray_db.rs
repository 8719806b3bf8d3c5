//! Gray failures of the dependencies, with real services: PostgreSQL turned read-only
//! (a failover to a standby), a broker that accepts connections but refuses the
//! declaration, a publishing channel the broker closes.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::{free_port, job, pg_admin, TestEnv};

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
    let dead_during = env.depth(&env.topology.dead_queue()).await;
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
            let ended = env.sink.count().await + env.depth(&dead_queue).await as usize;
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
