//! Fault-injection harness (in the spirit of Jepsen's RabbitMQ tests) proving the
//! invariants of ARCHITECTURE.md ("Invariants") under faults, with a report anyone can rerun.
//!
//! A publisher sends N jobs with confirms (some duplicated keys, some delayed, some
//! destined to fail) while three `postie serve` processes work and a nemesis injects
//! faults at random: SIGKILL of an instance (restarted), RabbitMQ restart, PostgreSQL
//! restart, SMTP 4xx and 5xx bursts, SMTP connection dropped after DATA (with the
//! message accepted), and SMTP latency past postie's timeout. Then faults stop, the
//! system drains, and the report counts, per key: lost, duplicated (and whether each
//! duplicate is explained by the known window: an SMTP acceptance postie did not see
//! before its `sent` commit), dead-lettered by reason, early, still pending.
//!
//! `make chaos` runs the full size (POSTIE_CHAOS_JOBS=10000, POSTIE_CHAOS_FAULTS=20 of
//! each kind; POSTIE_CHAOS_SEED to repeat a run) and writes target/chaos/report.json.
//! The smoke version runs with the tests. This binary restarts the shared RabbitMQ and
//! PostgreSQL; `cargo test` runs test binaries one at a time, so no other test sees it.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker;
use postie::testing::broker::ROUTING_KEY;
use postie::testing::contract::IdempotencyKey;
use postie::testing::headers::HEADER_PUBLISHED_AT;
use secrecy::SecretString;
use serde_json::json;
use support::{amqp_url, job, PostieProcess, TestEnv};

/// A small deterministic PRNG (xorshift64*), so a seed reproduces a run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill9,
    RabbitRestart,
    PostgresRestart,
    Smtp4xx,
    Smtp5xx,
    SmtpDropAfterData,
    SmtpLatency,
}

const FAULTS: [Fault; 7] = [
    Fault::Kill9,
    Fault::RabbitRestart,
    Fault::PostgresRestart,
    Fault::Smtp4xx,
    Fault::Smtp5xx,
    Fault::SmtpDropAfterData,
    Fault::SmtpLatency,
];

/// A job as the publisher planned it.
#[derive(Clone)]
struct Planned {
    key: String,
    body: serde_json::Value,
    delay_ms: i64,
    /// Recipient the sink always rejects with 5xx: must end dead-lettered.
    doomed: bool,
}

#[derive(Default)]
struct Published {
    attempted: usize,
    confirmed: BTreeSet<usize>,
    /// Due time per confirmed delayed publish (index → Unix ms).
    due: BTreeMap<usize, i64>,
}

/// Settings the chaos instances run with, on top of the test world's (retry steps
/// 1 s, 2 s, 5 s; SMTP timeout 2 s; lease 5 s): a job that a burst of 4xx replies
/// outlasts ends dead-lettered with its reason, which the report counts. A broker
/// restart can strand ladder jobs in a queue's at-least-once dead-letter process; the
/// reconciler re-publishes them 5 s after they are due (60 s by default).
fn chaos_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("POSTIE__WORKER__DRAIN_TIMEOUT", "5s"),
        ("POSTIE__DELAY__RECONCILE_GRACE", "5s"),
        ("RUST_LOG", "warn,postie=warn"),
    ]
}

fn plan(n: usize, rng: &mut Rng) -> Vec<Planned> {
    let mut jobs: Vec<Planned> = Vec::with_capacity(n);
    for i in 0..n {
        // 10% repeat an earlier key (a producer retrying); 3% are doomed; 30% delayed.
        if i > 10 && rng.chance(10) {
            let earlier = jobs[rng.below(i as u64) as usize].clone();
            jobs.push(earlier);
            continue;
        }
        let key = format!("chaos-{i}");
        let doomed = rng.chance(3);
        let to = if doomed {
            "reject-me@example.com".to_string()
        } else {
            format!("user{}@example.com", i % 97)
        };
        let delay_ms = if rng.chance(30) {
            rng.below(20_000) as i64
        } else {
            0
        };
        jobs.push(Planned {
            body: job(&key, &to),
            key,
            delay_ms,
            doomed,
        });
    }
    jobs
}

/// Publishes every planned job with confirms, reconnecting through broker restarts.
/// Publishes that fail are attempted but not confirmed (and not retried).
async fn publish_all(
    exchange: String,
    jobs: Vec<Planned>,
    pace: Duration,
    out: Arc<Mutex<Published>>,
) {
    let url = SecretString::from(amqp_url());
    let mut channel: Option<(lapin::Connection, lapin::Channel)> = None;
    for (i, planned) in jobs.iter().enumerate() {
        out.lock().unwrap().attempted += 1;
        if channel
            .as_ref()
            .is_none_or(|(c, _)| !c.status().connected())
        {
            channel = None;
            for _ in 0..40 {
                if let Ok(conn) = broker::connect(
                    &postie::config::AmqpAddresses::parse(&url).unwrap(),
                    "chaos-publisher",
                    Duration::from_secs(5),
                )
                .await
                .map(|c| c.connection)
                {
                    if let Ok(ch) = broker::confirm_channel(&conn).await {
                        channel = Some((conn, ch));
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let Some((_, ch)) = &channel else { continue };
        let published = chrono::Utc::now().timestamp_millis();
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(published),
        );
        if planned.delay_ms > 0 {
            headers.insert("x-delay".into(), AMQPValue::LongLongInt(planned.delay_ms));
        }
        let props = broker::job_properties().with_headers(headers);
        let body = planned.body.to_string();
        let confirmed = match ch
            .basic_publish(
                exchange.as_str().into(),
                ROUTING_KEY.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                props,
            )
            .await
        {
            Ok(confirm) => match tokio::time::timeout(Duration::from_secs(10), confirm).await {
                Ok(Ok(c)) => c.is_ack() && c.take_message().is_none(),
                _ => false,
            },
            Err(_) => false,
        };
        if confirmed {
            let mut out = out.lock().unwrap();
            out.confirmed.insert(i);
            out.due.insert(i, published + planned.delay_ms);
        } else {
            channel = None;
        }
        tokio::time::sleep(pace).await;
    }
}

fn rabbitmqctl(args: &[&str]) {
    let _ = support::rabbitmqctl_command(args)
        .stdout(std::process::Stdio::null())
        .status();
}

/// Always-on rule: doomed recipients get a 5xx; plus the current fault, if any.
fn sink_rules(fault: Option<serde_json::Value>) -> serde_json::Value {
    let mut rules = vec![
        json!({"stage": "rcpt", "rcpt_contains": "reject-me", "action": {"reply": "550 5.1.1 chaos: no such user"}}),
    ];
    rules.extend(fault);
    serde_json::Value::Array(rules)
}

/// Ready messages across every queue of the topology, on a fresh connection.
async fn total_depth(env: &TestEnv) -> Option<u64> {
    let conn = broker::connect(
        &postie::config::AmqpAddresses::parse(&SecretString::from(amqp_url())).unwrap(),
        "chaos-depth",
        Duration::from_secs(5),
    )
    .await
    .map(|c| c.connection)
    .ok()?;
    let mut total = 0u64;
    for queue in env.topology.queues() {
        if queue == env.topology.dead_queue() {
            continue;
        }
        let ch = conn.create_channel().await.ok()?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        total += u64::from(
            ch.queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await
                .ok()?
                .message_count(),
        );
    }
    let _ = conn.close(200, "bye".into()).await;
    Some(total)
}

struct Report {
    seed: u64,
    attempted: usize,
    confirmed: usize,
    unique_confirmed_keys: usize,
    emails_received: usize,
    keys_received: usize,
    lost: Vec<String>,
    duplicated_keys: usize,
    duplicate_emails: usize,
    duplicates_in_known_window: usize,
    unexplained_duplicates: Vec<String>,
    dead_by_reason: BTreeMap<String, usize>,
    doomed_not_dead: Vec<String>,
    early: usize,
    pending: usize,
    /// Jobs the reconciler re-published (stranded in the ladder).
    reconciled: i64,
    faults: BTreeMap<String, usize>,
    elapsed_s: f64,
}

async fn run(jobs_n: usize, faults_per_kind: usize, seed: u64) -> Report {
    let started = Instant::now();
    eprintln!("chaos: seed {seed} (POSTIE_CHAOS_SEED={seed} repeats this run), {jobs_n} jobs, {faults_per_kind} faults of each kind");
    let mut rng = Rng(seed | 1);
    let env = TestEnv::new("chaos").await;
    env.sink.set_faults(sink_rules(None)).await;
    let jobs = plan(jobs_n, &mut rng);
    let extra = chaos_env();
    let mut instances: Vec<PostieProcess> = (0..3).map(|_| env.spawn_process(&extra)).collect();

    // The nemesis' schedule: every kind `faults_per_kind` times, shuffled.
    let mut schedule: Vec<Fault> = FAULTS
        .iter()
        .flat_map(|f| std::iter::repeat_n(*f, faults_per_kind))
        .collect();
    for i in (1..schedule.len()).rev() {
        schedule.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let fault_gap = Duration::from_millis(2_500);
    let window = fault_gap * schedule.len() as u32;
    let pace = window / (jobs_n as u32).max(1);
    let published = Arc::new(Mutex::new(Published::default()));
    let publisher = tokio::spawn(publish_all(
        env.topology.delayed_exchange().to_owned(),
        jobs.clone(),
        pace,
        published.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    for instance in instances.iter_mut() {
        if let Ok(Some(status)) = instance.child.try_wait() {
            panic!(
                "a postie instance exited at start-up ({status}):\n{}",
                instance.log()
            );
        }
    }

    let mut injected: BTreeMap<String, usize> = BTreeMap::new();
    for fault in &schedule {
        tokio::time::sleep(fault_gap).await;
        *injected.entry(format!("{fault:?}")).or_default() += 1;
        match fault {
            Fault::Kill9 => {
                let i = rng.below(instances.len() as u64) as usize;
                instances[i].kill9();
                tokio::time::sleep(Duration::from_millis(500 + rng.below(1500))).await;
                instances[i] = env.spawn_process(&extra);
            }
            Fault::RabbitRestart => {
                rabbitmqctl(&["stop_app"]);
                tokio::time::sleep(Duration::from_millis(1000 + rng.below(3000))).await;
                rabbitmqctl(&["start_app"]);
                rabbitmqctl(&["await_startup", "--timeout", "60"]);
            }
            Fault::PostgresRestart => {
                support::restart_postgres();
            }
            smtp => {
                let times = 3 + rng.below(10);
                let rule = match smtp {
                    Fault::Smtp4xx => {
                        json!({"stage": "rcpt", "action": {"reply": "451 4.3.0 chaos: try later"}, "times": times})
                    }
                    Fault::Smtp5xx => {
                        json!({"stage": "data_end", "action": {"reply": "554 5.6.0 chaos: rejected"}, "times": times})
                    }
                    Fault::SmtpDropAfterData => {
                        json!({"stage": "data_end", "action": {"drop": true, "deliver": true}, "times": times})
                    }
                    _ => {
                        json!({"stage": "data_end", "action": {"delay_ms": 3_000}, "times": times})
                    }
                };
                env.sink.set_faults(sink_rules(Some(rule))).await;
                tokio::time::sleep(Duration::from_millis(1500)).await;
                env.sink.set_faults(sink_rules(None)).await;
            }
        }
    }
    publisher.await.unwrap();
    env.sink.set_faults(sink_rules(None)).await;
    for instance in instances.iter_mut() {
        if !matches!(instance.child.try_wait(), Ok(None)) {
            *instance = env.spawn_process(&extra);
        }
    }

    // Drain: every queue but the DLQ empty and no claim in flight, three checks running.
    let drain_deadline = Instant::now() + Duration::from_secs(300);
    let mut quiet = 0;
    while Instant::now() < drain_deadline && quiet < 3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let depth = total_depth(&env).await;
        let busy: Option<i64> = async {
            let client = env.db().await;
            let row = client
                .query_one(
                    "SELECT count(*) FROM postie_inbox WHERE status IN ('sending', 'retrying')
                        OR (status = 'scheduled' AND due_at < now())",
                    &[],
                )
                .await
                .ok()?;
            Some(row.get(0))
        }
        .await;
        quiet = if depth == Some(0) && busy == Some(0) {
            quiet + 1
        } else {
            0
        };
    }

    // Account for every confirmed key.
    let published = std::mem::take(&mut *published.lock().unwrap());
    let mut received: BTreeMap<String, usize> = BTreeMap::new();
    let mut first_arrival: BTreeMap<String, i64> = BTreeMap::new();
    let messages = env.sink.messages(false).await;
    for m in &messages {
        *received.entry(m.message_id.clone()).or_default() += 1;
        first_arrival
            .entry(m.message_id.clone())
            .or_insert(m.received_at_ms);
    }
    let dead = env.take_dead_letters().await;
    let mut dead_keys: BTreeSet<String> = BTreeSet::new();
    let mut dead_by_reason: BTreeMap<String, usize> = BTreeMap::new();
    for letter in &dead {
        let kind = letter
            .headers
            .get("postie-dead-kind")
            .cloned()
            .unwrap_or_else(|| "broker".into());
        *dead_by_reason.entry(kind).or_default() += 1;
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&letter.body) {
            if let Some(k) = v["key"].as_str() {
                dead_keys.insert(k.to_string());
            }
        }
    }
    let client = env.db().await;
    let rows = client
        .query(
            "SELECT key, status, attempts, takeovers FROM postie_inbox",
            &[],
        )
        .await
        .unwrap();
    let inbox: BTreeMap<String, (String, i32, i32)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), (r.get(1), r.get(2), r.get(3))))
        .collect();

    let confirmed_keys: BTreeMap<String, &Planned> = published
        .confirmed
        .iter()
        .map(|i| (jobs[*i].key.clone(), &jobs[*i]))
        .collect();
    let (mut lost, mut unexplained, mut doomed_not_dead) = (Vec::new(), Vec::new(), Vec::new());
    let (mut duplicated_keys, mut duplicate_emails, mut known_window, mut pending) = (0, 0, 0, 0);
    for (key, planned) in &confirmed_keys {
        let id = IdempotencyKey::parse(key)
            .unwrap()
            .message_id("postie.local");
        let got = received.get(&id).copied().unwrap_or(0);
        let row = inbox.get(key);
        let is_dead = dead_keys.contains(key);
        // A doomed recipient answers 550 5.1.1: a hard bounce, so after its first job
        // the address is suppressed and its later jobs end `suppressed` (issue 30), a
        // deliberate ending. Any other job ending so would be lost.
        let suppressed = planned.doomed && row.is_some_and(|r| r.0 == "suppressed");
        if got == 0 && !is_dead && !suppressed {
            match row.map(|r| r.0.as_str()) {
                Some("sending") | Some("retrying") | None => pending += 1,
                Some(status) => {
                    let (_, attempts, takeovers) = row.cloned().unwrap_or_default();
                    lost.push(format!(
                        "{key} (inbox: {status}, {attempts} attempts, {takeovers} takeovers)"
                    ));
                }
            }
        }
        if planned.doomed && !is_dead && !suppressed {
            doomed_not_dead.push(key.clone());
        }
        if got > 1 {
            duplicated_keys += 1;
            duplicate_emails += got - 1;
            // Each extra email needs an SMTP attempt postie did not see succeed:
            // a recorded failed attempt, or a claim taken over after a crash.
            let (attempts, takeovers) = row.map(|r| (r.1, r.2)).unwrap_or((0, 0));
            if (got as i32) <= attempts + takeovers {
                known_window += got - 1;
            } else {
                unexplained.push(format!(
                    "{key}: {got} emails, {attempts} attempts, {takeovers} takeovers"
                ));
            }
        }
    }
    let mut early = 0;
    for (i, due) in &published.due {
        let id = IdempotencyKey::parse(&jobs[*i].key)
            .unwrap()
            .message_id("postie.local");
        // A repeated key's first email may come from an earlier, less delayed publish.
        let first_publish_of_key = published
            .confirmed
            .iter()
            .find(|j| jobs[**j].key == jobs[*i].key)
            == Some(i);
        if let (Some(at), true) = (first_arrival.get(&id), first_publish_of_key) {
            if at < due {
                early += 1;
            }
        }
    }
    let reconciled: i64 = env
        .db()
        .await
        .query_one(
            "SELECT count(*) FROM postie_inbox WHERE reconciled_at IS NOT NULL",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1);
    Report {
        seed,
        attempted: published.attempted,
        confirmed: published.confirmed.len(),
        unique_confirmed_keys: confirmed_keys.len(),
        emails_received: messages.len(),
        keys_received: received.len(),
        lost,
        duplicated_keys,
        duplicate_emails,
        duplicates_in_known_window: known_window,
        unexplained_duplicates: unexplained,
        dead_by_reason,
        doomed_not_dead,
        early,
        pending,
        reconciled,
        faults: injected,
        elapsed_s: started.elapsed().as_secs_f64(),
    }
}

fn print(r: &Report) {
    println!("## chaos run, seed {}", r.seed);
    println!("| measure | value |\n|---|---|");
    println!(
        "| jobs attempted / confirmed | {} / {} |",
        r.attempted, r.confirmed
    );
    println!("| unique confirmed keys | {} |", r.unique_confirmed_keys);
    println!(
        "| emails received by the sink (keys) | {} ({}) |",
        r.emails_received, r.keys_received
    );
    println!("| lost | {} |", r.lost.len());
    println!(
        "| duplicated keys / extra emails | {} / {} |",
        r.duplicated_keys, r.duplicate_emails
    );
    println!(
        "| extra emails in the known window | {} |",
        r.duplicates_in_known_window
    );
    println!(
        "| unexplained duplicates | {} |",
        r.unexplained_duplicates.len()
    );
    println!("| dead-lettered by reason | {:?} |", r.dead_by_reason);
    println!(
        "| doomed jobs neither dead-lettered nor suppressed | {} |",
        r.doomed_not_dead.len()
    );
    println!("| sent early | {} |", r.early);
    println!("| still pending after drain | {} |", r.pending);
    println!(
        "| re-published by the reconciler (stranded in the ladder) | {} |",
        r.reconciled
    );
    println!("| faults injected | {:?} |", r.faults);
    println!("| elapsed | {:.0} s |", r.elapsed_s);
    if !r.lost.is_empty() {
        println!("lost keys: {:?}", &r.lost[..r.lost.len().min(20)]);
    }
    if !r.unexplained_duplicates.is_empty() {
        println!(
            "unexplained: {:?}",
            &r.unexplained_duplicates[..r.unexplained_duplicates.len().min(20)]
        );
    }
}

fn assert_invariants(r: &Report) {
    assert!(r.confirmed > 0);
    assert!(r.lost.is_empty(), "I1: lost {:?}", r.lost);
    assert!(
        r.unexplained_duplicates.is_empty(),
        "I2: {:?}",
        r.unexplained_duplicates
    );
    assert_eq!(r.early, 0, "I3: sent early");
    assert!(
        r.doomed_not_dead.is_empty(),
        "doomed jobs must end in the DLQ, or suppressed after the first hard bounce: {:?}",
        r.doomed_not_dead
    );
    assert_eq!(r.pending, 0, "still pending after the drain");
}

fn seed() -> u64 {
    std::env::var("POSTIE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_smoke() {
    let report = run(300, 1, seed()).await;
    print(&report);
    assert_invariants(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: make chaos"]
async fn chaos_full() {
    let n = std::env::var("POSTIE_CHAOS_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let faults = std::env::var("POSTIE_CHAOS_FAULTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let report = run(n, faults, seed()).await;
    print(&report);
    std::fs::create_dir_all("target/chaos").unwrap();
    let json = json!({
        "seed": report.seed, "attempted": report.attempted, "confirmed": report.confirmed,
        "unique_confirmed_keys": report.unique_confirmed_keys,
        "emails_received": report.emails_received, "keys_received": report.keys_received,
        "lost": report.lost, "duplicated_keys": report.duplicated_keys, "duplicate_emails": report.duplicate_emails,
        "duplicates_in_known_window": report.duplicates_in_known_window,
        "unexplained_duplicates": report.unexplained_duplicates, "dead_by_reason": report.dead_by_reason,
        "doomed_not_dead": report.doomed_not_dead, "early": report.early, "pending": report.pending, "reconciled": report.reconciled,
        "faults": report.faults, "elapsed_s": report.elapsed_s,
    });
    std::fs::write(
        "target/chaos/report.json",
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    assert_invariants(&report);
}
