//! Sending at a clock time (issue 48): the job body's `send_at` (RFC 3339 with an
//! offset), alone and with `x-delay` (the later of the two), in ladder mode against the
//! real broker, PostgreSQL and the SMTP test server; `send_at_local` in a time zone;
//! send windows (quiet hours); `postie publish --at`; and the hostile cases, each a
//! dead letter with its reason that blocks nothing.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use postie::testing::broker;
use postie::testing::broker::Topology;
use serde_json::json;
use support::{eventually, job, message_id, TestEnv};

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `at_ms` as RFC 3339 in `offset_h` hours east of UTC, with milliseconds.
fn rfc3339(at_ms: i64, offset_h: i32) -> String {
    let offset = chrono::FixedOffset::east_opt(offset_h * 3600).expect("an offset");
    chrono::DateTime::from_timestamp_millis(at_ms)
        .expect("an instant")
        .with_timezone(&offset)
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Publishes `key` with `send_at` (in `offset_h`), an `x-delay` (0: none) and
/// `postie-published-at`.
async fn publish_at(env: &TestEnv, key: &str, at: (i64, i32), delay_ms: i64, published: i64) {
    let mut body = job(key, "later@example.com");
    body["send_at"] = rfc3339(at.0, at.1).into();
    env.publish_raw(
        body.to_string().as_bytes(),
        support::delayed_properties(delay_ms, published),
    )
    .await;
}

/// Every key arrived once and not before its due time; lateness in ms, sorted.
async fn on_time(env: &TestEnv, due: &BTreeMap<String, i64>) -> Vec<i64> {
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in env.sink.messages(false).await {
        seen.entry(m.message_id).or_default().push(m.received_at_ms);
    }
    let mut lateness: Vec<i64> = (due.iter())
        .map(|(key, due_ms)| {
            let got = (seen.get(&message_id(key))).unwrap_or_else(|| panic!("{key} never sent"));
            assert_eq!(got.len(), 1, "{key} sent {} times", got.len());
            assert!(got[0] >= *due_ms, "{key} sent {} ms early", due_ms - got[0]);
            got[0] - due_ms
        })
        .collect();
    lateness.sort();
    lateness
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// `jobs` jobs with `send_at` spread evenly over `spread`, in four offsets; every
/// fourth also has an `x-delay` 1 s later than its `send_at` (that one wins), every
/// fourth an `x-delay` 1 s earlier (`send_at` wins), and the first `send_at` is an
/// hour in the past (due now). None early, each once, the inbox's due time the later.
async fn spread(name: &str, jobs: usize, spread: Duration) {
    let env = TestEnv::new(name).await;
    let serving = env.serve(env.settings());
    let start = now_ms() + 1_000;
    let step = spread.as_millis() as i64 / jobs as i64;
    let mut due = BTreeMap::new();
    for i in 0..jobs {
        let key = format!("at-{i}");
        let send_at = if i == 0 {
            start - 3_600_000
        } else {
            start + step * i as i64
        };
        let published = now_ms();
        let delay = match i % 4 {
            1 => send_at + 1_000 - published,
            2 => (send_at - 1_000 - published).max(0),
            _ => 0,
        };
        let offset = [0, 2, -5, 9][i % 4];
        publish_at(&env, &key, (send_at, offset), delay, published).await;
        due.insert(key, send_at.max(published + delay));
    }
    env.wait_for_emails("every email", jobs, spread + Duration::from_secs(90))
        .await;
    serving.stop().await;
    let lateness = on_time(&env, &due).await;
    assert_eq!(env.inbox_count("sent_at < due_at").await, 0, "sent early");
    // The recorded due time is the later of the two (to the ms the relay read).
    let client = env.db().await;
    for (key, due_ms) in due.iter().skip(1).take(8) {
        let row = client
            .query_one(
                "SELECT (extract(epoch FROM due_at) * 1000)::bigint FROM postie_inbox WHERE key = $1",
                &[key],
            )
            .await
            .expect("the row");
        let recorded: i64 = row.get(0);
        assert!(
            (recorded - due_ms).abs() <= 1,
            "{key}: due {recorded}, expected {due_ms}"
        );
    }
    assert_eq!(env.depth(env.topology.dead_queue()).await, 0);
    eprintln!(
        "FIGURES {name}: {jobs} jobs with send_at over {} s: lateness ms p50 {} p99 {} max {}; none early",
        spread.as_secs(),
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness[lateness.len() - 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_at_jobs_spread_over_8_s_are_sent_once_none_early() {
    spread("sendat8", 40, Duration::from_secs(8)).await;
}

/// The figure: 200 jobs over 60 s (p99 lateness in the FIGURES line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_send_at_jobs_spread_over_60_s_are_sent_once_none_early() {
    spread("sendat60", 200, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_clock_time_or_one_past_the_maximum_is_a_dead_letter_that_blocks_nothing() {
    let env = TestEnv::new("badsendat").await;
    let serving = env.serve(env.settings());
    // The tests' delay.max is 10 minutes.
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (
            json!({"send_at": "2027-03-28T10:00:00"}),
            "not an RFC 3339 time with an offset",
        ),
        (
            json!({"send_at": "2027-02-30T10:00:00Z"}),
            "not an RFC 3339 time with an offset",
        ),
        (
            json!({"send_at": 1_806_220_800_000_i64}),
            "send_at is not a string",
        ),
        (
            json!({"send_at": rfc3339(now_ms() + 20 * 60_000, 1)}),
            "ahead, over the maximum delay",
        ),
        (
            json!({"send_at_local": "2027-03-28T10:00", "time_zone": "Mars/Olympus_Mons"}),
            "not a time zone postie knows",
        ),
        (
            json!({"send_at_local": "2027-03-28T10:00"}),
            "send_at_local needs a time_zone",
        ),
        (
            json!({"send_at_local": "2027-03-28T10:00+02:00", "time_zone": "Europe/Berlin"}),
            "is not a local date and time",
        ),
        (
            json!({"send_at": rfc3339(now_ms(), 0), "send_at_local": "2027-03-28T10:00",
                   "time_zone": "UTC"}),
            "not both",
        ),
        (json!({"window": "00:00-00:00"}), "never opens"),
    ];
    for (i, (members, _)) in cases.iter().enumerate() {
        let mut body = job(&format!("bad-at-{i}"), "x@example.com");
        for (name, value) in members.as_object().unwrap() {
            body[name] = value.clone();
        }
        env.publish_raw(body.to_string().as_bytes(), broker::job_properties())
            .await;
    }
    let mut good = job("good", "x@example.com");
    good["send_at"] = rfc3339(now_ms(), 0).into();
    env.publish(&good).await;
    let envr = &env;
    eventually(
        "9 dead letters and the good email",
        Duration::from_secs(60),
        move || async move {
            (envr.depth(envr.topology.dead_queue()).await == 9 && envr.sink.count().await == 1)
                .then_some(())
        },
    )
    .await;
    serving.stop().await;
    let reasons = env.dead_reasons().await;
    for (_, expected) in &cases {
        assert!(
            reasons.iter().any(|r| r.contains(expected)),
            "{expected}: {reasons:?}"
        );
    }
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("over the maximum delay of 600000 ms")),
        "{reasons:?}"
    );
}

/// `send_at_local` in three zones (one without daylight saving), each 4 s from now on
/// its own wall clock, sent at that instant; and, recorded as scheduled, Berlin's
/// 02:30 on the night of 2027-03-28 (in the gap: due at 03:00 local, 01:00 UTC) and
/// on 2027-10-31 (twice: due at the first, 00:30 UTC). The delay maximum is a year
/// here, so that those are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_at_local_is_read_in_its_time_zone_gaps_and_folds_included() {
    let mut env = TestEnv::new("sendatlocal").await;
    let mut settings = env.settings();
    settings.delay.max = Duration::from_secs(366 * 86_400);
    // The environment deletes what this topology names: the longer ladder's levels.
    env.topology = Topology::new(&settings.topology, &settings.delay, settings.delay.mode);
    let serving = env.serve(settings);
    // Whole seconds: a wall-clock time is given to the second here.
    let at = (now_ms() / 1000 + 4) * 1000;
    let mut due = BTreeMap::new();
    for zone in ["Europe/Berlin", "America/New_York", "Asia/Kolkata"] {
        let wall = jiff::Timestamp::from_millisecond(at)
            .unwrap()
            .to_zoned(jiff::tz::TimeZone::get(zone).unwrap())
            .datetime()
            .strftime("%Y-%m-%dT%H:%M:%S")
            .to_string();
        let key = format!("local-{zone}");
        let mut body = job(&key, "x@example.com");
        body["send_at_local"] = wall.into();
        body["time_zone"] = zone.into();
        env.publish(&body).await;
        due.insert(key, at);
    }
    let ahead = [
        ("local-gap", "2027-03-28T02:30", "2027-03-28T01:00:00Z"),
        ("local-fold", "2027-10-31T02:30", "2027-10-31T00:30:00Z"),
    ];
    for (key, wall, _) in ahead {
        let mut body = job(key, "x@example.com");
        body["send_at_local"] = wall.into();
        body["time_zone"] = "Europe/Berlin".into();
        env.publish(&body).await;
    }
    env.wait_for_emails("three emails", 3, Duration::from_secs(60))
        .await;
    let envr = &env;
    for (key, wall, instant) in ahead {
        let due_ms = eventually("the row", Duration::from_secs(30), move || async move {
            let client = envr.db().await;
            let row = client
                .query_opt(
                    "SELECT (extract(epoch FROM due_at) * 1000)::bigint FROM postie_inbox
                      WHERE key = $1 AND status = 'scheduled'",
                    &[&key],
                )
                .await
                .unwrap();
            row.map(|r| r.get::<_, i64>(0))
        })
        .await;
        let expected: jiff::Timestamp = instant.parse().unwrap();
        assert_eq!(due_ms, expected.as_millisecond(), "{wall} in Berlin");
    }
    serving.stop().await;
    let lateness = on_time(&env, &due).await;
    eprintln!("FIGURES sendatlocal: three zones, lateness ms {lateness:?}");
}

/// A `send_at` job put straight on the send queue, as if moved there by hand (and as
/// every job reaches the worker in plugin mode once the plugin has held it for its
/// `x-delay`): the worker reads `send_at` itself and sends it back to wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_at_job_moved_straight_to_the_send_queue_still_waits() {
    let env = TestEnv::new("sendatmoved").await;
    let serving = env.serve(env.settings());
    let at = now_ms() + 4_000;
    let mut body = job("moved-at", "x@example.com");
    body["send_at"] = rfc3339(at, 0).into();
    env.publish_to_queue(
        env.topology.send_queue(),
        body.to_string().as_bytes(),
        broker::job_properties(),
    )
    .await;
    env.wait_for_emails("the email", 1, Duration::from_secs(60))
        .await;
    serving.stop().await;
    let due = BTreeMap::from([("moved-at".to_string(), at)]);
    let lateness = on_time(&env, &due).await;
    eprintln!("FIGURES sendatmoved: lateness {} ms", lateness[0]);
}

/// `postie publish --at`: from flags, and over a file's own `send_at`; with `--delay`
/// later than `--at`, the delay wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postie_publish_at_sets_send_at() {
    let env = TestEnv::new("publishat").await;
    let serving = env.serve(env.settings());
    let at = now_ms() + 3_000;
    let mut due = BTreeMap::new();
    let at_text = rfc3339(at, 2);
    let flags = |key: &'static str| {
        let at = at_text.clone();
        [
            "publish",
            "--key",
            key,
            "--from",
            "shop@example.com",
            "--to",
            "x@example.com",
            "--subject",
            "s",
            "--text",
            "t",
            "--at",
        ]
        .map(str::to_owned)
        .into_iter()
        .chain([at])
        .collect::<Vec<String>>()
    };
    let run = |args: Vec<String>| env.postie(&args.iter().map(String::as_str).collect::<Vec<_>>());
    run(flags("cli-at")).expect("publish --at");
    due.insert("cli-at".to_string(), at);
    let file = std::env::temp_dir().join(format!("{}-job.json", env.db_name));
    let mut body = job("cli-file-at", "x@example.com");
    body["send_at"] = rfc3339(now_ms(), 0).into(); // replaced by --at
    std::fs::write(&file, body.to_string()).unwrap();
    let path = file.to_str().unwrap();
    env.postie(&["publish", "--file", path, "--at", &at_text])
        .expect("publish --file --at");
    due.insert("cli-file-at".to_string(), at);
    let before = now_ms();
    let mut delayed = flags("cli-delay");
    delayed.extend(["--delay".to_owned(), "6s".to_owned()]);
    run(delayed).expect("publish --at --delay");
    due.insert("cli-delay".to_string(), before + 6_000);
    env.wait_for_emails("three emails", 3, Duration::from_secs(60))
        .await;
    serving.stop().await;
    std::fs::remove_file(&file).ok();
    let lateness = on_time(&env, &due).await;
    eprintln!("FIGURES publishat: lateness ms {lateness:?}");
}

/// `HH:MM:SS` of `at_ms` in UTC.
fn utc_clock(at_ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(at_ms)
        .unwrap()
        .format("%H:%M:%S")
        .to_string()
}

/// A bulk lane with a send window that opens `lead` from now and stays open `open_for`
/// (UTC, to the second), `window_optional`; a transactional default lane without one;
/// a fleet limit of 50/s. `held` bulk jobs are published due now, with one bulk job
/// that opts out (`"window": null`) and one transactional job. Neither of those two
/// waits; no held job is sent before the window opens or after it closes (the claim
/// comes before the close; the email reaches the sink within 500 ms of it); those
/// that were not sent in time are held again, none dead-lettered; the window's
/// release keeps to the rate.
async fn window_release(name: &str, held: usize, lead: Duration, open_for: Duration) {
    let opens = (now_ms() + lead.as_millis() as i64) / 1000 * 1000;
    let closes = opens + open_for.as_millis() as i64;
    let window = format!("{}-{}", utc_clock(opens), utc_clock(closes));
    let env = TestEnv::with_settings(
        name,
        &[
            ("POSTIE__TOPOLOGY__DEFAULT_LANE", "transactional"),
            ("POSTIE__TOPOLOGY__LANES__TRANSACTIONAL__WEIGHT", "1"),
            ("POSTIE__TOPOLOGY__LANES__BULK__WEIGHT", "1"),
            ("POSTIE__TOPOLOGY__LANES__BULK__WINDOW", &window),
            ("POSTIE__TOPOLOGY__LANES__BULK__WINDOW_OPTIONAL", "true"),
            ("POSTIE__TRANSPORT__RATE_LIMIT", "50/s"),
        ],
    )
    .await;
    let serving = env.serve(env.settings());
    let bulk = |key: &str| {
        let mut body = job(key, "list@example.com");
        body["lane"] = "bulk".into();
        (body, broker::job_properties())
    };
    let jobs: Vec<_> = (0..held).map(|i| bulk(&format!("held-{i}"))).collect();
    for chunk in jobs.chunks(2_000) {
        env.publish_many_routed("email.bulk", chunk).await;
    }
    let (mut opted_out, props) = bulk("opted-out");
    opted_out["window"] = serde_json::Value::Null;
    let published = now_ms();
    env.publish_many_routed("email.bulk", &[(opted_out, props)])
        .await;
    env.publish(&job("receipt", "buyer@example.com")).await;
    let wait = Duration::from_millis((closes - now_ms()).max(0) as u64) + Duration::from_secs(3);
    tokio::time::sleep(wait).await;
    serving.stop().await;

    let arrivals = env.arrivals().await;
    for key in ["opted-out", "receipt"] {
        let at = arrivals[&message_id(key)][0];
        assert!(
            at < opens,
            "{key} waited for the window: {} ms after publishing",
            at - published
        );
    }
    let mut sent: Vec<i64> = Vec::new();
    for i in 0..held {
        if let Some(at) = arrivals.get(&message_id(&format!("held-{i}"))) {
            assert_eq!(at.len(), 1, "held-{i} sent {} times", at.len());
            sent.push(at[0]);
        }
    }
    sent.sort();
    assert!(!sent.is_empty(), "the window opened and nothing was sent");
    assert!(
        sent[0] >= opens,
        "sent {} ms before the window opened",
        opens - sent[0]
    );
    let last = sent[sent.len() - 1];
    assert!(
        last < closes + 500,
        "sent {} ms after the window closed",
        last - closes
    );
    assert_eq!(
        env.depth(env.topology.dead_queue()).await,
        0,
        "dead letters"
    );
    // Those not sent in time wait for tomorrow's opening, recorded as scheduled.
    let scheduled = env.inbox_count("status = 'scheduled'").await;
    assert!(
        scheduled as usize + sent.len() >= held,
        "{} sent and {scheduled} scheduled of {held}",
        sent.len()
    );
    let busiest = sent
        .iter()
        .map(|t| sent.iter().filter(|u| **u >= *t && **u < t + 1_000).count())
        .max()
        .unwrap_or(0);
    let seconds = (last - sent[0]) as f64 / 1000.0;
    eprintln!(
        "FIGURES {name}: {held} jobs held by a {} s window under 50/s: {} sent inside it ({:.1}/s over {seconds:.1} s; busiest second {busiest}), first {} ms after it opened, last {} ms before it closed; {scheduled} held again; none dead",
        open_for.as_secs(),
        sent.len(),
        sent.len() as f64 / seconds.max(0.001),
        sent[0] - opens,
        closes - last
    );
    // The release keeps to the rate: at most the limit over the window, plus the
    // fleet limit's burst.
    let allowed = 50 * open_for.as_secs() as usize + 60;
    assert!(
        sent.len() <= allowed,
        "{} sent in the window, over {allowed}",
        sent.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_opening_releases_its_held_jobs_at_the_rate_and_none_outside() {
    window_release(
        "window",
        400,
        Duration::from_secs(8),
        Duration::from_secs(5),
    )
    .await;
}

/// The figure: 5,000 held jobs under 50/s, a window long enough for them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_window_opening_releases_its_held_jobs_at_the_rate_and_none_outside() {
    window_release(
        "windowbig",
        5_000,
        Duration::from_secs(30),
        Duration::from_secs(120),
    )
    .await;
}
