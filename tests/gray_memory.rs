//! Memory bounded by configuration, not by the producers (issue 26, item 4): postie
//! runs as a process of its own, and its peak resident set (`VmHWM` in
//! `/proc/<pid>/status`) is read after each load.
//!
//! - a 90 MB body, on the relay (ladder intake) and straight on the send queue, is
//!   dead-lettered by its size, and the process stays below three times the body;
//! - 8,000 jobs of 60 KB HTML (2,000 in the fast tier's twin) published (before postie starts) with a 20 s delay
//!   through the ladder are all sent, and the process stays below 384 MiB (the Kubernetes manifest caps the pod
//!   at 512 Mi).

mod support;

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker;
use support::{eventually, job, TestEnv};

const MIB: u64 = 1024 * 1024;

/// A kB figure of `/proc/<pid>/status`, in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("a kB figure");
    kb * 1024
}

/// The process's peak resident set so far.
fn peak_rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// Job properties with an `x-delay`.
fn delayed(delay_ms: i64) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
    broker::job_properties().with_headers(headers)
}

/// Waits until postie consumes the send queue.
async fn wait_serving(env: &TestEnv) {
    let send = env.topology.send_queue();
    let send = &send;
    eventually(
        "postie to consume",
        Duration::from_secs(60),
        move || async move { (env.consumers(send).await > 0).then_some(()) },
    )
    .await;
}

/// The effective prefetch is logged at start-up.
fn assert_budget_logged(log: &str) {
    assert!(
        log.contains("in-flight bodies bounded: each lane's prefetch"),
        "the effective prefetch is logged at start-up: {log}"
    );
}

/// Whether the broker itself refuses `body` by size (RabbitMQ 4.x's default
/// `max_message_size` is 16 MiB; 3.x's 128 MiB). Tried on a connection of its own.
async fn broker_refuses(env: &TestEnv, body: &[u8]) -> bool {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let channel = broker::confirm_channel(&conn).await.unwrap();
    // A queue of this connection's alone (gone when it closes): the body only probes
    // the limit.
    let probe = format!("{}.size-probe", env.prefix);
    channel
        .queue_declare(
            probe.as_str().into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let sent =
        broker::publish_confirmed(&channel, "", &probe, true, body, broker::job_properties()).await;
    let _ = conn.close(200, "done".into()).await;
    match sent {
        Ok(()) => false,
        Err(error) => {
            let text = error.to_string();
            assert!(
                text.contains("larger than configured max size"),
                "only a size refusal is expected: {text}"
            );
            eprintln!("gf huge body: the broker refuses it ({text}); postie never sees it");
            true
        }
    }
}

/// A job body of `bytes`: a valid key up front, then a huge HTML part.
fn huge_body(bytes: usize) -> Vec<u8> {
    let mut body = job("gf-huge", "huge@example.com");
    body["html"] = serde_json::json!("");
    let text = body.to_string();
    let field = r#""html":""#;
    let html_at = text.find(field).expect("the html field") + field.len();
    let mut out = text.into_bytes();
    let padding = bytes - out.len();
    out.splice(html_at..html_at, std::iter::repeat_n(b'x', padding));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_a_90_mb_body_is_dead_lettered_by_size_within_three_times_its_size() {
    const BODY: usize = 90 * 1_000_000;
    let env = TestEnv::new("gf_hugebody").await;
    let body = huge_body(BODY);
    assert_eq!(body.len(), BODY);
    if broker_refuses(&env, &body).await {
        // RabbitMQ 4.x: max_message_size defaults to 16 MiB, so the producer gets the
        // broker's refusal and postie never sees the body (docs/brokers.md, "Broker generations").
        return;
    }
    // Through the relay (ladder intake), then straight onto the send queue, each
    // with a fresh process, so that each peak is that path's own.
    for path in ["relay", "send"] {
        let mut postie = env.spawn_process(&[]);
        wait_serving(&env).await;
        let pid = postie.child.id();
        let before = peak_rss(pid);
        match path {
            "relay" => env.publish_raw(&body, delayed(0)).await,
            _ => {
                let send = env.topology.send_queue();
                env.publish_to_queue(send, &body, broker::job_properties())
                    .await
            }
        }
        let dead = &env.topology.dead_queue();
        let envr = &env;
        eventually(
            "the huge body dead-lettered",
            Duration::from_secs(120),
            move || async move { (envr.depth(dead).await >= 1).then_some(()) },
        )
        .await;
        let peak = peak_rss(pid);
        // Stopped, not killed: a kill could land between the dead letter's confirm and
        // the ack, and the next process would take the body again (a second dead letter,
        // the publish-then-ack window) and count it in its own peak.
        let exit = postie.terminate(Duration::from_secs(30));
        assert!(
            exit.is_some_and(|e| e.success()),
            "{path}: stopped: {exit:?}"
        );
        let log = postie.log();
        let letters = env.take_dead_letters().await;
        assert_eq!(letters.len(), 1, "{path}");
        assert!(
            letters[0].reason().contains("over the limit"),
            "{path}: dead-lettered by size: {}",
            letters[0].reason()
        );
        assert_eq!(
            letters[0].body.len(),
            BODY,
            "the dead letter keeps the body"
        );
        eprintln!(
            "gf huge body, {path} path: peak RSS {} MiB before, {} MiB after",
            before / MIB,
            peak / MIB
        );
        assert_budget_logged(&log);
        assert!(
            peak < 3 * BODY as u64,
            "{path}: peak RSS {} MiB is not below three times the body ({} MiB)",
            peak / MIB,
            3 * BODY as u64 / MIB
        );
    }
    assert_eq!(env.sink.count().await, 0);
}

/// The fast tier's twin: 2,000 jobs of 60 KB (120 MB of bodies, still far past the
/// in-flight budget), with the same bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gf_2000_html_jobs_through_the_ladder_stay_below_384_mib() {
    html_jobs_through_the_ladder_stay_below_384_mib(2_000).await;
}

/// The full size the docs quote (slow tier): 8,000 jobs, 480 MB of bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_gf_8000_html_jobs_through_the_ladder_stay_below_384_mib() {
    html_jobs_through_the_ladder_stay_below_384_mib(8_000).await;
}

async fn html_jobs_through_the_ladder_stay_below_384_mib(jobs: usize) {
    const HTML: usize = 60 * 1_000;
    let env = TestEnv::new("gf_htmlburst").await;
    // Published before postie starts, so that the whole burst waits in the intake
    // when the relay connects (the worst case for its window); without a publish
    // time, each job is due 20 s after the relay takes it, so all go through the ladder.
    let html = format!("<p>{}</p>", "a".repeat(HTML - 7));
    let bodies: Vec<_> = (0..jobs)
        .map(|i| {
            let mut body = job(&format!("gf-html-{i}"), "html@example.com");
            body["html"] = serde_json::json!(html);
            (body, delayed(20_000))
        })
        .collect();
    let started = std::time::Instant::now();
    for chunk in bodies.chunks(500) {
        env.publish_many_with(chunk).await;
    }
    drop(bodies);
    eprintln!(
        "gf html burst: published {jobs} jobs in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let postie = env.spawn_process(&[]);
    wait_serving(&env).await;
    let pid = postie.child.id();
    env.wait_for_emails("every HTML job", jobs, Duration::from_secs(900))
        .await;
    let peak = peak_rss(pid);
    assert_eq!(env.sink.count().await, jobs, "each job sent once");
    assert_eq!(
        env.inbox_count("status = 'sent'").await,
        jobs as i64,
        "every job recorded as sent"
    );
    eprintln!(
        "gf html burst: all {jobs} sent in {:.1}s, peak RSS {} MiB",
        started.elapsed().as_secs_f64(),
        peak / MIB
    );
    assert_budget_logged(&postie.log());
    assert!(
        peak < 384 * MIB,
        "peak RSS {} MiB is not below 384 MiB",
        peak / MIB
    );
}
