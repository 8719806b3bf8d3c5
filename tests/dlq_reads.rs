//! Reading dead letters is never destructive (issue 45, item 1; invariant I13), on
//! whichever broker the suite runs against: `postie dlq list`, the console's `/dead`
//! and `/job?key=…` pages and a filtered `postie dlq replay`, 25 times each, leave
//! every dead letter in `<p>.dead`. RabbitMQ 4.x gives a quorum queue a default
//! delivery limit of 20 and counts a consume-then-close look against it; a
//! `<p>.dead` declared before postie gave it a limit of its own (an existing
//! deployment) is found and named by start-up and `postie status`.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use postie::testing::console::{self, Credentials};
use postie::testing::dlq::{self, ReplayFilter, ReplayReport};
use reqwest::StatusCode;
use serde_json::json;
use support::{eventually, job, TestEnv};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);
const LETTERS: usize = 6;
const LOOKS: usize = 25;
const OPERATOR: &str = "operator-token-for-dlq-reads";

/// Dead-letters [`LETTERS`] jobs (a bad address: invalid, dead-lettered at once)
/// through a real `postie serve`; their keys.
async fn dead_letter_jobs(env: &TestEnv) -> BTreeSet<String> {
    let serving = env.serve(env.settings());
    let mut keys = BTreeSet::new();
    for i in 0..LETTERS {
        let key = format!("look-{i}");
        let mut body = job(&key, "a@example.com");
        body["to"] = json!(["not an address"]);
        env.publish(&body).await;
        keys.insert(key);
    }
    let dead = env.topology.dead_queue().to_owned();
    eventually("every job dead-lettered", WAIT, || async {
        (env.depth(&dead).await as usize == LETTERS).then_some(())
    })
    .await;
    serving.stop().await;
    keys
}

/// Looks at the dead letters [`LOOKS`] times each way an operator can, and answers
/// how many are left in `<p>.dead` and which keys a last list shows.
async fn look_many_times(env: &TestEnv, keys: &BTreeSet<String>) -> (u32, BTreeSet<String>) {
    let settings = env.settings();
    let stop = CancellationToken::new();
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let credentials = Credentials::new(Some(OPERATOR.into()), None);
    let bound = console::start(env.settings(), listen, credentials, stop.clone())
        .await
        .expect("the console starts");
    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let page = |path: String| {
        let request = http
            .get(format!("http://{bound}{path}"))
            .bearer_auth(OPERATOR);
        async move {
            let response = request.send().await.expect("the console answers");
            assert_eq!(response.status(), StatusCode::OK, "GET {path}");
            response.text().await.unwrap()
        }
    };
    let keys: Vec<&String> = keys.iter().collect();
    for round in 0..LOOKS {
        let listed = dlq::list(&settings, 50).await.expect("dlq list");
        let dead = page("/dead".into()).await;
        let key = keys[round % keys.len()];
        let one = page(format!("/job?key={key}")).await;
        // A filtered replay that moves nothing looks at every letter.
        let replayed = dlq::replay(
            &settings,
            &ReplayFilter {
                key: Some("no-such-key".into()),
                ..Default::default()
            },
        )
        .await
        .expect("dlq replay");
        assert_eq!(replayed.moved, 0);
        let depth = env.depth(env.topology.dead_queue()).await;
        eprintln!(
            "round {}: list {} letters, /dead {} bytes, /job?key={key} {} bytes, replay {replayed:?}, {depth} left",
            round + 1,
            listed.len(),
            dead.len(),
            one.len()
        );
    }
    stop.cancel();
    // A quorum queue counts a letter handed back as ready a moment later: the count
    // is read until it is all of them, for at most 5 s.
    let mut depth = 0;
    for _ in 0..50 {
        depth = env.depth(env.topology.dead_queue()).await;
        if depth as usize == LETTERS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let listed = dlq::list(&settings, 50).await.expect("dlq list");
    (depth, listed.into_iter().map(|l| l.key).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_five_looks_of_every_kind_leave_every_dead_letter_in_place() {
    let env = TestEnv::new("dlqreads").await;
    let keys = dead_letter_jobs(&env).await;
    let (left, listed) = look_many_times(&env, &keys).await;
    assert_eq!(
        left as usize, LETTERS,
        "{LOOKS} looks of each kind left {left} of {LETTERS} dead letters"
    );
    assert_eq!(listed, keys);
    // A filtered replay still moves what matches, and only that.
    let report = dlq::replay(
        &env.settings(),
        &ReplayFilter {
            key: Some("look-0".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        report,
        ReplayReport {
            moved: 1,
            kept: LETTERS - 1
        }
    );
    // The letters the replay gave back are requeued by the nack that ended its
    // consumer; a depth read a moment earlier counts them as unacked, not ready.
    // Waited for, never lost: a letter gone leaves the depth short until the deadline.
    let depths = || async {
        let sent = env.depth(env.topology.send_queue()).await;
        let dead = env.depth(env.topology.dead_queue()).await as usize;
        (sent == 1 && dead == LETTERS - 1).then_some(())
    };
    support::eventually(
        "1 replayed and the rest back in the dead queue",
        Duration::from_secs(15),
        depths,
    )
    .await;
}

/// `<p>.dead` as postie declared it before it had a delivery limit of its own: a
/// quorum queue with no other argument, bound to `<p>.dlx`.
async fn declare_old_dead_queue(env: &TestEnv) {
    let dead = env.topology.dead_queue().to_owned();
    env.delete_queue(&dead).await;
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            dead.as_str().into(),
            env.topology.dead_exchange().into(),
            "email".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_dead_queue_without_the_limit_is_named_and_still_read_without_harm() {
    let env = TestEnv::new("dlqold").await;
    declare_old_dead_queue(&env).await;

    // Start-up's declaration (`postie topology` runs the same one as `serve`) keeps
    // the existing queue and says what it lacks, instead of failing with 406.
    let run = support::run_postie(&["topology"], &env.env_vars());
    assert_eq!(run.code, Some(0), "postie topology: {}", run.stderr);
    let said = format!("{}{}", run.stdout, run.stderr);
    assert!(
        said.contains(env.topology.dead_queue()) && said.contains("no delivery limit"),
        "start-up names the unprotected dead-letter queue:\n{said}"
    );

    // `postie status` warns, and says how to protect it.
    let migrated = support::run_postie(&["migrate"], &env.env_vars());
    assert_eq!(migrated.code, Some(0), "{}", migrated.stderr);
    let status = env.postie(&["status"]).expect("postie status");
    let warning = status
        .lines()
        .find(|l| l.contains("WARNING") && l.contains(env.topology.dead_queue()))
        .unwrap_or_else(|| panic!("no warning about {}:\n{status}", env.topology.dead_queue()));
    assert!(warning.contains("delivery limit"), "{warning}");
    assert!(status.contains("delivery-limit"), "the fix: {status}");

    // Reading does not count toward the broker's default limit either.
    let keys = dead_letter_jobs(&env).await;
    let (left, listed) = look_many_times(&env, &keys).await;
    assert_eq!(
        left as usize, LETTERS,
        "{LOOKS} looks of each kind left {left} of {LETTERS} dead letters"
    );
    assert_eq!(listed, keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_dead_queue_is_reported_protected() {
    let env = TestEnv::new("dlqnew").await;
    let migrated = support::run_postie(&["migrate"], &env.env_vars());
    assert_eq!(migrated.code, Some(0), "{}", migrated.stderr);
    let status = env.postie(&["status"]).expect("postie status");
    let line = status
        .lines()
        .find(|l| l.contains(env.topology.dead_queue()) && l.contains("delivery limit"))
        .unwrap_or_else(|| panic!("no line about the dead queue's limit:\n{status}"));
    assert!(!line.contains("WARNING"), "{line}");
}

/// A policy on the broker, deleted when dropped.
struct Policy {
    url: String,
}

impl Policy {
    /// Sets policy `name` giving `queue` alone a `delivery-limit` of `limit`, through
    /// the management API.
    async fn delivery_limit(name: &str, queue: &str, limit: i64) -> Self {
        let url = format!("{}/api/policies/%2f/{name}", support::management_url());
        let body = json!({
            "pattern": format!("^{}$", queue.replace('.', "\\.")),
            "definition": {"delivery-limit": limit},
            "apply-to": "queues",
            "priority": 10,
        });
        let response = reqwest::Client::new()
            .put(&url)
            .basic_auth("guest", Some("guest"))
            .json(&body)
            .send()
            .await
            .expect("RabbitMQ management API (rabbitmq_management enabled?)");
        assert!(response.status().is_success(), "{}", response.status());
        Self { url }
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        let url = self.url.clone();
        support::on_own_thread(async move {
            let _ = reqwest::Client::new()
                .delete(url)
                .basic_auth("guest", Some("guest"))
                .send()
                .await;
        });
    }
}

/// `postie status` with `amqp.management_url` = `management` (and the test's
/// settings): its exit code and what it printed.
fn status_with(env: &TestEnv, management: &str) -> support::PostieRun {
    let mut vars = env.env_vars();
    vars.push(("POSTIE__AMQP__MANAGEMENT_URL".into(), management.into()));
    support::run_postie(&["status"], &vars)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_gives_an_existing_dead_queue_a_limit_is_read_over_the_management_api() {
    let env = TestEnv::new("dlqpolicy").await;
    declare_old_dead_queue(&env).await;
    let migrated = support::run_postie(&["migrate"], &env.env_vars());
    assert_eq!(migrated.code, Some(0), "{}", migrated.stderr);
    let management = support::management_url().replace("://", "://guest:guest@");
    let dead = env.topology.dead_queue().to_owned();

    // A policy with the broker's default-sized limit is no protection.
    let name = format!("{}-dead", env.prefix);
    let low = Policy::delivery_limit(&name, &dead, 20).await;
    let run = status_with(&env, &management);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout
            .contains(&format!("WARNING: {dead} has no delivery limit")),
        "{}",
        run.stdout
    );
    drop(low);

    // The fix the warning names: a policy with postie's limit.
    let _high = Policy::delivery_limit(&name, &dead, 2_147_483_647).await;
    let status = eventually("status to read the policy", WAIT, || async {
        let run = status_with(&env, &management);
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        run.stdout
            .contains(&format!("(policy {name})"))
            .then_some(run.stdout)
    })
    .await;
    let line = status
        .lines()
        .find(|l| l.contains(&dead) && l.contains("delivery limit"))
        .unwrap();
    assert!(
        line.contains("2147483647") && !line.contains("WARNING"),
        "{line}"
    );

    // https:// is spoken as https: the management listener here is plain HTTP, so
    // the TLS handshake fails, and nothing is sent in clear.
    let https = management.replace("http://", "https://");
    let run = status_with(&env, &https);
    assert_ne!(run.code, Some(0), "{}", run.stdout);
    assert!(
        run.stderr.contains("management API") && !run.stderr.contains("guest:guest"),
        "{}",
        run.stderr
    );
}
