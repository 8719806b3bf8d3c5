//! postie on a real 3-node RabbitMQ cluster (tests/support/cluster.rs): several
//! broker addresses with every password redacted, node loss (SIGKILL of the node
//! leading most of postie's queues, kept down) and a rolling restart, under load.
//!
//! Each test starts its own cluster (one at a time: they share two cores; the
//! `clusters` test group of .config/nextest.toml, slow tier) and prints
//! its figures to stderr (`--nocapture`). The bigger node-loss run is `#[ignore]`d:
//! `cargo test --test cluster -- --ignored --nocapture`.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable};
use postie::testing::broker;
use postie::testing::headers::HEADER_PUBLISHED_AT;
use support::cluster::Cluster;
use support::{eventually, free_port, job, message_id, run_postie, PostieProcess, TestEnv};

/// With the reconciler on (postie's default), the node-loss test demands that nothing
/// is lost, within the due time plus `delay.reconcile_grace` plus a margin. Set to
/// `false` to see what the ladder alone does: a job that is not sent is then tolerated
/// ONLY if the broker still holds as many messages stranded in ladder queues (RabbitMQ
/// 3.10's at-least-once dead-lettering stuck on the dead node, see the README, "Broker
/// sizing"), and the instances run with `delay.reconcile = false`; the count is printed
/// as `stranded`. The same switch governs the rolling-restart test.
const RECONCILER: bool = true;
/// `delay.reconcile_grace` the instances run with (the default since issue 26).
const RECONCILE_GRACE: Duration = Duration::from_secs(10);
/// Lateness allowed beyond the due time (and the grace, with the reconciler): a
/// new leader's election, a reconnect, and a busy 2-core machine.
const MARGIN: Duration = Duration::from_secs(45);
/// How long every instance may take to be ready again after a node is lost: the
/// reconnect backoff (`worker.outage_backoff_max` is 1 s in tests) plus the quorum
/// queues' leader elections (a few seconds) that declaring the topology waits for.
const READY_AGAIN: Duration = Duration::from_secs(30);

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

async fn get(url: &str) -> (u16, String) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    match client.get(url).send().await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(_) => (0, String::new()),
    }
}

fn start_cluster(n: usize) -> Cluster {
    tokio::task::block_in_place(|| Cluster::start(n))
}

/// Nothing lost with the reconciler; without it, a job not sent is tolerated only as a
/// message RabbitMQ 3.10 left stranded in a ladder queue (see [`RECONCILER`]).
fn assert_nothing_lost(figures: &Figures) {
    if RECONCILER {
        assert_eq!(figures.lost, 0, "jobs lost");
    } else {
        assert!(
            figures.lost as u64 <= figures.stranded,
            "{} jobs lost but only {} stranded in the ladder",
            figures.lost,
            figures.stranded
        );
    }
}

/// A `postie serve` process with an HTTP port.
struct Instance {
    process: PostieProcess,
    readyz: String,
}

fn spawn_instances(env: &TestEnv, n: usize, extra: &[(&str, &str)]) -> Vec<Instance> {
    (0..n)
        .map(|_| {
            let port = free_port();
            let listen = format!("127.0.0.1:{port}");
            let grace = format!("{}s", RECONCILE_GRACE.as_secs());
            let mut vars = vec![
                ("POSTIE__HTTP__LISTEN", listen.as_str()),
                ("POSTIE__DELAY__RECONCILE_GRACE", grace.as_str()),
                (
                    "POSTIE__DELAY__RECONCILE",
                    if RECONCILER { "true" } else { "false" },
                ),
            ];
            vars.extend_from_slice(extra);
            Instance {
                process: env.spawn_process(&vars),
                readyz: format!("http://{listen}/readyz"),
            }
        })
        .collect()
}

/// The broker address named by a `/readyz` body.
fn broker_of(body: &str) -> Option<String> {
    body.lines()
        .find_map(|l| l.strip_prefix("broker: "))
        .map(str::to_string)
}

/// Waits until every instance is ready on a node other than `not_port` (if given);
/// returns the seconds it took and the node each uses.
async fn all_ready(
    instances: &[Instance],
    not_port: Option<u16>,
    within: Duration,
) -> (f64, Vec<String>) {
    let from = Instant::now();
    loop {
        let mut nodes = Vec::new();
        for instance in instances {
            let (status, body) = get(&instance.readyz).await;
            let broker = broker_of(&body).unwrap_or_default();
            let elsewhere = not_port.is_none_or(|port| !broker.contains(&format!(":{port}/")));
            if status == 200 && elsewhere {
                nodes.push(broker);
            }
        }
        if nodes.len() == instances.len() {
            return (from.elapsed().as_secs_f64(), nodes);
        }
        if from.elapsed() > within {
            let mut report = String::new();
            for instance in instances {
                let (status, body) = get(&instance.readyz).await;
                let log = instance.process.log();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                report.push_str(&format!(
                    "\n--- {status} {body}\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
            panic!("not every instance ready within {within:?}:{report}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls every instance's `/readyz` every 100 ms in the background; the longest
/// stretch each one was not ready (503 or no answer) is its outage.
struct ReadinessWatch {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Vec<Duration>>,
}

impl ReadinessWatch {
    fn start(instances: &[Instance]) -> Self {
        let urls: Vec<String> = instances.iter().map(|i| i.readyz.clone()).collect();
        let stop = tokio_util::sync::CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut longest = vec![Duration::ZERO; urls.len()];
            let mut down_since: Vec<Option<Instant>> = vec![None; urls.len()];
            while !token.is_cancelled() {
                for (i, url) in urls.iter().enumerate() {
                    let ready = get(url).await.0 == 200;
                    match (ready, down_since[i]) {
                        (false, None) => down_since[i] = Some(Instant::now()),
                        (true, Some(since)) => {
                            longest[i] = longest[i].max(since.elapsed());
                            down_since[i] = None;
                        }
                        _ => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            for (i, since) in down_since.iter().enumerate() {
                if let Some(since) = since {
                    longest[i] = longest[i].max(since.elapsed());
                }
            }
            longest
        });
        Self { stop, task }
    }

    /// The longest not-ready stretch of each instance, in seconds.
    async fn finish(self) -> Vec<f64> {
        self.stop.cancel();
        self.task
            .await
            .unwrap()
            .iter()
            .map(Duration::as_secs_f64)
            .collect()
    }
}

/// The load: `now` jobs due at once and `pending` jobs due in 5–40 s, each stamped
/// with its publish time; returns every key's due time (Unix ms).
async fn publish_load(
    env: &TestEnv,
    tag: &str,
    now: usize,
    pending: usize,
) -> BTreeMap<String, i64> {
    let mut due = BTreeMap::new();
    let mut jobs = Vec::with_capacity(now + pending);
    let published = now_ms();
    for i in 0..now + pending {
        let delay_ms: i64 = if i < now {
            0
        } else {
            5_000 + ((i - now) as i64 * 35_000) / pending.max(1) as i64
        };
        let key = format!("{tag}-{i}");
        jobs.push((
            job(&key, "c@example.com"),
            support::delayed_properties(delay_ms, published),
        ));
        due.insert(key, published + delay_ms);
    }
    env.publish_many_with(&jobs).await;
    due
}

/// What a run ended with.
#[derive(Debug, Default)]
struct Figures {
    lateness_ms: Vec<i64>,
    lost: usize,
    early: usize,
    duplicates: usize,
    duplicates_outside_takeovers: usize,
    takeovers: i64,
    stranded: u64,
    /// Jobs the reconciler re-published from PostgreSQL.
    reconciled: i64,
}

impl Figures {
    fn percentile(&self, p: f64) -> i64 {
        let mut sorted = self.lateness_ms.clone();
        sorted.sort_unstable();
        if sorted.is_empty() {
            return 0;
        }
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }

    fn line(&self) -> String {
        format!(
            "lateness p50 {} ms p99 {} ms max {} ms; lost {}; early {}; duplicates {} (outside takeovers {}); takeovers {}; stranded {}; re-published by the reconciler {}",
            self.percentile(0.5),
            self.percentile(0.99),
            self.percentile(1.0),
            self.lost,
            self.early,
            self.duplicates,
            self.duplicates_outside_takeovers,
            self.takeovers,
            self.stranded,
            self.reconciled
        )
    }
}

/// Waits for every job (or until the last due time plus `wait`), then counts.
async fn settle(
    env: &TestEnv,
    cluster: &Cluster,
    alive: usize,
    due: &BTreeMap<String, i64>,
    wait: Duration,
) -> Figures {
    let last_due = due.values().max().copied().unwrap_or(0);
    let deadline = last_due + wait.as_millis() as i64;
    while (env.emails_per_id().await.len()) < due.len() && now_ms() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A moment for stragglers and duplicates.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let arrivals = env.arrivals().await;
    let taken_over = env.taken_over_ids().await;
    let takeovers = env.takeovers().await;
    let reconciled = env.inbox_count("reconciled_at IS NOT NULL").await;
    let mut figures = Figures {
        takeovers,
        reconciled,
        ..Figures::default()
    };
    for (key, due_ms) in due {
        let id = message_id(key);
        match arrivals.get(&id) {
            None => figures.lost += 1,
            Some(times) => {
                let first = *times.iter().min().unwrap();
                if times.iter().any(|t| t < due_ms) {
                    figures.early += 1;
                }
                figures.lateness_ms.push(first - due_ms);
                if times.len() > 1 {
                    figures.duplicates += times.len() - 1;
                    if !taken_over.contains(&id) {
                        figures.duplicates_outside_takeovers += times.len() - 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "counted arrivals at +{} ms after the last due time",
        now_ms() - last_due
    );
    // Jobs still held in the ladder after every due time has passed: stranded.
    let ladder = format!("{}.delay.", env.prefix);
    figures.stranded = cluster
        .queues(alive, &ladder)
        .iter()
        .map(|q| q.messages)
        .sum();
    figures
}

/// The node that leads the most of this test's queues, with the count.
fn busiest_leader(cluster: &Cluster, via: usize, prefix: &str) -> (usize, usize) {
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for queue in cluster.queues(via, prefix) {
        *per_node.entry(queue.leader).or_default() += 1;
    }
    let (name, count) = per_node
        .into_iter()
        .max_by_key(|(_, count)| *count)
        .expect("the test's queues have leaders");
    (
        cluster
            .index_of(&name)
            .unwrap_or_else(|| panic!("leader {name} is not a cluster node")),
        count,
    )
}

fn assert_no_panics(instances: &[Instance]) {
    for instance in instances {
        let log = instance.process.log();
        assert!(!log.contains("panicked"), "{log}");
    }
}

/// Kill -9 the node leading most of postie's queues under load and keep it down.
async fn node_loss_run(run: &str, now: usize, pending: usize) -> Figures {
    let mut cluster = start_cluster(3);
    let mut env = TestEnv::on_broker(run, &cluster.urls()).await;
    env.delete_topology = false; // the cluster goes away whole
    let instances = spawn_instances(&env, 3, &[]);
    let (_, nodes) = all_ready(&instances, None, Duration::from_secs(60)).await;
    eprintln!("{run}: instances on {nodes:?}");

    let due = publish_load(&env, run, now, pending).await;
    // Let the relays route the pending jobs into the ladder first.
    let envr = &env;
    eventually(
        "intake drained",
        Duration::from_secs(60),
        move || async move { (envr.depth(envr.topology.intake_queue()).await == 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (victim, led) = busiest_leader(&cluster, 0, &env.prefix);
    let victim_port = cluster.nodes[victim].amqp_port;
    let victim_name = cluster.nodes[victim].name.clone();
    let watch = ReadinessWatch::start(&instances);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Instant::now();
    tokio::task::block_in_place(|| cluster.kill9(victim));
    let (_, nodes) = all_ready(&instances, Some(victim_port), READY_AGAIN).await;
    let ready_after = killed.elapsed().as_secs_f64();
    let outages = watch.finish().await;
    eprintln!("{run}: killed {victim_name} (leader of {led} queues); every instance ready on another node {ready_after:.1}s later, on {nodes:?}; longest not-ready stretch per instance {outages:.1?}s");
    let alive = (victim + 1) % 3;
    let wait = if RECONCILER {
        RECONCILE_GRACE + MARGIN
    } else {
        MARGIN
    };
    let figures = settle(&env, &cluster, alive, &due, wait).await;
    eprintln!(
        "FIGURES {run}: {now} now + {pending} pending; killed {victim_name} (led {led} of the queues); every instance ready on another node within {ready_after:.1}s (longest not-ready per instance {outages:.1?}s); {}",
        figures.line()
    );
    assert_no_panics(&instances);
    assert_eq!(figures.early, 0, "jobs sent early");
    assert_eq!(
        figures.duplicates_outside_takeovers, 0,
        "duplicates outside lease takeovers"
    );
    let limit = (wait.as_millis() as i64) + 5_000;
    assert!(
        figures.percentile(1.0) <= limit,
        "a job was sent {} ms after its due time",
        figures.percentile(1.0)
    );
    assert_nothing_lost(&figures);
    let cleanup = Instant::now();
    drop(instances);
    drop(env);
    eprintln!(
        "{run}: test world deleted in {:.1}s",
        cleanup.elapsed().as_secs_f64()
    );
    drop(cluster);
    eprintln!(
        "{run}: cluster gone in {:.1}s",
        cleanup.elapsed().as_secs_f64()
    );
    figures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_busiest_node_under_load() {
    node_loss_run("closs", 300, 600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures: 3 runs of 1,000 now + 3,000 pending, about 3 minutes each"]
async fn losing_the_busiest_node_under_load_figures() {
    for round in 0..3 {
        node_loss_run(&format!("closs{round}"), 1_000, 3_000).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load() {
    const NOW: usize = 300;
    const PENDING: usize = 600;
    let mut cluster = start_cluster(3);
    let mut env = TestEnv::on_broker("croll", &cluster.urls()).await;
    env.delete_topology = false;
    let instances = spawn_instances(&env, 3, &[]);
    all_ready(&instances, None, Duration::from_secs(60)).await;
    let due = publish_load(&env, "croll", NOW, PENDING).await;
    let mut outages = Vec::new();
    for i in 0..3 {
        let port = cluster.nodes[i].amqp_port;
        let started = Instant::now();
        let watch = ReadinessWatch::start(&instances);
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::task::block_in_place(|| cluster.stop(i));
        let (_, _) = all_ready(&instances, Some(port), READY_AGAIN).await;
        let stopped = started.elapsed().as_secs_f64();
        tokio::task::block_in_place(|| cluster.restart(i));
        let outage = watch.finish().await;
        eprintln!(
            "croll: node {} stopped in {stopped:.1}s and back after {:.1}s; longest not-ready stretch per instance {outage:.1?}s",
            cluster.nodes[i].name,
            started.elapsed().as_secs_f64()
        );
        outages.push(outage);
    }
    let wait = if RECONCILER {
        RECONCILE_GRACE + MARGIN
    } else {
        MARGIN
    };
    let figures = settle(&env, &cluster, 0, &due, wait).await;
    eprintln!(
        "FIGURES croll: {NOW} now + {PENDING} pending; rolling restart of 3 nodes; longest not-ready per instance, per restart {outages:.1?}s; {}",
        figures.line()
    );
    assert_no_panics(&instances);
    assert_eq!(figures.early, 0, "jobs sent early");
    assert_eq!(figures.duplicates_outside_takeovers, 0);
    for outage in outages.iter().flatten() {
        assert!(*outage <= READY_AGAIN.as_secs_f64(), "{outages:?}");
    }
    assert_nothing_lost(&figures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_of_any_address_shows_in_logs_errors_or_readyz() {
    let mut cluster = start_cluster(1);
    let closed = [free_port(), free_port()];
    let dead = |n: usize, port: u16| format!("amqp://u:SECRETPW{n}x@127.0.0.1:{port}/%2f");
    let list = format!(
        "{},{},{}",
        dead(1, closed[0]),
        dead(2, closed[1]),
        cluster.url(0)
    );
    let mut env = TestEnv::on_broker("credact", &cluster.url(0)).await;
    env.delete_topology = false;
    let mut said = Vec::new();

    // A bad address in the list, at start-up.
    let mut vars = env.env_vars();
    let set = |vars: &mut Vec<(String, String)>, value: &str| {
        vars.retain(|(k, _)| k != "POSTIE__AMQP__URL");
        vars.push(("POSTIE__AMQP__URL".into(), value.into()));
    };
    set(
        &mut vars,
        &format!(
            "{},amqp://u:SECRETPW5x@127.0.0.1:notaport/%2f",
            cluster.url(0)
        ),
    );
    let run = run_postie(&["topology"], &vars);
    assert_ne!(run.code, Some(0));
    assert!(
        run.stderr.contains("amqp://u:***@127.0.0.1:notaport"),
        "{}",
        run.stderr
    );
    said.push(run.stderr);
    // Every address refusing (a wrong password for the real one).
    let wrong = cluster.url(0).replace(&cluster.password, "SECRETPW6x");
    set(
        &mut vars,
        &format!("{},{},{wrong}", dead(1, closed[0]), dead(2, closed[1])),
    );
    let run = run_postie(&["topology"], &vars);
    assert_ne!(run.code, Some(0));
    assert!(
        run.stderr.contains("any of its 3 addresses"),
        "{}",
        run.stderr
    );
    said.push(run.stderr);

    // Serving with two dead addresses and one live, with debug logs, through a loss
    // of the live node.
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut postie = env.spawn_process(&[
        ("POSTIE__AMQP__URL", &list),
        ("POSTIE__HTTP__LISTEN", &listen),
        ("RUST_LOG", "debug"),
    ]);
    let readyz = format!("http://{listen}/readyz");
    let readyz = &readyz;
    let body = eventually("ready", Duration::from_secs(60), move || async move {
        let (status, body) = get(readyz).await;
        (status == 200).then_some(body)
    })
    .await;
    assert_eq!(
        broker_of(&body).as_deref(),
        Some(
            format!(
                "amqp://postie:***@127.0.0.1:{}/%2f",
                cluster.nodes[0].amqp_port
            )
            .as_str()
        ),
        "{body}"
    );
    said.push(body);
    env.publish(&job("credact-1", "x@example.com")).await;
    env.emails_or_log(&postie, "the job sent", 1, Duration::from_secs(60))
        .await;
    // The live node goes away and comes back: every address fails for a while.
    tokio::task::block_in_place(|| cluster.stop(0));
    let body = eventually("not ready", Duration::from_secs(60), move || async move {
        let (status, body) = get(readyz).await;
        (status == 503).then_some(body)
    })
    .await;
    said.push(body);
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| cluster.restart(0));
    eventually("ready again", Duration::from_secs(90), move || async move {
        (get(readyz).await.0 == 200).then_some(())
    })
    .await;
    env.publish(&job("credact-2", "x@example.com")).await;
    env.emails_or_log(&postie, "the second job sent", 2, Duration::from_secs(60))
        .await;
    postie.terminate(Duration::from_secs(30));
    let log = postie.log();
    assert!(log.contains("RabbitMQ unavailable; retrying"), "{log}");
    assert!(
        log.contains("u:***@127.0.0.1"),
        "the dead addresses were tried: {log}"
    );
    said.push(log);

    // topology.quorum_initial_group_size: set on new queues; an existing queue
    // declared without it refuses the change (406), named by postie.
    let conn = broker::connect(
        &postie::config::AmqpAddresses::parse(&secrecy::SecretString::from(cluster.url(0)))
            .unwrap(),
        "t",
        Duration::from_secs(10),
    )
    .await
    .map(|c| c.connection)
    .unwrap();
    let mut settings = env.settings();
    settings.topology.quorum_initial_group_size = Some(1);
    let sized = |prefix: &str| {
        let mut topology = settings.topology.clone();
        topology.prefix = prefix.to_string();
        postie::testing::broker::Topology::new(
            &topology,
            &settings.delay,
            postie::config::DelayMode::Ladder,
        )
    };
    let existing = sized(&env.prefix)
        .declare(&conn.create_channel().await.unwrap())
        .await
        .expect_err("an existing queue keeps its arguments")
        .to_string();
    assert!(
        existing.contains("already exists on the broker with different settings"),
        "{existing}"
    );
    let fresh = format!("{}.sized", env.prefix);
    sized(&fresh)
        .declare(&conn.create_channel().await.unwrap())
        .await
        .expect("a new prefix takes the group size");
    let args = cluster
        .ctl(
            0,
            &[
                "list_queues",
                "-q",
                "--no-table-headers",
                "name",
                "arguments",
            ],
        )
        .unwrap();
    let send = args
        .lines()
        .find(|l| l.starts_with(&format!("{fresh}.send\t")))
        .unwrap_or_else(|| panic!("{args}"));
    assert!(send.contains("x-quorum-initial-group-size"), "{send}");

    for text in &said {
        assert!(!text.contains("SECRETPW"), "a password shows:\n{text}");
        assert!(
            !text.contains(&cluster.password),
            "a password shows:\n{text}"
        );
    }
    eprintln!(
        "FIGURES credact: {} lines of output checked, no password (cluster of 1 up in {:.1}s)",
        said.iter().map(|s| s.lines().count()).sum::<usize>(),
        cluster.started_in.as_secs_f64()
    );
}

/// `rabbitmqctl status` of node `i`: (Erlang memory total in bytes, file descriptors
/// in use, their limit).
fn node_usage(cluster: &Cluster, i: usize) -> (u64, u64, u64) {
    let out = cluster
        .ctl(i, &["status", "--formatter", "json"])
        .expect("rabbitmqctl status");
    let status: serde_json::Value = serde_json::from_str(out.trim()).expect("status JSON");
    let memory = status["memory"]["total"]["erlang"]
        .as_u64()
        .or_else(|| status["memory"]["total"].as_u64())
        .unwrap_or_default();
    let fds = &status["file_descriptors"];
    (
        memory,
        fds["total_used"].as_u64().unwrap_or_default(),
        fds["total_limit"].as_u64().unwrap_or_default(),
    )
}

/// Broker sizing figures for the README: queues and file handles per prefix, memory
/// per pending job in the ladder. `POSTIE_TEST_PENDING` (default 100,000) jobs are
/// relayed into the ladder (delays of 1–48 h) on a cluster of `POSTIE_TEST_NODES`
/// (default 1) nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures for the README's broker sizing; minutes"]
async fn broker_sizing_figures() {
    let pending: usize = std::env::var("POSTIE_TEST_PENDING")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let nodes: usize = std::env::var("POSTIE_TEST_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let cluster = start_cluster(nodes);
    let usage = |label: &str| {
        let all: Vec<_> = (0..nodes).map(|i| node_usage(&cluster, i)).collect();
        eprintln!("sizing {label}: {all:?} (memory bytes, fds used, fd limit) per node");
        all
    };
    let before = usage("bare");
    let mut env = TestEnv::on_broker("csize", &cluster.urls()).await;
    env.delete_topology = false;
    let declared = usage("one prefix declared");
    let queues = env.topology.queues().len();
    let printed = env.postie(&["topology"]).expect("postie topology");
    let listed = printed
        .lines()
        .find_map(|l| l.strip_prefix("queues:"))
        .map(|q| q.split(',').count())
        .unwrap_or(0);
    // Four more prefixes, for file handles per prefix.
    for k in 0..4 {
        let mut settings = env.settings();
        settings.topology.prefix = format!("{}.x{k}", env.prefix);
        let topology = postie::testing::broker::Topology::new(
            &settings.topology,
            &settings.delay,
            postie::config::DelayMode::Ladder,
        );
        let conn = broker::connect(
            &postie::config::AmqpAddresses::parse(&settings.amqp.url).unwrap(),
            "sizing",
            Duration::from_secs(10),
        )
        .await
        .map(|c| c.connection)
        .unwrap();
        topology
            .declare(&conn.create_channel().await.unwrap())
            .await
            .unwrap();
        let _ = conn.close(200, "done".into()).await;
    }
    let five = usage("five prefixes declared");

    // Pending jobs through the relay into the ladder (levels up to the default
    // delay.max; the lower levels are the ones already declared).
    let mut settings = env.settings();
    settings.delay.max = Duration::from_secs(366 * 86_400);
    let serving = env.serve(settings);
    let published = now_ms();
    let mut jobs = Vec::with_capacity(10_000);
    for i in 0..pending {
        let delay_ms: i64 = 3_600_000 + (i as i64 * 47 * 3_600_000) / pending as i64;
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
        headers.insert(
            HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(published),
        );
        jobs.push((
            job(&format!("size-{i}"), "c@example.com"),
            broker::job_properties().with_headers(headers),
        ));
        if jobs.len() == 10_000 || i + 1 == pending {
            env.publish_many_with(&jobs).await;
            jobs.clear();
        }
    }
    let relayed_from = Instant::now();
    let ladder = format!("{}.delay.", env.prefix);
    let clusterr = &cluster;
    let ladderr = &ladder;
    eventually(
        "every job in the ladder",
        Duration::from_secs(1800),
        move || async move {
            let held: u64 = clusterr.queues(0, ladderr).iter().map(|q| q.messages).sum();
            let dead = format!("{}dead", ladderr.trim_end_matches("delay."));
            let dead: u64 = clusterr.queues(0, &dead).iter().map(|q| q.messages).sum();
            assert_eq!(dead, 0, "jobs dead-lettered instead of scheduled");
            (held as usize >= pending).then_some(())
        },
    )
    .await;
    let relay_secs = relayed_from.elapsed().as_secs_f64();
    serving.stop().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let loaded = usage("pending jobs in the ladder");
    let body_bytes = job("size-99999", "c@example.com").to_string().len();
    for i in 0..nodes {
        let per_job = (loaded[i].0 as f64 - five[i].0 as f64) / pending as f64;
        eprintln!(
            "FIGURES sizing node {}: memory bare {:.1} MB, with 5 prefixes {:.1} MB, with {pending} pending {:.1} MB: {per_job:.0} bytes per pending job (body {body_bytes} bytes + headers); fds bare {} / one prefix {} / five prefixes {} / loaded {} (limit {})",
            i + 1,
            before[i].0 as f64 / 1e6,
            five[i].0 as f64 / 1e6,
            loaded[i].0 as f64 / 1e6,
            before[i].1,
            declared[i].1,
            five[i].1,
            loaded[i].1,
            before[i].2,
        );
    }
    eprintln!(
        "FIGURES sizing: {queues} queues per prefix in ladder mode (`postie topology` lists {listed}); {pending} jobs relayed into the ladder in {relay_secs:.1}s ({:.0}/s)",
        pending as f64 / relay_secs
    );
}
