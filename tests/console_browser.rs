//! The operator console in a real browser (headless Chromium through chromedriver):
//! a person signs in, reads each page, cancels a pending job and replays a dead
//! letter by clicking, and the effect shows in PostgreSQL and RabbitMQ; the overview
//! refreshes itself.
//!
//! With POSTIE_CONSOLE_SCREENSHOTS=<folder> it also saves a screenshot of each page
//! there (`make console-screenshots` writes docs/console/).

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use postie::testing::console::{self, Credentials};
use serde_json::json;
use support::browser::Browser;
use support::{delayed_properties, eventually, job, TestEnv};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);
/// A token as `postie console --new-token` makes it.
const OPERATOR: &str = "Hs3Jq8Lz1Wx6Cv0Bn5Mk9Pr2Tf7Yg4Ud1Ie6Oa3Sw8E";

fn shot(name: &str) -> Option<PathBuf> {
    let folder = PathBuf::from(std::env::var_os("POSTIE_CONSOLE_SCREENSHOTS")?);
    std::fs::create_dir_all(&folder).unwrap();
    Some(folder.join(format!("{name}.png")))
}

async fn look(browser: &Browser, url: &str, name: &str, expected: &[&str]) -> String {
    browser.open(url).await;
    let text = browser.text().await;
    for wanted in expected {
        assert!(
            text.contains(wanted),
            "{url} does not show {wanted:?}:\n{text}"
        );
    }
    if let Some(path) = shot(name) {
        browser.screenshot(&path).await;
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_reads_every_page_and_clicks_cancel_and_replay() {
    let env = TestEnv::new("consolebr").await;
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.7.1 rejected by policy"}}]))
        .await;
    let serving = env.serve(env.settings());
    for i in 1..=3 {
        env.publish(&job(
            &format!("order-{i}:confirmation"),
            "alice@example.com",
        ))
        .await;
    }
    env.publish(&job("order-9:confirmation", "nobody@example.com"))
        .await;
    let now = chrono::Utc::now().timestamp_millis();
    for (key, delay) in [("order-5:reminder", 240_000), ("order-6:reminder", 300_000)] {
        let mut body = job(key, "bob@example.com");
        body["type"] = json!("reminder");
        env.publish_raw(body.to_string().as_bytes(), delayed_properties(delay, now))
            .await;
    }
    env.wait_for_status("order-3:confirmation", "sent", WAIT)
        .await;
    env.wait_for_status("order-9:confirmation", "dead", WAIT)
        .await;
    env.wait_for_status("order-5:reminder", "scheduled", WAIT)
        .await;
    env.wait_for_status("order-6:reminder", "scheduled", WAIT)
        .await;
    let dead = env.topology.dead_queue().to_owned();
    eventually("the dead letter", WAIT, || async {
        (env.depth(&dead).await == 1).then_some(())
    })
    .await;

    let stop = CancellationToken::new();
    let credentials = Credentials::new(Some(OPERATOR.into()), None);
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let bound = console::start(env.settings(), listen, credentials, stop.clone())
        .await
        .unwrap();
    let site = format!("http://{bound}");
    let browser = Browser::start().await;

    // Without the token: the sign-in form. With it: the overview.
    look(&browser, &format!("{site}/"), "signin", &["Sign in"]).await;
    browser.open(&format!("{site}/login")).await;
    browser.type_into("input[name=token]", OPERATOR).await;
    browser.click("form[action='/login'] button").await;
    let overview = browser.text().await;
    assert!(
        overview.contains("Inbox rows by status") && overview.contains("operator · may act"),
        "{overview}"
    );
    look(
        &browser,
        &format!("{site}/"),
        "overview",
        &["3 sent in the last hour", &dead, "scheduled"],
    )
    .await;
    look(
        &browser,
        &format!("{site}/job?key=order-1:confirmation"),
        "job",
        &["sent", "message_id", "smtp"],
    )
    .await;
    look(
        &browser,
        &format!("{site}/suppression"),
        "suppression",
        &["Suppress an address"],
    )
    .await;

    // Pending: both reminders; cancel the first by its button.
    look(
        &browser,
        &format!("{site}/pending?type=reminder"),
        "pending",
        &["2 pending", "order-5:reminder", "order-6:reminder"],
    )
    .await;
    browser.click("form[action='/job/cancel'] button").await;
    let cancelled = browser.text().await;
    assert!(
        cancelled.contains("order-5:reminder: was scheduled"),
        "{cancelled}"
    );
    assert_eq!(
        env.inbox_row("order-5:reminder").await.unwrap().status,
        "cancelled"
    );
    assert_eq!(
        env.inbox_row("order-6:reminder").await.unwrap().status,
        "scheduled"
    );

    // Dead letters: grouped, one letter's body; replay it, confirmed first.
    look(
        &browser,
        &format!("{site}/dead"),
        "dead",
        &[
            "1 dead letter(s)",
            "rejected by policy",
            "order-9:confirmation",
        ],
    )
    .await;
    look(
        &browser,
        &format!("{site}/dead/letter?key=order-9:confirmation"),
        "letter",
        &["nobody@example.com", "postie-dead-reason"],
    )
    .await;
    env.sink.set_faults(json!([])).await;
    browser.open(&format!("{site}/dead")).await;
    browser.click("a[href^='/dead/replay?reason=']").await;
    let confirm = browser.text().await;
    assert!(confirm.contains("1 dead letter(s) match"), "{confirm}");
    if let Some(path) = shot("replay-confirm") {
        browser.screenshot(&path).await;
    }
    browser.click("form[action='/dead/replay'] button").await;
    let replayed = browser.text().await;
    assert!(replayed.contains("Replayed 1 dead letter(s)"), "{replayed}");
    env.wait_for_status("order-9:confirmation", "sent", WAIT)
        .await;
    assert_eq!(env.depth(&dead).await, 0);

    // The overview refreshes itself (htmx): a job sent meanwhile shows without a reload.
    browser.open(&format!("{site}/")).await;
    browser.wait_for_text("4 sent in the last hour").await;
    env.publish(&job("order-10:confirmation", "alice@example.com"))
        .await;
    env.wait_for_status("order-10:confirmation", "sent", WAIT)
        .await;
    browser.wait_for_text("5 sent in the last hour").await;

    browser.close().await;
    stop.cancel();
    serving.stop().await;
}
