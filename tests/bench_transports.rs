//! Transports side by side: the same N jobs (POSTIE_BENCH_N, 5,000 by default)
//! pre-published to the send queue and drained by one `postie serve` process, once per
//! transport (`smtp` to the SMTP sink, then `ses`, `sendgrid`, `postmark` and `mailgun`
//! to the provider test server), all in one run so that the rows are comparable; SMTP
//! also without the suppression list's lookup, first and last (A B … B A).
//!
//! Each row is timed from postie's start until the test server has accepted N emails
//! and gives emails/s, postie's CPU ms per email (its own `/proc` accounting),
//! PostgreSQL's and RabbitMQ's (every process of theirs, `/proc`), and keys lost or
//! accepted twice (by Message-ID). The test server's own CPU goes to the JSON.
//!
//! `make bench-unsubscribe` runs SMTP with one-click unsubscribe's headers off and on
//! (the same lane and keys), A B B A twice, and checks that every email of an "on"
//! run carried them and none of an "off" run did.
//!
//! `make bench-transports` (release build) prints a Markdown table and writes JSON to
//! POSTIE_BENCH_OUT, else target/bench/transports.json. POSTIE_BENCH_POSTIE_ENV adds
//! settings to the postie processes as in `tests/bench.rs`.

mod support;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use postie::testing::broker::{self, ROUTING_KEY};
use support::bench::{
    broker_connection, cpu_model, cpu_seconds, env_usize, extra_postie_env, publish_bodies, round3,
    CpuSnapshot, CpuUse, Who,
};
use support::providers::ProviderServer;
use support::{job, message_id, TestEnv};

/// The runs, in order: (label, transport, extra settings). SMTP with and without the
/// suppression check runs first and last, A B … B A, so that drift over the run
/// does not pass for the check's cost.
const RUNS: [Run; 8] = [
    ("smtp", "smtp", &[]),
    ("smtp, no suppression check", "smtp", NO_CHECK),
    ("ses", "ses", &[]),
    ("sendgrid", "sendgrid", &[]),
    ("postmark", "postmark", &[]),
    ("mailgun", "mailgun", &[]),
    ("smtp, no suppression check (again)", "smtp", NO_CHECK),
    ("smtp (again)", "smtp", &[]),
];

/// A run: its label, its transport, settings of its own.
type Run = (&'static str, &'static str, Settings);

/// `POSTIE__…` settings.
type Settings = &'static [(&'static str, &'static str)];

/// The suppression list's lookup off (issue 30's figure: the check's cost).
const NO_CHECK: &[(&str, &str)] = &[("POSTIE__SUPPRESSION__ENABLED", "false")];

/// The delivery events' outbox row off (its cost on the send path).
const NO_EVENTS: &[(&str, &str)] = &[("POSTIE__EVENTS__ENABLED", "false")];

/// `make bench-checks`: SMTP as configured by default, without the suppression check,
/// and without the events' row, each four times in the order A B C C B A A B C C B A,
/// so that the machine's drift falls on all three alike.
const CHECK_RUNS: [Run; 12] = [
    ("smtp", "smtp", &[]),
    ("smtp, no suppression check", "smtp", NO_CHECK),
    ("smtp, no events", "smtp", NO_EVENTS),
    ("smtp, no events", "smtp", NO_EVENTS),
    ("smtp, no suppression check", "smtp", NO_CHECK),
    ("smtp", "smtp", &[]),
    ("smtp", "smtp", &[]),
    ("smtp, no suppression check", "smtp", NO_CHECK),
    ("smtp, no events", "smtp", NO_EVENTS),
    ("smtp, no events", "smtp", NO_EVENTS),
    ("smtp, no suppression check", "smtp", NO_CHECK),
    ("smtp", "smtp", &[]),
];

/// One-click unsubscribe's headers on every email (issue 50): the default lane asks
/// for them, signed with a test key.
const UNSUBSCRIBE_ON: &[(&str, &str)] = &[
    ("POSTIE__TOPOLOGY__DEFAULT_LANE", "main"),
    ("POSTIE__TOPOLOGY__LANES__MAIN__UNSUBSCRIBE", "true"),
    ("POSTIE__UNSUBSCRIBE__URL", "https://shop.example/u/"),
    ("POSTIE__UNSUBSCRIBE__MAILTO", "unsubscribe@shop.example"),
    ("POSTIE__UNSUBSCRIBE__SIGN_WITH", "k1"),
    (
        "POSTIE__UNSUBSCRIBE__KEYS__K1__SECRET",
        "bench-bench-bench-bench-bench-bench-bench",
    ),
];

/// The same lane and keys, the headers off: the only difference is the headers.
const UNSUBSCRIBE_OFF: &[(&str, &str)] = &[
    ("POSTIE__TOPOLOGY__DEFAULT_LANE", "main"),
    ("POSTIE__TOPOLOGY__LANES__MAIN__UNSUBSCRIBE", "false"),
    ("POSTIE__UNSUBSCRIBE__URL", "https://shop.example/u/"),
    ("POSTIE__UNSUBSCRIBE__MAILTO", "unsubscribe@shop.example"),
    ("POSTIE__UNSUBSCRIBE__SIGN_WITH", "k1"),
    (
        "POSTIE__UNSUBSCRIBE__KEYS__K1__SECRET",
        "bench-bench-bench-bench-bench-bench-bench",
    ),
];

/// `make bench-unsubscribe`: SMTP with one-click unsubscribe's headers off and on,
/// A B B A twice.
const UNSUBSCRIBE_RUNS: [Run; 8] = [
    ("smtp, unsubscribe off", "smtp", UNSUBSCRIBE_OFF),
    ("smtp, unsubscribe on", "smtp", UNSUBSCRIBE_ON),
    ("smtp, unsubscribe on", "smtp", UNSUBSCRIBE_ON),
    ("smtp, unsubscribe off", "smtp", UNSUBSCRIBE_OFF),
    ("smtp, unsubscribe off", "smtp", UNSUBSCRIBE_OFF),
    ("smtp, unsubscribe on", "smtp", UNSUBSCRIBE_ON),
    ("smtp, unsubscribe on", "smtp", UNSUBSCRIBE_ON),
    ("smtp, unsubscribe off", "smtp", UNSUBSCRIBE_OFF),
];

/// Key prefix of the jobs (as `tests/bench.rs`'s end-to-end runs).
const KEY_PREFIX: &str = "e2e";

/// The jobs of `tests/bench.rs`'s end-to-end runs: type `bench`, one user each.
fn bodies(n: usize) -> impl Iterator<Item = Vec<u8>> {
    (0..n).map(|i| {
        let mut body = job(&format!("{KEY_PREFIX}-{i}"), "bench@example.com");
        body["type"] = "bench".into();
        body["user_id"] = format!("user-{i}").into();
        body.to_string().into_bytes()
    })
}

/// The pids of this test's child processes whose name (`comm`, cut at 15 characters)
/// starts with `name`.
fn children_named(name: &str) -> BTreeSet<u32> {
    let me = std::process::id();
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
        let (Some(open), Some(close)) = (text.find('('), text.rfind(')')) else {
            continue;
        };
        let ppid = text[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(me) && text[open + 1..close].starts_with(name) {
            found.insert(pid);
        }
    }
    found
}

/// The one child named `name` that `start` brought up, if exactly one appeared.
async fn started_child<T>(
    name: &str,
    start: impl std::future::Future<Output = T>,
) -> (T, Option<u32>) {
    let before = children_named(name);
    let value = start.await;
    let new: Vec<u32> = children_named(name).difference(&before).copied().collect();
    (value, (new.len() == 1).then(|| new[0]))
}

/// Where the emails go.
enum Server<'a> {
    Sink(&'a support::SmtpSink),
    Provider(ProviderServer),
}

impl Server<'_> {
    async fn accepted(&self) -> usize {
        match self {
            Server::Sink(sink) => sink.stats().await.accepted as usize,
            Server::Provider(server) => server.stats().await.accepted as usize,
        }
    }

    async fn message_ids(&self) -> Vec<String> {
        match self {
            Server::Sink(sink) => sink
                .messages(false)
                .await
                .into_iter()
                .map(|m| m.message_id)
                .collect(),
            Server::Provider(server) => server
                .messages(false)
                .await
                .into_iter()
                .map(|m| m.message_id)
                .collect(),
        }
    }
}

/// One transport's run.
struct Row {
    transport: &'static str,
    n: usize,
    cpu: CpuUse,
    /// postie's CPU time, s (`/proc/<pid>/stat`, read before it was killed).
    postie_cpu_s: f64,
    /// The test server's CPU time during the run, s, when its pid was found.
    server_cpu_s: Option<f64>,
    lost: usize,
    duplicates: usize,
    /// Emails that carried `List-Unsubscribe-Post` (SMTP runs only).
    one_click: Option<usize>,
}

impl Row {
    fn rate(&self) -> f64 {
        self.n as f64 / self.cpu.wall_s
    }

    fn postie_ms_per_email(&self) -> f64 {
        self.postie_cpu_s * 1000.0 / self.n.max(1) as f64
    }

    fn server_ms_per_email(&self) -> Option<f64> {
        self.server_cpu_s.map(|s| s * 1000.0 / self.n.max(1) as f64)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "transport": self.transport,
            "per_s": round3(self.rate()),
            "postie_cpu_s": round3(self.postie_cpu_s),
            "postie_cpu_ms_per_email": round3(self.postie_ms_per_email()),
            "server_cpu_ms_per_email": self.server_ms_per_email().map(round3),
            "machine": self.cpu.json(),
            "lost": self.lost,
            "duplicates": self.duplicates,
        })
    }
}

/// `n` jobs pre-published to the send queue of a fresh world, then drained by one
/// `postie serve` process sending through `transport`: timed from its start until the
/// test server has accepted `n` emails.
async fn run_transport(
    label: &'static str,
    transport: &'static str,
    settings: &[(&str, &str)],
    n: usize,
) -> Row {
    let (env, sink_pid) = started_child(
        "postie-smtp-sin",
        TestEnv::new(&format!("benchtx-{transport}")),
    )
    .await;
    let conn = broker_connection("postie-bench").await;
    let publisher = broker::confirm_channel(&conn).await.unwrap();
    publish_bodies(
        &publisher,
        env.topology.work_exchange(),
        ROUTING_KEY,
        bodies(n),
    )
    .await;
    let send_queue = env.topology.send_queue();
    assert_eq!(
        env.depth(send_queue).await as usize,
        n,
        "every job is queued"
    );

    let (server, server_pid) = if transport == "smtp" {
        (Server::Sink(&env.sink), sink_pid)
    } else {
        let (server, pid) = started_child("postie-provider", ProviderServer::start()).await;
        (Server::Provider(server), pid)
    };
    let url = match &server {
        Server::Sink(sink) => sink.smtp_url(),
        Server::Provider(server) => server.url(transport),
    };
    let mut extra = extra_postie_env();
    extra.push(("POSTIE__TRANSPORT__URL".into(), url));
    extra.extend(settings.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let extra: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();

    let server_cpu_before = server_pid.map(cpu_seconds);
    let before = CpuSnapshot::take();
    let started = Instant::now();
    let mut postie = env.spawn_process(&extra);
    let timeout = Duration::from_secs(120 + n as u64 / 10);
    loop {
        let accepted = server.accepted().await;
        if accepted >= n {
            break;
        }
        if let Ok(Some(status)) = postie.child.try_wait() {
            panic!(
                "{transport}: postie exited early ({status}):\n{}",
                postie.log()
            );
        }
        assert!(
            started.elapsed() < timeout,
            "{transport}: {accepted} of {n} emails after {timeout:?}; postie's log:\n{}",
            postie.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // postie's own accounting before it goes away.
    let postie_cpu_s = cpu_seconds(postie.child.id());
    let server_cpu_s = server_pid
        .zip(server_cpu_before)
        .map(|(pid, was)| (cpu_seconds(pid) - was).max(0.0));
    let cpu = before.until(&CpuSnapshot::take(), n);
    drop(postie);

    let one_click = match &server {
        Server::Sink(sink) => Some(
            sink.messages(true)
                .await
                .iter()
                .filter(|m| {
                    m.raw
                        .as_deref()
                        .is_some_and(|raw| raw.contains("\r\nList-Unsubscribe-Post: "))
                })
                .count(),
        ),
        Server::Provider(_) => None,
    };
    let mut ids = BTreeSet::new();
    let mut duplicates = 0;
    for id in server.message_ids().await {
        duplicates += usize::from(!ids.insert(id));
    }
    let lost = (0..n)
        .filter(|i| !ids.contains(&message_id(&format!("{KEY_PREFIX}-{i}"))))
        .count();
    let _ = conn.close(200, "done".into()).await;
    drop(server);
    Row {
        transport: label,
        n,
        cpu,
        postie_cpu_s,
        server_cpu_s,
        lost,
        duplicates,
        one_click,
    }
}

fn markdown(n: usize, rows: &[Row]) -> String {
    let mut md = String::new();
    let cores = std::thread::available_parallelism().map_or(0, |p| p.get());
    let _ = writeln!(
        md,
        "Transports side by side: N = {n} jobs from the send queue, 1 postie process; \
         {cores} cores, {}.\n",
        cpu_model()
    );
    md.push_str(
        "| transport | emails/s | postie CPU ms/email | PostgreSQL ms/email | RabbitMQ ms/email | lost | duplicates |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} | {} | {} |",
            r.transport,
            r.rate(),
            r.postie_ms_per_email(),
            r.cpu.of(Who::Postgres),
            r.cpu.of(Who::Rabbitmq),
            r.lost,
            r.duplicates,
        );
    }
    let servers: Vec<String> = rows
        .iter()
        .map(|r| match r.server_ms_per_email() {
            Some(ms) => format!("{} {ms:.3}", r.transport),
            None => format!("{} ?", r.transport),
        })
        .collect();
    let _ = writeln!(
        md,
        "\nTest server CPU ms/email: {}. Most CPU stolen by the hypervisor in a run: {:.1} %.",
        servers.join(", "),
        100.0
            * rows
                .iter()
                .map(|r| r.cpu.machine_stolen)
                .fold(0.0, f64::max)
    );
    md
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-transports"]
async fn bench_transports() {
    run_all(&RUNS, "transports.json").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-checks"]
async fn bench_checks() {
    let rows = run_all(&CHECK_RUNS, "checks.json").await;
    for label in ["smtp", "smtp, no suppression check", "smtp, no events"] {
        let mut rates: Vec<f64> = rows
            .iter()
            .filter(|r| r.transport == label)
            .map(Row::rate)
            .collect();
        rates.sort_by(f64::total_cmp);
        let median = (rates[rates.len() / 2 - 1] + rates[rates.len() / 2]) / 2.0;
        println!("{label}: median {median:.0} emails/s over {rates:.0?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-unsubscribe"]
async fn bench_unsubscribe() {
    let rows = run_all(&UNSUBSCRIBE_RUNS, "unsubscribe.json").await;
    for label in ["smtp, unsubscribe off", "smtp, unsubscribe on"] {
        let of_label: Vec<&Row> = rows.iter().filter(|r| r.transport == label).collect();
        let want = if label.ends_with("on") {
            of_label[0].n
        } else {
            0
        };
        for r in &of_label {
            assert_eq!(r.one_click, Some(want), "{label}: emails with the headers");
        }
        let mut rates: Vec<f64> = of_label.iter().map(|r| r.rate()).collect();
        let mut cpu: Vec<f64> = of_label.iter().map(|r| r.postie_ms_per_email()).collect();
        rates.sort_by(f64::total_cmp);
        cpu.sort_by(f64::total_cmp);
        let mid = |v: &[f64]| (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0;
        println!(
            "{label}: median {:.0} emails/s over {rates:.0?}; postie CPU median {:.3} ms/email over {cpu:.3?}",
            mid(&rates),
            mid(&cpu)
        );
    }
}

/// Runs `runs` in order, prints each and the table, writes the JSON to
/// POSTIE_BENCH_OUT (else `target/bench/<file>`), and checks nothing was lost or
/// sent twice.
async fn run_all(runs: &[Run], file: &str) -> Vec<Row> {
    let n = env_usize("POSTIE_BENCH_N", 5_000);
    let mut rows = Vec::new();
    for &(label, transport, settings) in runs {
        let row = run_transport(label, transport, settings, n).await;
        println!(
            "{label}: {:.0} emails/s, postie {:.3} CPU ms/email, lost {}, duplicates {}",
            row.rate(),
            row.postie_ms_per_email(),
            row.lost,
            row.duplicates
        );
        rows.push(row);
    }
    println!("\n{}", markdown(n, &rows));

    let report = serde_json::json!({
        "n": n,
        "cpu_model": cpu_model(),
        "cores": std::thread::available_parallelism().map_or(0, |p| p.get()),
        "postie_bin": support::bench::postie_bin(),
        "postie_env": extra_postie_env(),
        "transports": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    let out = std::env::var("POSTIE_BENCH_OUT")
        .unwrap_or_else(|_| format!("{}/target/bench/{file}", env!("CARGO_MANIFEST_DIR")));
    if let Some(dir) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    println!("JSON: {out}");

    for r in &rows {
        assert_eq!(
            (r.lost, r.duplicates),
            (0, 0),
            "{}: keys lost or accepted twice",
            r.transport
        );
    }
    rows
}
