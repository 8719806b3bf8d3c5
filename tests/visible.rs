//! Clock times made visible (issue 48, item 5): `postie pending` and the console's
//! pending page show each job's due instant in UTC and, where it has a time zone or
//! a send window (its own or its lane's), its due time in that zone and the window;
//! a job with neither shows UTC alone.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use postie::testing::console::{self, Credentials};
use support::{delayed_properties, eventually, job, TestEnv};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "Kd2mX9qL4vR7tW1zB8nC5pF3hJ6sG0yQaE4uT7iO2rU";

/// The console's page at `path`, as its operator reads it.
async fn page(at: SocketAddr, path: &str) -> String {
    let response = reqwest::Client::new()
        .get(format!("http://{at}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "GET {path}: {}",
        response.status()
    );
    response.text().await.unwrap()
}

/// The line of `listing` that ends with `key`.
fn line_of<'a>(listing: &'a str, key: &str) -> &'a str {
    listing
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == key))
        .unwrap_or_else(|| panic!("{key} not listed:\n{listing}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_and_the_console_show_the_local_due_time_and_the_window() {
    let env = TestEnv::with_settings(
        "visible",
        &[
            ("POSTIE__TOPOLOGY__DEFAULT_LANE", "transactional"),
            ("POSTIE__TOPOLOGY__LANES__TRANSACTIONAL__WEIGHT", "1"),
            ("POSTIE__TOPOLOGY__LANES__BULK__WEIGHT", "1"),
            ("POSTIE__TOPOLOGY__LANES__BULK__WINDOW", "00:00-24:00"),
            ("POSTIE__TOPOLOGY__LANES__BULK__TIME_ZONE", "Europe/Berlin"),
        ],
    )
    .await;
    let serving = env.serve(env.settings());
    let now = chrono::Utc::now();
    // Five minutes ahead, to the minute, in Tokyo (UTC+9 all year).
    let due = now + chrono::Duration::minutes(5);
    let due = due - chrono::Duration::seconds(i64::from(chrono::Timelike::second(&due)));
    let tokyo = (due + chrono::Duration::hours(9))
        .format("%Y-%m-%dT%H:%M")
        .to_string();
    let mut zoned = job("in-tokyo", "a@example.com");
    zoned["lane"] = "bulk".into();
    zoned["send_at_local"] = tokyo.clone().into();
    zoned["time_zone"] = "Asia/Tokyo".into();
    env.publish(&zoned).await;
    let mut lane_only = job("lane-only", "b@example.com");
    lane_only["lane"] = "bulk".into();
    let published = now.timestamp_millis();
    let body = lane_only.to_string();
    env.publish_raw(body.as_bytes(), delayed_properties(300_000, published))
        .await;
    let mut own = job("own-window", "c@example.com");
    own["window"] = "mon-fri 09:00-17:00".into();
    env.publish_raw(
        own.to_string().as_bytes(),
        delayed_properties(300_000, published),
    )
    .await;
    let plain = job("plain", "d@example.com");
    env.publish_raw(
        plain.to_string().as_bytes(),
        delayed_properties(300_000, published),
    )
    .await;

    let envr = &env;
    let listing = eventually("4 pending", Duration::from_secs(60), move || async move {
        let out = envr.postie(&["pending"]).ok()?;
        out.contains("4 pending").then_some(out)
    })
    .await;
    let zoned_line = line_of(&listing, "in-tokyo");
    let utc = due.format("%Y-%m-%dT%H:%M:00.000Z").to_string();
    let local = format!("{}:00 ", tokyo.replace('T', " "));
    assert!(zoned_line.starts_with(&utc), "{zoned_line} (due {utc})");
    assert!(
        zoned_line.contains(&local)
            && zoned_line.contains("Asia/Tokyo")
            && zoned_line.contains("window 00:00-24:00"),
        "the job's zone and its lane's window: {zoned_line}"
    );
    let lane_line = line_of(&listing, "lane-only");
    assert!(
        lane_line.contains("Europe/Berlin") && lane_line.contains("window 00:00-24:00"),
        "the lane's zone and window: {lane_line}"
    );
    let own_line = line_of(&listing, "own-window");
    assert!(
        own_line.contains("window mon,tue,wed,thu,fri 09:00-17:00") && !own_line.contains('/'),
        "its own window, no zone: {own_line}"
    );
    let plain_line = line_of(&listing, "plain");
    assert!(!plain_line.contains('('), "UTC alone: {plain_line}");

    let stop = CancellationToken::new();
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let credentials = Credentials::new(Some(TOKEN.into()), None);
    let bound = console::start(env.settings(), listen, credentials, stop.clone())
        .await
        .unwrap();
    let pending = page(bound, "/pending").await;
    assert!(pending.contains("local time, window"), "{pending}");
    assert!(
        pending.contains(&local) && pending.contains("Asia/Tokyo"),
        "the console shows the local due time: {pending}"
    );
    assert!(
        pending.contains("window mon,tue,wed,thu,fri 09:00-17:00"),
        "{pending}"
    );
    // The job's own page too.
    let job_page = page(bound, "/job?key=in-tokyo").await;
    assert!(
        job_page.contains("Due, local time and window: ") && job_page.contains(&local),
        "the job page shows the local due time: {job_page}"
    );
    stop.cancel();
    serving.stop().await;
}
