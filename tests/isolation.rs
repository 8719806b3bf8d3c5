//! Producer isolation (`worker.key_namespace = "user_id"`): two services, each with
//! a RabbitMQ user of its own, publish the same business key; each gets its email,
//! and one's cancel touches only its own key. RabbitMQ refuses a forged `user_id`,
//! and a job without one is dead-lettered with a reason a person can read.

mod support;

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker::{self, PublishError, ROUTING_KEY};
use secrecy::SecretString;
use support::{amqp_url, eventually, job, TestEnv};

/// A RabbitMQ user made through the management API, with every permission on `/`;
/// deleted on drop.
struct ManagedUser {
    name: String,
    password: String,
}

impl ManagedUser {
    async fn create(name: &str, tags: &str) -> Self {
        let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
        let user = serde_json::json!({"password": password, "tags": tags});
        management(reqwest::Method::PUT, &format!("users/{name}"), Some(user)).await;
        let all = serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"});
        management(
            reqwest::Method::PUT,
            &format!("permissions/%2F/{name}"),
            Some(all),
        )
        .await;
        Self {
            name: name.to_string(),
            password,
        }
    }

    /// `amqp.url` of the test broker with this user's credentials.
    fn url(&self) -> String {
        let mut url = url::Url::parse(&amqp_url()).unwrap();
        url.set_username(&self.name).unwrap();
        url.set_password(Some(&self.password)).unwrap();
        url.to_string()
    }
}

impl Drop for ManagedUser {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs inside the test's runtime: delete from a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let _ = reqwest::Client::new()
                    .delete(format!("{}/api/users/{name}", support::management_url()))
                    .basic_auth("guest", Some("guest"))
                    .send()
                    .await;
            })
        })
        .join();
    }
}

/// Empties `queue` through the management API (a broker that lost its messages).
async fn purge(queue: &str) {
    let path = format!("queues/%2F/{queue}/contents");
    management(reqwest::Method::DELETE, &path, None).await;
}

/// One call to the management API as guest, which must succeed.
async fn management(method: reqwest::Method, path: &str, body: Option<serde_json::Value>) {
    let mut request = reqwest::Client::new()
        .request(method, format!("{}/api/{path}", support::management_url()))
        .basic_auth("guest", Some("guest"));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let answer = request.send().await.expect("management API answers");
    assert!(answer.status().is_success(), "{path}: {}", answer.status());
}

/// A producer service: its own connection, as its own user, mailing its own mailbox.
struct Producer {
    user: String,
    mailbox: String,
    channel: lapin::Channel,
    _connection: lapin::Connection,
}

impl Producer {
    async fn connect(user: &ManagedUser, mailbox: &str) -> Self {
        let connection = broker::connect(
            &postie::config::AmqpAddresses::parse(&SecretString::from(user.url())).unwrap(),
            "postie-test-producer",
            Duration::from_secs(10),
        )
        .await
        .map(|c| c.connection)
        .expect("producer connects");
        let channel = broker::confirm_channel(&connection).await.unwrap();
        Self {
            user: user.name.clone(),
            mailbox: mailbox.to_string(),
            channel,
            _connection: connection,
        }
    }

    /// Publishes a job for `key` to its mailbox, as itself (confirmed).
    async fn send(&self, env: &TestEnv, key: &str, delay_ms: Option<i64>) {
        self.publish(env, &job(key, &self.mailbox), Some(&self.user), delay_ms)
            .await
            .expect("a producer publishes as itself");
    }

    /// Publishes `body` to the contract exchange with `user_id` (and `x-delay`).
    async fn publish(
        &self,
        env: &TestEnv,
        body: &serde_json::Value,
        user_id: Option<&str>,
        delay_ms: Option<i64>,
    ) -> Result<(), PublishError> {
        let mut properties = broker::job_properties();
        if let Some(user_id) = user_id {
            properties = properties.with_user_id(user_id.into());
        }
        if let Some(delay) = delay_ms {
            let mut headers = FieldTable::default();
            headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay));
            properties = properties.with_headers(headers);
        }
        broker::publish_confirmed(
            &self.channel,
            env.topology.delayed_exchange(),
            ROUTING_KEY,
            true,
            body.to_string().as_bytes(),
            properties,
        )
        .await
    }
}

/// The Message-ID postie gives `key` in the namespace of `user`.
fn namespaced_message_id(user: &str, key: &str) -> String {
    let key = postie::testing::contract::IdempotencyKey::parse(key)
        .unwrap()
        .in_namespace(user);
    key.message_id("postie.local")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ge_keys_are_namespaced_by_the_producers_user() {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let env = TestEnv::new("ge-isolation").await;
    let svc_a = ManagedUser::create(&format!("ge-svc-a-{id}"), "").await;
    let svc_b = ManagedUser::create(&format!("ge-svc-b-{id}"), "").await;
    // postie republishes each job (ladder, retries, dead letters) with the producer's
    // user_id: its own user needs the impersonator tag.
    let postie_user = ManagedUser::create(&format!("ge-postie-{id}"), "impersonator").await;
    let postie_url = postie_user.url();
    // Without the tag, serve refuses to start, with the way out.
    let mut untagged = env.env_vars();
    untagged.retain(|(k, _)| k != "POSTIE__AMQP__URL");
    untagged.push(("POSTIE__AMQP__URL".into(), svc_a.url()));
    untagged.push(("POSTIE__WORKER__KEY_NAMESPACE".into(), "user_id".into()));
    let refused = support::run_postie(&["serve"], &untagged);
    assert_ne!(refused.code, Some(0), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("impersonator tag"),
        "{}",
        refused.stderr
    );
    let mut process = env.spawn_process(&[
        ("POSTIE__AMQP__URL", postie_url.as_str()),
        ("POSTIE__WORKER__KEY_NAMESPACE", "user_id"),
        ("POSTIE__DELAY__RECONCILE_GRACE", "2s"),
    ]);
    let a = Producer::connect(&svc_a, "a@example.com").await;
    let b = Producer::connect(&svc_b, "b@example.com").await;

    // The same business key from both services: two emails, one per namespace.
    let key = "ge-order-1:confirmation";
    for producer in [&a, &b] {
        producer.send(&env, key, None).await;
    }
    env.wait_for_emails("one email per namespace", 2, Duration::from_secs(60))
        .await;

    // The same delayed key from both, and a cancel from svc-a: only svc-b's is sent.
    let later = "ge-order-2:reminder";
    for producer in [&a, &b] {
        producer.send(&env, later, Some(3_000)).await;
    }
    a.publish(
        &env,
        &serde_json::json!({"cancel": later}),
        Some(&svc_a.name),
        None,
    )
    .await
    .unwrap();
    env.wait_for_emails("svc-b's reminder", 3, Duration::from_secs(60))
        .await;

    // An operator's cancel names the producer: `postie cancel K --user U`.
    let third = "ge-order-4:invoice";
    for producer in [&a, &b] {
        producer.send(&env, third, Some(3_000)).await;
    }
    let mut cli_env = env.env_vars();
    cli_env.push(("POSTIE__WORKER__KEY_NAMESPACE".into(), "user_id".into()));
    let unnamed = support::run_postie(&["cancel", third], &cli_env);
    assert_ne!(unnamed.code, Some(0), "{}", unnamed.stdout);
    assert!(unnamed.stderr.contains("--user"), "{}", unnamed.stderr);
    let named = support::run_postie(&["cancel", third, "--user", &svc_b.name], &cli_env);
    assert_eq!(named.code, Some(0), "{}", named.stderr);
    assert!(
        named.stdout.contains(&format!("{}:{third}", svc_b.name)),
        "{}",
        named.stdout
    );
    env.wait_for_emails("svc-a's invoice", 4, Duration::from_secs(60))
        .await;

    // A scheduled job the broker lost: the reconciler re-publishes it from the inbox
    // under the user_id it came with, so it is sent in its namespace, not refused.
    let lost = "ge-order-5:lost";
    a.send(&env, lost, Some(6_000)).await;
    let stored = format!("{}:{lost}", svc_a.name);
    env.wait_for_status(&stored, "scheduled", Duration::from_secs(30))
        .await;
    for queue in env.topology.queues() {
        if queue.contains(".delay.") {
            purge(&queue).await;
        }
    }
    env.wait_for_emails("the lost job, re-published", 5, Duration::from_secs(60))
        .await;
    assert!(
        process.log().contains("re-published scheduled jobs"),
        "the reconciler did not run: {}",
        process.log()
    );

    // `postie publish` under the setting publishes as the user it logs in as.
    let mut as_svc_b = cli_env.clone();
    as_svc_b.retain(|(k, _)| k != "POSTIE__AMQP__URL");
    as_svc_b.push(("POSTIE__AMQP__URL".into(), svc_b.url()));
    let by_cli = "ge-order-6:cli";
    let args = format!("publish --key {by_cli} --to b@example.com --from s@example.com");
    let mut args: Vec<&str> = args.split(' ').collect();
    args.extend(["--subject", "by the CLI", "--text", "t"]);
    let published = support::run_postie(&args, &as_svc_b);
    assert_eq!(published.code, Some(0), "{}", published.stderr);
    assert!(
        published
            .stdout
            .contains(&format!("published {}:{by_cli}", svc_b.name)),
        "{}",
        published.stdout
    );
    env.wait_for_emails("the CLI's job", 6, Duration::from_secs(60))
        .await;

    // svc-a cannot speak for svc-b: the broker refuses the forged user_id.
    let forged = a
        .publish(
            &env,
            &serde_json::json!({"cancel": key}),
            Some(&svc_b.name),
            None,
        )
        .await;
    let refusal = forged
        .expect_err("the broker refuses a forged user_id")
        .to_string();
    assert!(
        refusal.contains("PRECONDITION_FAILED") && refusal.contains("user_id"),
        "{refusal}"
    );
    println!("forged user_id refused: {refusal}");

    // A job without user_id (from a fresh channel: the forged publish closed the old).
    let a = Producer::connect(&svc_a, "a@example.com").await;
    a.publish(
        &env,
        &job("ge-order-3:anonymous", "a@example.com"),
        None,
        None,
    )
    .await
    .unwrap();
    let envr = &env;
    let dead = eventually(
        "the job without user_id dead-lettered",
        Duration::from_secs(60),
        move || async move {
            let letters = envr.take_dead_letters().await;
            (!letters.is_empty()).then_some(letters)
        },
    )
    .await;
    assert_eq!(dead.len(), 1);
    let reason = dead[0].reason().to_string();
    assert!(
        reason.contains("user_id") && reason.contains("worker.key_namespace"),
        "{reason}"
    );

    // Give a late email the time to show, then count: two for key 1 (one per
    // namespace, each with its namespace's Message-ID), svc-b's key 2, svc-a's keys 4 and 5, svc-b's key 6.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let messages = env.sink.messages(false).await;
    let mut sent: Vec<(String, String)> = messages
        .iter()
        .map(|m| (m.message_id.clone(), m.rcpt_to.join(",")))
        .collect();
    sent.sort();
    let mut expected: Vec<(String, String)> = [
        (&svc_a.name, key, "a"),
        (&svc_b.name, key, "b"),
        (&svc_b.name, later, "b"),
        (&svc_a.name, third, "a"),
        (&svc_a.name, lost, "a"),
        (&svc_b.name, by_cli, "b"),
    ]
    .into_iter()
    .map(|(user, key, mailbox)| {
        let id = namespaced_message_id(user, key);
        (id, format!("{mailbox}@example.com"))
    })
    .collect();
    expected.sort();
    assert_eq!(sent, expected);
    // svc-a's reminder is cancelled in its own namespace; svc-b's is sent.
    let a_row = env
        .inbox_row(&format!("{}:{later}", svc_a.name))
        .await
        .expect("svc-a's reminder has a row");
    assert_eq!(a_row.status, "cancelled");
    let b_row = env
        .inbox_row(&format!("{}:{later}", svc_b.name))
        .await
        .expect("svc-b's reminder has a row");
    assert_eq!(b_row.status, "sent");
    let b_invoice = env.inbox_row(&format!("{}:{third}", svc_b.name)).await;
    assert_eq!(b_invoice.expect("a row").status, "cancelled");

    let status = process.terminate(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        process.log()
    );
}

/// With `worker.key_namespace` off, a producer may still set `user_id` (its own user,
/// which the broker checks): postie's re-publishes (retries, the ladder) drop it, since
/// postie's own user is no impersonator, so the job is not stuck refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ge_a_producers_user_id_does_not_block_postie_s_republishes() {
    let env = TestEnv::new("ge.uid").await;
    let tag = &env.prefix[env.prefix.len() - 6..];
    let producer = ManagedUser::create(&format!("ge-uid-{tag}"), "").await;
    let svc = Producer::connect(&producer, "uid@example.com").await;
    // Its first attempt gets a 4xx, so it goes through a retry queue; the other job
    // waits in the ladder.
    env.sink
        .set_faults(
            serde_json::json!([{"stage": "rcpt", "rcpt_contains": "uid@example.com",
            "times": 1, "action": {"reply": "451 4.3.0 try again"}}]),
        )
        .await;
    svc.send(&env, &format!("{}-retried", env.prefix), None)
        .await;
    svc.send(&env, &format!("{}-delayed", env.prefix), Some(1_500))
        .await;
    let postie = env.serve(env.settings());
    env.wait_for_emails(
        "both jobs, through a retry and the ladder",
        2,
        Duration::from_secs(60),
    )
    .await;
    let per_id = env.emails_per_id().await;
    assert!(per_id.values().all(|n| *n == 1), "{per_id:?}");
    postie.stop().await;
}
