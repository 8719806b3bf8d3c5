//! `make bench-console`: each console page timed over HTTP on loopback (server-side:
//! no browser) with 10^5 pending jobs in the inbox and 10^4 dead letters in
//! `<p>.dead`. Prints the median and the slowest of 5 requests per page; asserts
//! only that each page answers 200 and shows what it should. Ignored in `cargo test`.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::console::{self, Credentials};
use support::TestEnv;
use tokio_util::sync::CancellationToken;

const PENDING: i64 = 100_000;
const DEAD: usize = 10_000;
const RUNS: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: make bench-console"]
async fn bench_console_pages() {
    let env = TestEnv::new("benchconsole").await;
    // The rows the relay writes for scheduled jobs (ladder mode), body kept.
    let inbox = env.settings().database;
    let inbox = postie::testing::inbox::Inbox::new(&inbox.plan().unwrap(), &inbox).unwrap();
    inbox.migrate().await.unwrap();
    env.db()
        .await
        .execute(
            "INSERT INTO postie_inbox (key, status, due_at, revision, body)
             SELECT 'order-' || i || ':reminder', 'scheduled',
                    now() + interval '1 hour' + i * interval '10 ms', 0,
                    convert_to(json_build_object('key', 'order-' || i || ':reminder',
                        'type', CASE WHEN i % 10 = 0 THEN 'digest' ELSE 'reminder' END,
                        'to', json_build_array('user' || i || '@example.com'),
                        'subject', 'Hello', 'text', 'Hello')::text, 'UTF8')
               FROM generate_series(1, $1::bigint) AS i",
            &[&PENDING],
        )
        .await
        .unwrap();
    env.db()
        .await
        .execute("ANALYZE postie_inbox", &[])
        .await
        .unwrap();
    let dead = env.topology.dead_queue().to_owned();
    let started = Instant::now();
    for i in 0..DEAD {
        let mut headers = FieldTable::default();
        let reason = format!(
            "the transport refused the email: permanent error (550): 5.7.{} rejected",
            i % 7
        );
        headers.insert(
            "postie-dead-reason".into(),
            AMQPValue::LongString(reason.into()),
        );
        headers.insert(
            "postie-dead-kind".into(),
            AMQPValue::LongString("permanent".into()),
        );
        let body = support::job(&format!("dead-{i}"), "nobody@example.com").to_string();
        env.publish_to_queue(
            &dead,
            body.as_bytes(),
            postie::testing::broker::job_properties().with_headers(headers),
        )
        .await;
    }
    println!(
        "{DEAD} dead letters published in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let stop = CancellationToken::new();
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let bound = console::start(env.settings(), listen, Credentials::default(), stop.clone())
        .await
        .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    let pages: [(&str, &str); 11] = [
        ("/", "Inbox rows by status"),
        ("/pending", "100000 pending"),
        ("/pending?page=1000", "100000 pending"),
        ("/pending?type=digest", "10000 pending"),
        ("/pending?prefix=order-99", "1111 pending"),
        (
            "/pending/cancel?prefix=order-1",
            "11112 pending job(s) match",
        ),
        ("/job?key=order-5:reminder", "scheduled"),
        ("/dead", "10000 dead letter(s)"),
        ("/dead/letter?key=dead-9999", "nobody@example.com"),
        ("/dead/replay?reason=5.7.3", "1429 dead letter(s) match"),
        ("/suppression", "Suppress an address"),
    ];
    println!("page | median ms | slowest ms (of {RUNS})");
    for (path, expected) in pages {
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let started = Instant::now();
            let response = http
                .get(format!("http://{bound}{path}"))
                .send()
                .await
                .unwrap();
            let status = response.status();
            let body = response.text().await.unwrap();
            times.push(started.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(status, 200, "{path}: {body}");
            assert!(body.contains(expected), "{path} lacks {expected:?}");
        }
        times.sort_by(f64::total_cmp);
        println!("{path} | {:.0} | {:.0}", times[RUNS / 2], times[RUNS - 1]);
    }
    stop.cancel();
}
