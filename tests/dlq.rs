//! DLQ tooling against a real broker: `postie dlq list` shows dead letters without
//! consuming them, `postie dlq replay` moves only the matching ones back, and the
//! management UI's "Move messages" (a dynamic shovel) replays with a fresh retry cycle.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use postie::testing::dlq::{self, DeadLetterSummary, ReplayFilter, ReplayReport};
use serde_json::json;
use support::{eventually, job, management_url, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

async fn wait_for_dead(env: &TestEnv, count: u32) {
    eventually(
        &format!("{count} dead letter(s)"),
        WAIT,
        move || async move { (env.depth(env.topology.dead_queue()).await == count).then_some(()) },
    )
    .await;
}

fn keys(letters: &[DeadLetterSummary]) -> BTreeSet<String> {
    letters.iter().map(|l| l.key.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_dead_letters_without_consuming_and_replay_moves_only_matching_ones() {
    let env = TestEnv::new("dlqtool").await;
    let settings = env.settings();
    let (envr, settingsr) = (&env, &settings);
    env.sink
        // 5.7.1, a policy refusal: a refusal that a fix on the receiving side lifts and
        // that does not suppress the address (a 5.1.1 would: replaying its job would
        // then end `suppressed` until `postie suppression remove`).
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.7.1 rejected by policy"}}]))
        .await;
    let serving = env.serve(env.settings());
    env.publish(&job("k-nobody-1", "nobody1@example.com")).await;
    env.publish(&job("k-nobody-2", "nobody2@example.com")).await;
    let mut bad_address = job("k-badaddr", "a@example.com");
    bad_address["to"] = json!(["alice at example dot com"]);
    env.publish(&bad_address).await;
    env.publish_raw(
        b"{\"key\": \"k-broken\", ",
        postie::testing::broker::job_properties(),
    )
    .await;
    wait_for_dead(&env, 4).await;

    // list: every dead letter, with its key (parsed, raw, or "-") and reason.
    let letters = dlq::list(&settings, 10).await.unwrap();
    assert_eq!(letters.len(), 4, "{letters:#?}");
    assert_eq!(
        keys(&letters),
        BTreeSet::from(["-", "k-badaddr", "k-nobody-1", "k-nobody-2"].map(String::from))
    );
    for letter in &letters {
        assert!(letter.dead_at.is_some(), "{letter:?}");
        if letter.key.starts_with("k-nobody") {
            assert_eq!(letter.kind, "permanent");
            assert!(letter.reason.contains("550"), "{letter:?}");
            assert_eq!(letter.attempts, Some(1));
        } else {
            assert_eq!(letter.kind, "invalid");
            assert!(letter.reason.contains("not a valid"), "{letter:?}");
            assert_eq!(letter.attempts, Some(0));
        }
    }
    let table = dlq::table(&letters);
    assert_eq!(table.lines().count(), 5, "{table}");
    assert!(
        table.contains("k-nobody-1") && table.contains("550"),
        "{table}"
    );

    // Nothing was consumed: the depth is back to 4, and a second look (with a
    // limit) sees the same oldest letters.
    wait_for_dead(&env, 4).await;
    let two = dlq::list(&settings, 2).await.unwrap();
    assert_eq!(two.len(), 2);
    assert!(two.iter().all(|l| letters.contains(l)), "{two:#?}");
    wait_for_dead(&env, 4).await;

    // The cause is fixed; replay one key, then everything with a 550.
    env.sink.clear_faults().await;
    let filter = ReplayFilter {
        key: Some("k-nobody-1".into()),
        ..Default::default()
    };
    let report = dlq::replay(&settings, &filter).await.unwrap();
    assert_eq!(report, ReplayReport { moved: 1, kept: 3 });
    eventually("the first replayed email", WAIT, move || async move {
        (envr.sink.count().await == 1).then_some(())
    })
    .await;

    let filter = ReplayFilter {
        reason_contains: Some("550".into()),
        ..Default::default()
    };
    let report = dlq::replay(&settings, &filter).await.unwrap();
    assert_eq!(report, ReplayReport { moved: 1, kept: 2 });
    eventually("both replayed emails", WAIT, move || async move {
        (envr.sink.count().await == 2).then_some(())
    })
    .await;
    // The sink has an email before postie records it: wait for the record.
    for key in ["k-nobody-1", "k-nobody-2"] {
        eventually("the replayed job recorded sent", WAIT, move || async move {
            let row = envr.inbox_row(key).await.unwrap();
            (row.status == "sent").then_some(())
        })
        .await;
        let row = env.inbox_row(key).await.unwrap();
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("sent", 2),
            "{key}: {row:?}"
        );
    }

    // The others stayed where they were.
    wait_for_dead(&env, 2).await;
    let rest = dlq::list(&settings, 10).await.unwrap();
    assert_eq!(
        keys(&rest),
        BTreeSet::from(["-", "k-badaddr"].map(String::from))
    );

    // A limit caps the moves; an invalid job replayed is dead-lettered again.
    let filter = ReplayFilter {
        reason_contains: Some("NOT A VALID".into()),
        limit: Some(1),
        ..Default::default()
    };
    let report = dlq::replay(&settings, &filter).await.unwrap();
    assert_eq!(report, ReplayReport { moved: 1, kept: 0 });
    wait_for_dead(&env, 2).await;
    eventually(
        "the replayed invalid job back in the DLQ",
        WAIT,
        move || async move {
            let letters = dlq::list(settingsr, 10).await.unwrap();
            (letters.len() == 2 && letters.iter().all(|l| l.kind == "invalid")).then_some(())
        },
    )
    .await;

    serving.stop().await;
    assert_eq!(env.sink.count().await, 2);
    assert_eq!(env.depth(env.topology.send_queue()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_management_ui_move_replays_a_dead_letter_with_a_fresh_retry_cycle() {
    let env = TestEnv::new("dlqshovel").await;
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "down", "action": {"reply": "421 4.4.2 service down"}}]))
        .await;
    let envr = &env;
    let serving = env.serve(env.settings());
    env.publish(&job("k-down", "down@example.com")).await;
    wait_for_dead(&env, 1).await;
    // 3 retry steps in the test settings → 4 attempts, then the DLQ.
    let letters = dlq::list(&env.settings(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(
        (letters[0].kind.as_str(), letters[0].attempts),
        ("retries_exhausted", Some(4))
    );
    wait_for_dead(&env, 1).await;

    // Still flaky: two more failures. Only a fresh cycle (3 retry steps left, not 0)
    // gets the job through.
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "down", "action": {"reply": "421 4.4.2 service down"}, "times": 2}]))
        .await;
    let shovel = Shovel::move_messages(env.topology.dead_queue(), env.topology.send_queue()).await;

    eventually("the moved job's email", WAIT, move || async move {
        (envr.sink.count().await == 1).then_some(())
    })
    .await;
    let row = env.inbox_row("k-down").await.unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 7), "{row:?}");
    // With src-delete-after = queue-length the shovel removes itself.
    let shovelr = &shovel;
    eventually("the shovel to delete itself", WAIT, move || async move {
        (!shovelr.exists().await).then_some(())
    })
    .await;
    shovel.delete().await;

    serving.stop().await;
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    assert_eq!(env.depth(env.topology.send_queue()).await, 0);
    assert_eq!(env.sink.count().await, 1);
}

/// A dynamic shovel as the management UI's "Move messages" creates it; deleted on
/// drop if it is still there.
struct Shovel {
    url: reqwest::Url,
    http: reqwest::Client,
}

impl Shovel {
    /// What Queues → (queue) → Move messages sends (rabbitmq_shovel_management's
    /// form, RabbitMQ 3.10): a shovel on the default vhost named "Move from <queue>".
    async fn move_messages(from: &str, to: &str) -> Self {
        let name = format!("Move from {from}");
        let mut url = reqwest::Url::parse(&management_url()).unwrap();
        url.path_segments_mut()
            .unwrap()
            .extend(["api", "parameters", "shovel", "/", &name]);
        let shovel = Self {
            url,
            http: reqwest::Client::new(),
        };
        let body = json!({
            "component": "shovel",
            "vhost": "/",
            "name": name,
            "value": {
                "src-uri": "amqp:///%2F",
                "src-queue": from,
                "src-protocol": "amqp091",
                "src-prefetch-count": 1000,
                "src-delete-after": "queue-length",
                "dest-protocol": "amqp091",
                "dest-uri": "amqp:///%2F",
                "dest-add-forward-headers": false,
                "ack-mode": "on-confirm",
                "dest-queue": to,
            }
        });
        let response = shovel
            .http
            .put(shovel.url.clone())
            .basic_auth("guest", Some("guest"))
            .json(&body)
            .send()
            .await
            .expect("RabbitMQ management API (rabbitmq_management enabled?)");
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        assert!(
            status.is_success(),
            "creating the shovel: {status} {text} (rabbitmq_shovel enabled?)"
        );
        shovel
    }

    async fn exists(&self) -> bool {
        let response = self
            .http
            .get(self.url.clone())
            .basic_auth("guest", Some("guest"))
            .send()
            .await
            .expect("RabbitMQ management API");
        response.status() != reqwest::StatusCode::NOT_FOUND
    }

    async fn delete(&self) {
        let _ = self
            .http
            .delete(self.url.clone())
            .basic_auth("guest", Some("guest"))
            .send()
            .await;
    }
}

impl Drop for Shovel {
    fn drop(&mut self) {
        let url = self.url.clone();
        // Async clean-up from a sync Drop, as TestEnv does.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let _ = reqwest::Client::new()
                    .delete(url)
                    .basic_auth("guest", Some("guest"))
                    .send()
                    .await;
            })
        })
        .join();
    }
}
