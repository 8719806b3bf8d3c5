//! The reconciler re-publishes only what the broker lost (issue 26, item 5), in
//! ladder mode against the real broker, PostgreSQL and the SMTP test server:
//!
//! - 1,000 jobs due now behind a 20/s send rate, grace 5 s: jobs waiting their turn
//!   in `<p>.send` or in a worker are not re-published (under 1 %), each is sent
//!   once, and the run takes about the rate's floor (50 s);
//! - the same backlog while jobs are purged from the ladder, as a lost broker node
//!   strands them: every lost job is re-published and sent once;
//! - a job that ended without a claim (dead-lettered as invalid) finishes its
//!   scheduled row, so no pass re-publishes it.

mod support;

use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::broker;
use postie::config::SendRate;
use support::{amqp_url, eventually, job, TestEnv};

/// The send rate of the backlog tests, and its floor for 1,000 jobs.
const RATE: &str = "20/s";
const BACKLOG: usize = 1_000;
const FLOOR: Duration = Duration::from_secs(50);

fn delayed(delay_ms: i64) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
    broker::job_properties().with_headers(headers)
}

/// Settings for a rate-limited instance with a 5 s grace.
fn settings(env: &TestEnv) -> postie::config::Settings {
    let mut settings = env.settings();
    settings.smtp.rate_limit = Some(SendRate::parse(RATE).unwrap());
    settings.delay.reconcile_grace = Duration::from_secs(5);
    settings
}

/// Re-publishes recorded in the inbox, in all.
async fn republished(env: &TestEnv) -> i64 {
    env.db()
        .await
        .query_one(
            "SELECT coalesce(sum(reconciled), 0)::bigint FROM postie_inbox",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Asserts each of `keys` was sent exactly once.
async fn each_sent_once(env: &TestEnv, keys: impl Iterator<Item = String>) {
    let per_id = env.emails_per_id().await;
    for key in keys {
        let sent = per_id.get(&support::message_id(&key)).copied().unwrap_or(0);
        assert_eq!(sent, 1, "{key} was sent {sent} times");
    }
}

fn backlog_jobs(prefix: &str) -> Vec<(serde_json::Value, lapin::BasicProperties)> {
    (0..BACKLOG)
        .map(|i| (job(&format!("{prefix}-{i}"), "due@example.com"), delayed(0)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_a_rate_limited_backlog_is_not_re_published() {
    let env = TestEnv::new("gf_backlog").await;
    let serving = env.serve(settings(&env));
    let started = Instant::now();
    env.publish_many_with(&backlog_jobs("gf-now")).await;
    env.wait_for_emails("every job due now", BACKLOG, Duration::from_secs(300))
        .await;
    let took = started.elapsed();
    // A moment for any late copy to show up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;
    let copies = republished(&env).await;
    eprintln!(
        "FIGURES gf backlog: {BACKLOG} jobs due now at {RATE}, grace 5s: {copies} re-published, \
         all sent in {:.1}s (floor {}s)",
        took.as_secs_f64(),
        FLOOR.as_secs()
    );
    assert_eq!(env.sink.count().await, BACKLOG);
    each_sent_once(&env, (0..BACKLOG).map(|i| format!("gf-now-{i}"))).await;
    assert!(
        copies * 100 < BACKLOG as i64,
        "{copies} of {BACKLOG} re-published although the broker lost nothing"
    );
    assert!(
        took.as_secs_f64() <= FLOOR.as_secs_f64() * 1.15,
        "took {:.1}s, more than 15% over the rate's floor",
        took.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_jobs_lost_from_the_ladder_behind_a_backlog_are_re_published() {
    const LOST: usize = 50;
    let env = TestEnv::new("gf_lostladder").await;
    let serving = env.serve(settings(&env));
    let lost_jobs: Vec<_> = (0..LOST)
        .map(|i| {
            (
                job(&format!("gf-lost-{i}"), "lost@example.com"),
                delayed(8_000),
            )
        })
        .collect();
    env.publish_many_with(&backlog_jobs("gf-due")).await;
    env.publish_many_with(&lost_jobs).await;

    // Every delayed job parked in the ladder, then the ladder loses them all.
    let broker::DelayLayout::Ladder(ladder) = env.topology.delay() else {
        panic!("the tests run in ladder mode");
    };
    let levels: Vec<String> = (0..ladder.levels())
        .map(|k| env.topology.delay_level(k))
        .collect();
    let (envr, levels) = (&env, &levels);
    eventually(
        "every delayed job in the ladder",
        Duration::from_secs(30),
        move || async move {
            let mut parked = 0;
            for level in levels {
                parked += envr.depth(level).await as usize;
            }
            (parked == LOST).then_some(())
        },
    )
    .await;
    let conn = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut purged = 0;
    for level in levels {
        purged += channel
            .queue_purge(level.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "done".into()).await;
    assert_eq!(purged as usize, LOST, "every delayed job was in the ladder");

    env.wait_for_emails(
        "the backlog and every lost job",
        BACKLOG + LOST,
        Duration::from_secs(300),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;
    let copies = republished(&env).await;
    eprintln!("FIGURES gf lost behind a backlog: {LOST} lost, {copies} re-published in all");
    assert_eq!(env.sink.count().await, BACKLOG + LOST);
    each_sent_once(&env, (0..LOST).map(|i| format!("gf-lost-{i}"))).await;
    each_sent_once(&env, (0..BACKLOG).map(|i| format!("gf-due-{i}"))).await;
    assert_eq!(
        env.inbox_count("key LIKE 'gf-lost-%' AND reconciled >= 1")
            .await,
        LOST as i64,
        "every lost job re-published"
    );
    assert!(
        (copies - LOST as i64) * 100 < BACKLOG as i64,
        "{} of the {BACKLOG} waiting jobs re-published",
        copies - LOST as i64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_a_job_dead_lettered_unclaimed_finishes_its_scheduled_row() {
    let env = TestEnv::new("gf_unclaimed").await;
    let mut settings = env.settings();
    settings.delay.reconcile_grace = Duration::from_secs(1);
    let serving = env.serve(settings);
    // A key the relay can read and record, in a job the worker refuses.
    let bad = job("gf-bad-recipient", "not an address");
    env.publish_many_with(&[(bad, delayed(500))]).await;
    let dead = &env.topology.dead_queue();
    let envr = &env;
    eventually(
        "the job dead-lettered",
        Duration::from_secs(30),
        move || async move { (envr.depth(dead).await == 1).then_some(()) },
    )
    .await;
    // Several reconciler passes (every second) past the grace.
    tokio::time::sleep(Duration::from_secs(6)).await;
    serving.stop().await;
    assert_eq!(
        env.inbox_count("key = 'gf-bad-recipient' AND status = 'dead' AND body IS NULL")
            .await,
        1,
        "the scheduled row finished as dead, its body dropped"
    );
    assert_eq!(republished(&env).await, 0, "never re-published");
    assert_eq!(env.take_dead_letters().await.len(), 1, "dead-lettered once");
}
