//! What differs between broker generations, checked on the broker the suite runs
//! against (the machine's RabbitMQ 3.10 under `make test`, 4.3 under
//! `make test-rabbitmq-4`): the delay-mode probe reads either's refusal of the
//! unknown `x-delayed-message` type (503 on 3.x, 406 on 4.3) and starts without an
//! ERROR line, and a job returned to `<p>.send` past its delivery limit reaches the
//! dead-letter queue with a reason, whichever way the broker counts returns.

mod support;

use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicNackOptions, BasicRejectOptions};
use support::{eventually, job, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

/// Starts `postie serve` with `delay.mode = auto` under `prefix` and returns its log
/// once it consumes `<prefix>.send`, after a SIGTERM.
async fn start_auto(env: &TestEnv, prefix: &str) -> String {
    let mut postie = env.spawn_process(&[
        ("POSTIE__DELAY__MODE", "auto"),
        ("POSTIE__TOPOLOGY__PREFIX", prefix),
    ]);
    let send = format!("{prefix}.send");
    eventually("postie consumes the send queue", WAIT, || async {
        (env.queue_exists(&send).await && env.consumers(&send).await > 0).then_some(())
    })
    .await;
    let exited = postie.terminate(WAIT);
    assert!(exited.is_some_and(|s| s.success()), "{}", postie.log());
    postie.log()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_reads_the_brokers_refusal_and_starts_without_an_error_line() {
    let env = TestEnv::new("b.probe").await;
    // A fresh prefix: the probe finds no entry exchange (404) and asks the broker for
    // the plugin's exchange type (refused: 503 on 3.x, 406 on 4.3).
    let fresh = format!("{}.fresh", env.prefix);
    let log = start_auto(&env, &fresh).await;
    let mut vars = env.env_vars();
    vars.push(("POSTIE__TOPOLOGY__PREFIX".into(), fresh.clone()));
    let deleted = support::run_postie(&["topology", "--delete"], &vars);
    assert_eq!(deleted.code, Some(0), "{}", deleted.stderr);
    assert!(
        log.contains("delay mode ladder: auto: the broker has no delayed-message plugin")
            && log.contains("unknown exchange type 'x-delayed-message'"),
        "one INFO line names the mode and why:\n{log}"
    );
    assert!(
        !log.contains("ERROR"),
        "a healthy start logs no error:\n{log}"
    );
    assert!(
        !log.contains("already exists"),
        "not taken for a conflict:\n{log}"
    );

    // The env's own prefix: `<p>.delayed` exists as a direct exchange, so ladder.
    let log = start_auto(&env, &env.prefix).await;
    assert!(
        log.contains(&format!(
            "delay mode ladder: auto: {}.delayed exists as a direct exchange",
            env.prefix
        )),
        "{log}"
    );
    assert!(
        !log.contains("ERROR"),
        "a healthy start logs no error:\n{log}"
    );
}

/// How a consumer hands a delivery back.
#[derive(Debug, Clone, Copy)]
enum Return {
    Reject,
    Nack,
    /// Its channel closes with the delivery unacked (a crashed consumer).
    Abandon,
}

/// Takes the one job in `<p>.send` and hands it back `times` times (or until the
/// broker no longer offers it); how many times it was handed back.
async fn return_repeatedly(env: &TestEnv, how: Return, times: usize) -> usize {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let mut channel = conn.create_channel().await.unwrap();
    let queue = env.topology.send_queue();
    let mut returned = 0;
    for _ in 0..times {
        if matches!(how, Return::Abandon) {
            let _ = channel.close(200, "abandoned".into()).await;
            channel = conn.create_channel().await.unwrap();
        }
        let got = channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap();
        let Some(message) = got else { break };
        let acker = &message.delivery.acker;
        match how {
            Return::Reject => {
                acker
                    .reject(BasicRejectOptions { requeue: true })
                    .await
                    .unwrap();
            }
            Return::Nack => {
                acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    })
                    .await
                    .unwrap();
            }
            Return::Abandon => {}
        }
        returned += 1;
    }
    let _ = conn.close(200, "done".into()).await;
    returned
}

/// The queue and reason a job handed back `how` ends in: `Some(reason)` once in the
/// dead-letter queue, `None` while still in `<p>.send`; never lost.
async fn after_returns(env: &TestEnv, how: Return) -> Option<String> {
    let limit = env.settings().topology.delivery_limit as usize;
    let key = format!("{}-{how:?}", env.prefix);
    env.publish_to_queue(
        env.topology.send_queue(),
        job(&key, "limit@example.com").to_string().as_bytes(),
        postie::testing::broker::job_properties(),
    )
    .await;
    let returned = return_repeatedly(env, how, 3 * limit + 10).await;
    let settings = env.settings();
    let letters = eventually("the job is somewhere", WAIT, || async {
        let letters = postie::testing::dlq::list(&settings, 10).await.ok()?;
        let waiting = env.depth(env.topology.send_queue()).await;
        (letters.len() + waiting as usize == 1).then_some(letters)
    })
    .await;
    eprintln!(
        "{how:?} x{returned} (delivery limit {limit}): {}",
        if letters.is_empty() {
            "still in the send queue".to_string()
        } else {
            format!("dead-lettered: {}", letters[0].reason)
        }
    );
    letters.first().map(|l| {
        assert_eq!(l.key, key, "the letter names the job: {l:?}");
        l.reason.clone()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_returned_past_the_delivery_limit_reaches_the_dlq_with_a_reason() {
    let env = TestEnv::new("b.limit").await;
    // Rejected: every broker generation counts it, so it is dead-lettered.
    let reason = after_returns(&env, Return::Reject)
        .await
        .expect("a job rejected past the delivery limit is dead-lettered");
    assert!(
        reason.contains("delivery_limit") && reason.contains(env.topology.send_queue()),
        "{reason}"
    );
    env.take_dead_letters().await;
    // Nacked, or abandoned by a closed channel: 3.x counts both, 4.3 only the
    // abandoned one (docs/brokers.md). Either way the job is never dropped, and a
    // dead letter says why.
    for how in [Return::Nack, Return::Abandon] {
        if let Some(reason) = after_returns(&env, how).await {
            assert!(reason.contains("delivery_limit"), "{how:?}: {reason}");
            env.take_dead_letters().await;
        } else {
            // Still waiting in the send queue: take it out for the next round.
            purge_send(&env).await;
        }
    }
}

/// Empties `<p>.send`.
async fn purge_send(env: &TestEnv) {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_purge(env.topology.send_queue().into(), Default::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// Runs `postie ARGS` against `env` with `extra` settings on top; its stdout, or a
/// panic with its stderr.
fn postie_with(env: &TestEnv, args: &[&str], extra: &[(&str, &str)]) -> String {
    let mut vars = env.env_vars();
    vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let run = support::run_postie(args, &vars);
    assert_eq!(run.code, Some(0), "postie {args:?}: {}", run.stderr);
    run.stdout
}

/// Leaving the plugin: the fleet runs the ladder under a new prefix and keeps
/// consuming the old prefix's `<old>.send` (where the plugin releases its jobs) until
/// `postie status` says the old prefix is drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_under_a_new_prefix_drains_the_old_send_queue() {
    const OLD_JOBS: usize = 20;
    const NEW_JOBS: usize = 5;
    let env = TestEnv::new("b.drain").await;
    // The plugin-era deployment's send queue (its exchange would be the plugin's,
    // which this broker cannot have), holding jobs the plugin has released.
    let old = format!("{}.old", env.prefix);
    let old_queue = format!("{old}.send");
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            old_queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    for i in 0..OLD_JOBS {
        let body = job(&format!("{}-old-{i}", env.prefix), "old@example.com");
        env.publish_to_queue(
            &old_queue,
            body.to_string().as_bytes(),
            postie::testing::broker::job_properties(),
        )
        .await;
    }
    let management = support::management_url().replace("://", "://guest:guest@");
    let drain = [
        ("POSTIE__TOPOLOGY__DRAIN_PREFIXES", old.as_str()),
        ("POSTIE__AMQP__MANAGEMENT_URL", management.as_str()),
    ];
    postie_with(&env, &["migrate"], &[]);
    let before = postie_with(&env, &["status"], &drain);
    assert!(
        before.contains(&format!("draining {old:?}"))
            && before.contains(&format!("{old}.delayed"))
            && before.contains(&format!(
                "not drained: 0 held by the plugin, {OLD_JOBS} ready"
            )),
        "{before}"
    );

    let mut postie = env.spawn_process(&drain);
    let new: Vec<_> = (0..NEW_JOBS)
        .map(|i| job(&format!("{}-new-{i}", env.prefix), "new@example.com"))
        .collect();
    env.publish_many(&new).await;
    env.wait_for_emails("old and new jobs", OLD_JOBS + NEW_JOBS, WAIT)
        .await;
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.len(), OLD_JOBS + NEW_JOBS, "{per_id:?}");
    assert!(
        per_id.values().all(|n| *n == 1),
        "one email each: {per_id:?}"
    );
    let after = postie_with(&env, &["status"], &drain);
    assert!(
        after.contains("drained: safe to disable the delayed-message plugin"),
        "{after}"
    );

    // The operator deletes the drained queue: postie lets it go and goes on.
    channel
        .queue_delete(old_queue.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    env.publish(&job(&format!("{}-after", env.prefix), "after@example.com"))
        .await;
    env.wait_for_emails(
        "a job after the old queue is gone",
        OLD_JOBS + NEW_JOBS + 1,
        WAIT,
    )
    .await;
    let gone = postie_with(&env, &["status"], &drain);
    assert!(
        gone.contains(old_queue.as_str()) && gone.contains("(gone)"),
        "{gone}"
    );
    assert!(
        postie.terminate(WAIT).is_some_and(|s| s.success()),
        "{}",
        postie.log()
    );
}
