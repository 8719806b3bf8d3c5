//! The reconciler re-publishes only what the broker lost (issue 26, item 5), in
//! ladder mode against the real broker, PostgreSQL and the SMTP test server:
//!
//! - jobs due now behind a 20/s send rate: jobs waiting their turn in `<p>.send` or
//!   in a worker are not re-published (under 1 %), each is sent once, and the run
//!   takes about the rate's floor;
//! - the same backlog while jobs are purged from the ladder, as a lost broker node
//!   strands them: every lost job is re-published and sent once;
//! - a job that ended without a claim (dead-lettered as invalid) finishes its
//!   scheduled row, so no pass re-publishes it.
//!
//! Sizes. The `slow_` twins (the slow tier) run issue 26's figures: 1,000 jobs, grace
//! 5 s, the default `amqp.prefetch` (128), a floor of 50 s; 50 jobs lost from the
//! ladder, due in 8 s. The fast twins keep the proportions that make the proof: most
//! of the backlog waits in `<p>.send`, unmarked, for several graces (a reconciler
//! that judged by the grace alone would re-publish most of it), and the lost jobs
//! fall due while the send queue still has ready messages. The backlog is 150 jobs
//! (floor 7.5 s) with grace 1 s (the least the settings allow) and `amqp.prefetch`
//! 20 (the workers hold about a tenth of the backlog, as 128 of 1,000); the lost jobs
//! are 20 behind a backlog of 200 (the queue has ready messages for about 8 s), due
//! in 7 s, so they park in the ladder's 6.4 s level as the slow twin's do and the
//! purge has as long to find them. The rate's ceiling (within 15 % of the floor) is a
//! timing goal, asserted in the slow twin only; both assert the floor itself (the
//! backlog really waited).

mod support;

use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::config::SendRate;
use postie::testing::broker;
use support::{amqp_url, eventually, job, TestEnv};

/// The send rate of the backlog tests, in emails per second.
const RATE: &str = "20/s";
const PER_SECOND: usize = 20;

/// The size of one backlog scenario.
#[derive(Clone, Copy)]
struct Backlog {
    /// Jobs due now.
    jobs: usize,
    /// `delay.reconcile_grace`.
    grace: Duration,
    /// `amqp.prefetch` (None: the default, 128).
    prefetch: Option<u16>,
}

impl Backlog {
    /// The rate's floor for the backlog alone, as issue 26 counts it: jobs ÷ rate (one
    /// second's worth goes at once, the default burst, so the last job can go a second
    /// earlier).
    fn floor(self) -> Duration {
        Duration::from_secs_f64(self.jobs as f64 / PER_SECOND as f64)
    }
}

/// Issue 26's backlog (slow tier): 1,000 jobs, grace 5 s, floor 50 s.
const FULL: Backlog = Backlog {
    jobs: 1_000,
    grace: Duration::from_secs(5),
    prefetch: None,
};

fn delayed(delay_ms: i64) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
    broker::job_properties().with_headers(headers)
}

/// Settings for a rate-limited instance with the backlog's grace and prefetch.
fn settings(env: &TestEnv, backlog: Backlog) -> postie::config::Settings {
    let mut settings = env.settings();
    settings.transport.rate_limit = Some(SendRate::parse(RATE).unwrap());
    settings.delay.reconcile_grace = backlog.grace;
    if let Some(prefetch) = backlog.prefetch {
        settings.amqp.prefetch = prefetch;
    }
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

fn backlog_jobs(prefix: &str, n: usize) -> Vec<(serde_json::Value, lapin::BasicProperties)> {
    (0..n)
        .map(|i| (job(&format!("{prefix}-{i}"), "due@example.com"), delayed(0)))
        .collect()
}

/// `backlog.jobs` jobs due now behind the rate: under 1 % re-published, each sent
/// once; `ceiling`: also within 15 % of the floor (a timing goal, slow tier only).
async fn a_rate_limited_backlog_is_not_re_published(backlog: Backlog, ceiling: bool) {
    let n = backlog.jobs;
    let env = TestEnv::new("gf_backlog").await;
    let serving = env.serve(settings(&env, backlog));
    let started = Instant::now();
    env.publish_many_with(&backlog_jobs("gf-now", n)).await;
    env.wait_for_emails("every job due now", n, Duration::from_secs(300))
        .await;
    let took = started.elapsed();
    // A moment for any late copy to show up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;
    let copies = republished(&env).await;
    let floor = backlog.floor();
    eprintln!(
        "FIGURES gf backlog: {n} jobs due now at {RATE}, grace {}ms, prefetch {}: {copies} \
         re-published, all sent in {:.1}s (floor {:.1}s)",
        backlog.grace.as_millis(),
        backlog.prefetch.unwrap_or(128),
        took.as_secs_f64(),
        floor.as_secs_f64()
    );
    assert_eq!(env.sink.count().await, n);
    each_sent_once(&env, (0..n).map(|i| format!("gf-now-{i}"))).await;
    assert!(
        copies * 100 < n as i64,
        "{copies} of {n} re-published although the broker lost nothing"
    );
    // The premise: the rate held the backlog back (one second's worth at once, then
    // the pace), so most of it waited several graces.
    let least = floor.saturating_sub(Duration::from_secs(1)).mul_f64(0.9);
    assert!(
        took >= least,
        "took {:.1}s: the rate did not hold the backlog back (at least {:.1}s)",
        took.as_secs_f64(),
        least.as_secs_f64()
    );
    if ceiling {
        assert!(
            took.as_secs_f64() <= floor.as_secs_f64() * 1.15,
            "took {:.1}s, more than 15% over the rate's floor",
            took.as_secs_f64()
        );
    }
}

/// 150 jobs (floor 7.5 s), grace 1 s, prefetch 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_a_rate_limited_backlog_is_not_re_published() {
    let backlog = Backlog {
        jobs: 150,
        grace: Duration::from_secs(1),
        prefetch: Some(20),
    };
    a_rate_limited_backlog_is_not_re_published(backlog, false).await;
}

/// Issue 26's figures: 1,000 jobs (floor 50 s), grace 5 s, run within 15 % of the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_gf_a_rate_limited_backlog_is_not_re_published() {
    a_rate_limited_backlog_is_not_re_published(FULL, true).await;
}

/// `lost` jobs due in `lost_delay_ms`, published after `backlog` and purged from the
/// ladder: each re-published and sent once, the backlog still under 1 % re-published.
async fn jobs_lost_from_the_ladder_behind_a_backlog_are_re_published(
    backlog: Backlog,
    lost: usize,
    lost_delay_ms: i64,
) {
    let n = backlog.jobs;
    let env = TestEnv::new("gf_lostladder").await;
    let serving = env.serve(settings(&env, backlog));
    let lost_jobs: Vec<_> = (0..lost)
        .map(|i| {
            (
                job(&format!("gf-lost-{i}"), "lost@example.com"),
                delayed(lost_delay_ms),
            )
        })
        .collect();
    env.publish_many_with(&backlog_jobs("gf-due", n)).await;
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
            (parked == lost).then_some(())
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
    assert_eq!(purged as usize, lost, "every delayed job was in the ladder");

    env.wait_for_emails(
        "the backlog and every lost job",
        n + lost,
        Duration::from_secs(300),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    serving.stop().await;
    let copies = republished(&env).await;
    eprintln!(
        "FIGURES gf lost behind a backlog: {n} due now at {RATE}, grace {}ms, {lost} due in \
         {lost_delay_ms}ms lost from the ladder: {copies} re-published in all",
        backlog.grace.as_millis()
    );
    assert_eq!(env.sink.count().await, n + lost);
    each_sent_once(&env, (0..lost).map(|i| format!("gf-lost-{i}"))).await;
    each_sent_once(&env, (0..n).map(|i| format!("gf-due-{i}"))).await;
    assert_eq!(
        env.inbox_count("key LIKE 'gf-lost-%' AND reconciled >= 1")
            .await,
        lost as i64,
        "every lost job re-published"
    );
    assert!(
        (copies - lost as i64) * 100 < n as i64,
        "{} of the {n} waiting jobs re-published",
        copies - lost as i64
    );
}

/// 20 jobs due in 7 s lost behind 200 due now (grace 1 s, prefetch 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_jobs_lost_from_the_ladder_behind_a_backlog_are_re_published() {
    let backlog = Backlog {
        jobs: 200,
        grace: Duration::from_secs(1),
        prefetch: Some(20),
    };
    jobs_lost_from_the_ladder_behind_a_backlog_are_re_published(backlog, 20, 7_000).await;
}

/// Issue 26's figures: 50 jobs due in 8 s lost behind 1,000 due now (grace 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_gf_jobs_lost_from_the_ladder_behind_a_backlog_are_re_published() {
    jobs_lost_from_the_ladder_behind_a_backlog_are_re_published(FULL, 50, 8_000).await;
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
