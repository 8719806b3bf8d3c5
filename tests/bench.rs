//! Throughput benchmark: how many emails/s `postie serve` sends end to end (1 and 3
//! processes), the ceiling of each leg measured alone at postie's default concurrency
//! (broker, database, SMTP, and the test sink itself), the fair bound those legs
//! allow when they share the machine, CPU per email and peak RSS, and ladder lateness
//! with broker memory for 10^3 to 10^5 pending delayed jobs.
//!
//! `make bench` runs the full size (N = 20,000 per run, POSTIE_BENCH_N; pending up to
//! 100,000, POSTIE_BENCH_PENDING_MAX; 3 rounds of legs + send and delayed paths,
//! POSTIE_BENCH_ROUNDS, each run's ratio given per round and as the median over the
//! rounds; the detailed tables show the median round), prints Markdown tables and writes
//! target/bench/bench.json and target/bench/bench.md. The smoke version below runs
//! with the tests, so the harness cannot rot; it checks sanity, never timings.

mod support;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Channel;
use postie::config::Settings;
use postie::testing::broker;
use postie::testing::broker::{DelayLayout, ROUTING_KEY};
use postie::testing::contract::{EmailJob, ParseRules};
use postie::testing::inbox::{Claim, Completion, Inbox};
use postie::testing::mail::{Clearance, Mailer};
use support::bench::{
    broker_connection, broker_memory, clock_ticks, cpu_model, cpu_seconds, env_usize, message_id,
    peak_rss_kib, publish_bodies, publish_delayed, round3, try_management_api, CpuSnapshot, CpuUse,
    Lateness, Who,
};
use support::{job, PostieProcess, TestEnv};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;

/// Short-delay jobs whose lateness is measured next to each pending backlog.
const SHORT_JOBS: usize = 200;
/// Their delays are spread over 0 to this, ms.
const SHORT_SPREAD_MS: i64 = 5_000;
/// The backlog's delay: far enough that none of it fires during a run.
const PENDING_DELAY_MS: i64 = 9 * 60 * 1000;
/// The management API refreshes node statistics every 5 s.
const STATS_REFRESH: Duration = Duration::from_secs(6);

/// postie's defaults, which every leg is measured at.
struct Defaults {
    concurrency: usize,
    prefetch: u16,
    db_pool: usize,
    transport_pool: u32,
    relay_concurrency: u16,
    relay_prefetch: u16,
}

impl Defaults {
    fn read() -> Self {
        let s = Settings::default();
        Self {
            concurrency: s.worker.concurrency,
            prefetch: s.amqp.prefetch,
            db_pool: s.database.pool_size,
            transport_pool: s.transport.pool_size,
            relay_concurrency: s.delay.relay_concurrency,
            relay_prefetch: s.relay_prefetch(),
        }
    }
}

/// One timed run of `n` emails.
struct Measured {
    label: String,
    n: usize,
    cpu: CpuUse,
}

impl Measured {
    fn new(label: impl Into<String>, n: usize, before: &CpuSnapshot) -> Self {
        let after = CpuSnapshot::take();
        Self {
            label: label.into(),
            n,
            cpu: before.until(&after, n),
        }
    }

    fn rate(&self) -> f64 {
        self.n as f64 / self.cpu.wall_s
    }

    fn json(&self) -> serde_json::Value {
        let mut value = self.cpu.json();
        value["label"] = self.label.clone().into();
        value["n"] = self.n.into();
        value["per_s"] = round3(self.rate()).into();
        value
    }
}

/// Where the end-to-end jobs are pre-published.
#[derive(Clone, Copy)]
enum Entry {
    /// `<p>.work` → `<p>.send`: the path the leg ceilings model.
    Send,
    /// `<p>.delayed` → intake relay → `<p>.send`: the producers' path.
    Delayed,
}

/// One end-to-end run.
struct EndToEnd {
    instances: usize,
    entry: Entry,
    run: Measured,
    postie_cpu_s: Vec<f64>,
    peak_rss_kib: Vec<u64>,
    lost: usize,
    duplicates: usize,
    /// Seconds from the processes' start to the sink's first email (start-up:
    /// connections, migrations, topology, the first claims).
    first_email_s: f64,
    /// Emails per second from the first email to the last: the pace once running.
    running_rate: f64,
}

impl EndToEnd {
    fn label(&self) -> String {
        let path = match self.entry {
            Entry::Send => "send queue → SMTP",
            Entry::Delayed => "postie.delayed → relay → SMTP",
        };
        let s = if self.instances == 1 { "" } else { "es" };
        format!("{} process{s}, {path}", self.instances)
    }
}

/// One pending-backlog size in ladder mode.
struct Backlog {
    pending: usize,
    parked_s: f64,
    mem_before: u64,
    mem_pending: u64,
    lateness: Lateness,
}

/// One round: the four legs, then end to end right after them, the send path and
/// the delayed path with 1 and 3 processes each ([`ROUND_RUNS`]), so that every
/// ratio compares measurements a minute, not a whole run, apart (this machine's
/// speed drifts by ±20 % over minutes).
struct Round {
    broker: Measured,
    database: Measured,
    smtp: Measured,
    /// intake → confirmed republish into the ladder + pending record, one process.
    relay: Measured,
    /// One per [`ROUND_RUNS`], in that order.
    runs: Vec<EndToEnd>,
}

/// The end-to-end runs of every round, in the order run.
const ROUND_RUNS: [(usize, Entry); 4] = [
    (1, Entry::Send),
    (3, Entry::Send),
    (1, Entry::Delayed),
    (3, Entry::Delayed),
];

impl Round {
    /// 1 / (1/C_broker + 1/C_db + 1/C_smtp): the legs take turns on shared cores.
    fn fair_bound(&self) -> f64 {
        1.0 / (1.0 / self.broker.rate() + 1.0 / self.database.rate() + 1.0 / self.smtp.rate())
    }

    /// The delayed path's bound: the send path's legs and the relay leg taking turns,
    /// 1 / (1/C_broker + 1/C_db + 1/C_smtp + 1/C_relay).
    fn delayed_bound(&self) -> f64 {
        1.0 / (1.0 / self.fair_bound() + 1.0 / self.relay.rate())
    }

    /// The bound `e` is held to.
    fn bound_of(&self, e: &EndToEnd) -> f64 {
        match e.entry {
            Entry::Send => self.fair_bound(),
            Entry::Delayed => self.delayed_bound(),
        }
    }

    /// Run `i`'s emails/s ÷ its bound.
    fn ratio_of(&self, i: usize) -> f64 {
        self.runs[i].run.rate() / self.bound_of(&self.runs[i])
    }

    /// The largest share of the machine's CPU that the hypervisor took during any of
    /// the round's measurements: a leg or a run measured while it did ran on a
    /// slower machine than the rest, so that round's ratios compare unlike things.
    fn stolen(&self) -> f64 {
        [&self.broker, &self.database, &self.smtp, &self.relay]
            .into_iter()
            .chain(self.runs.iter().map(|e| &e.run))
            .map(|m| m.cpu.machine_stolen)
            .fold(0.0, f64::max)
    }
}

struct Report {
    n: usize,
    defaults: Defaults,
    versions: String,
    broker_publish: Measured,
    /// Every round, in the order run.
    rounds: Vec<Round>,
    /// Index of the round with the median 1-process send-path ratio: the detailed
    /// tables show it.
    median: usize,
    sink: Measured,
    backlogs: Vec<Backlog>,
}

impl Report {
    fn shown(&self) -> &Round {
        &self.rounds[self.median]
    }

    fn fair_bound(&self) -> f64 {
        self.shown().fair_bound()
    }

    fn delayed_bound(&self) -> f64 {
        self.shown().delayed_bound()
    }

    fn bound_of(&self, e: &EndToEnd) -> f64 {
        self.shown().bound_of(e)
    }

    /// The runs in the detailed tables: the median round's.
    fn runs(&self) -> impl Iterator<Item = &EndToEnd> {
        self.shown().runs.iter()
    }

    /// Run `i`'s ratio in every round, in the order run, and their median: the
    /// figure to hold a goal to, since one round's ratio moves by ±0.15 here.
    fn ratios(&self, i: usize) -> (Vec<f64>, f64) {
        let all: Vec<f64> = self.rounds.iter().map(|r| r.ratio_of(i)).collect();
        let mut sorted = all.clone();
        sorted.sort_by(f64::total_cmp);
        let mid = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 {
            sorted[mid]
        } else {
            (sorted[mid - 1] + sorted[mid]) / 2.0
        };
        (all, median)
    }
}

/// Job bodies of type `bench`, one user each, so that a throttle on the type
/// (POSTIE_BENCH_POSTIE_ENV=POSTIE__THROTTLE__BENCH__…) does its bookkeeping for every
/// job without ever limiting one.
fn bodies(n: usize, prefix: &str) -> impl Iterator<Item = Vec<u8>> + '_ {
    (0..n).map(move |i| {
        let mut body = job(&format!("{prefix}-{i}"), "bench@example.com");
        body["type"] = "bench".into();
        body["user_id"] = format!("user-{i}").into();
        body.to_string().into_bytes()
    })
}

fn parse_job(body: &[u8], settings: &Settings) -> EmailJob {
    let rules = ParseRules {
        max_body_bytes: settings.worker.max_body_bytes,
        default_from: None,
        key_namespace: postie::config::KeyNamespace::Off,
        user_id: None,
        attachments: postie::testing::contract::AttachmentLimits::DEFAULT,
    };
    EmailJob::parse(body, &rules).expect("a valid job")
}

/// Runs `work(i)` for every i below `n` on `concurrency` tasks.
async fn run_concurrently<F, Fut>(n: usize, concurrency: usize, work: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, work) = (next.clone(), work.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    work(i).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("benchmark task");
    }
}

/// Ready messages in each queue, summed, on one channel.
async fn depth(channel: &Channel, queues: &[impl AsRef<str>]) -> u64 {
    let mut total = 0;
    for queue in queues {
        let options = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.as_ref().into(), options, FieldTable::default())
            .await
            .expect("queue exists");
        total += u64::from(declared.message_count());
    }
    total
}

/// Broker ceiling: a consumer that only acks, prefetch as postie's, on a scratch
/// quorum queue holding `n` persistent jobs. Also times the confirmed publish.
async fn broker_leg(n: usize, prefetch: u16) -> (Measured, Measured) {
    let env = TestEnv::new("benchbroker").await;
    let conn = broker_connection("postie-bench").await;
    let queue = format!("{}.bench.broker", env.prefix);
    let admin = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    admin
        .queue_declare(queue.as_str().into(), durable, args)
        .await
        .unwrap();

    let publisher = broker::confirm_channel(&conn).await.unwrap();
    let before = CpuSnapshot::take();
    publish_bodies(&publisher, "", &queue, bodies(n, "broker")).await;
    let published = Measured::new("broker: confirmed publish (1,000 in flight)", n, &before);

    let channel = conn.create_channel().await.unwrap();
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let before = CpuSnapshot::take();
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "postie-bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..n {
        let delivery = tokio::time::timeout(Duration::from_secs(60), deliveries.next())
            .await
            .expect("a delivery within 60 s")
            .expect("consumer open")
            .expect("delivery");
        assert!(delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap());
    }
    let consumed = Measured::new(
        format!("broker: consume + ack (prefetch {prefetch})"),
        n,
        &before,
    );
    let _ = channel.close(200, "done".into()).await;
    admin
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    (published, consumed)
}

/// Connections of the database leg. Not `database.pool_size`: the leg measures what
/// PostgreSQL can do, and postie's default pool of 8 left it 81 % busy on this
/// machine (5,100-5,300 pairs/s against 5,900-6,500 with 16), which would lower the
/// bound that end to end is held to. 16 was the default pool before it became 8.
const DATABASE_LEG_CONNECTIONS: usize = 16;

/// Database ceiling: postie's claim, then its `sent` completion, for `n` keys, on
/// [`DATABASE_LEG_CONNECTIONS`] connections.
async fn database_leg(n: usize, concurrency: usize) -> Measured {
    let env = TestEnv::new("benchdb").await;
    let mut settings = env.settings();
    settings.database.pool_size = DATABASE_LEG_CONNECTIONS;
    let inbox = Inbox::new(&settings.database.plan().unwrap(), &settings.database).unwrap();
    inbox.migrate().await.unwrap();
    let lease = settings.worker.lease;
    let before = CpuSnapshot::take();
    run_concurrently(n, concurrency, move |i| {
        let inbox = inbox.clone();
        async move {
            let key = format!("db-{i}");
            let Claim::Claimed { fence, .. } = inbox.claim(&key, "bench", lease, 0).await.unwrap()
            else {
                panic!("{key} was not claimable");
            };
            let due = chrono::Utc::now().timestamp_millis();
            let message_id = message_id(&key);
            let sent = Completion::Sent {
                message_id: &message_id,
                due_ms: due,
                provider: "smtp",
                provider_message_id: None,
            };
            assert!(inbox.complete(&key, fence, None, sent).await.unwrap());
        }
    })
    .await;
    Measured::new(
        format!(
            "database: claim + complete (sent) ({concurrency} tasks, {DATABASE_LEG_CONNECTIONS} connections)"
        ),
        n,
        &before,
    )
}

/// SMTP ceiling: parse, build and send through postie's mailer (lettre's pool).
async fn smtp_leg(n: usize, concurrency: usize) -> Measured {
    let env = TestEnv::new("benchsmtp").await;
    let settings = Arc::new(env.settings());
    let mailer = Mailer::new(&settings.transport.one_transport().unwrap(), &settings).unwrap();
    let before = CpuSnapshot::take();
    run_concurrently(n, concurrency, move |i| {
        let (mailer, settings) = (mailer.clone(), settings.clone());
        async move {
            let body = job(&format!("smtp-{i}"), "bench@example.com").to_string();
            let message = mailer
                .build(&parse_job(body.as_bytes(), &settings))
                .await
                .unwrap();
            let slot = mailer.slot().await;
            mailer
                .send(&slot, &message, &Clearance::new())
                .await
                .expect("the sink accepts");
        }
    })
    .await;
    let leg = Measured::new(
        format!("SMTP: lettre pool → sink ({concurrency} tasks)"),
        n,
        &before,
    );
    assert_eq!(env.sink.stats().await.accepted as usize, n);
    leg
}

/// Reads one (possibly multi-line) SMTP reply and checks its code.
async fn expect_reply(reader: &mut BufReader<OwnedReadHalf>, code: &str) {
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.expect("sink reply");
        assert!(
            line.starts_with(code),
            "expected {code}, the sink said {line:?}"
        );
        if line.as_bytes().get(3) != Some(&b'-') {
            return;
        }
    }
}

/// The sink's own ceiling: raw SMTP without lettre on `concurrency` connections,
/// MAIL/RCPT/DATA pipelined, then the body once the 354 is in.
async fn sink_leg(n: usize, concurrency: usize) -> Measured {
    let env = TestEnv::new("benchsink").await;
    let settings = env.settings();
    let mailer = Mailer::new(&settings.transport.one_transport().unwrap(), &settings).unwrap();
    let body = job("sink-0", "bench@example.com").to_string();
    let email = mailer
        .build(&parse_job(body.as_bytes(), &settings))
        .await
        .unwrap();
    let mut data = String::from_utf8(email.formatted().to_vec())
        .unwrap()
        .replace("\r\n.", "\r\n..");
    if !data.ends_with("\r\n") {
        data.push_str("\r\n");
    }
    data.push_str(".\r\n");
    let data = Arc::new(data);
    let addr = env.sink.smtp_addr().to_string();
    let before = CpuSnapshot::take();
    let connections: Vec<_> = (0..concurrency)
        .map(|c| {
            let count = n / concurrency + usize::from(c < n % concurrency);
            let (addr, data) = (addr.clone(), data.clone());
            tokio::spawn(async move {
                let stream = tokio::net::TcpStream::connect(&addr)
                    .await
                    .expect("sink SMTP");
                stream.set_nodelay(true).unwrap();
                let (read, mut write) = stream.into_split();
                let mut reader = BufReader::new(read);
                expect_reply(&mut reader, "220").await;
                write.write_all(b"EHLO bench.example\r\n").await.unwrap();
                expect_reply(&mut reader, "250").await;
                let envelope =
                    b"MAIL FROM:<noreply@shop.example>\r\nRCPT TO:<bench@example.com>\r\nDATA\r\n";
                for _ in 0..count {
                    write.write_all(envelope).await.unwrap();
                    for code in ["250", "250", "354"] {
                        expect_reply(&mut reader, code).await;
                    }
                    write.write_all(data.as_bytes()).await.unwrap();
                    expect_reply(&mut reader, "250").await;
                }
                write.write_all(b"QUIT\r\n").await.unwrap();
                expect_reply(&mut reader, "221").await;
            })
        })
        .collect();
    for connection in connections {
        connection.await.expect("raw SMTP client");
    }
    let leg = Measured::new(
        format!("sink alone: raw pipelined SMTP ({concurrency} connections)"),
        n,
        &before,
    );
    assert_eq!(env.sink.stats().await.accepted as usize, n);
    leg
}

/// The relay alone: `n` jobs pre-published to `<p>.delayed` with a delay long enough
/// that none comes due, then one postie process relays them into the ladder (each a
/// pending record and a confirmed republish); timed from its start until the intake
/// is empty and the ladder holds them all.
async fn relay_leg(n: usize, extra: &[(String, String)]) -> Measured {
    let env = TestEnv::for_bench("benchrelay").await;
    let conn = broker_connection("postie-bench").await;
    let publisher = broker::confirm_channel(&conn).await.unwrap();
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(PENDING_DELAY_MS));
    for chunk in bodies(n, "relay").collect::<Vec<_>>().chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for body in chunk {
            confirms.push(
                publisher
                    .basic_publish(
                        env.topology.delayed_exchange().into(),
                        ROUTING_KEY.into(),
                        Default::default(),
                        body,
                        broker::job_properties().with_headers(headers.clone()),
                    )
                    .await
                    .expect("publish"),
            );
        }
        for confirm in confirms {
            assert!(confirm.await.expect("confirm").is_ack());
        }
    }
    let probe = conn.create_channel().await.unwrap();
    let intake = [env.topology.intake_queue()];
    assert_eq!(depth(&probe, &intake).await as usize, n);
    let DelayLayout::Ladder(ladder) = env.topology.delay() else {
        panic!("the tests run in ladder mode");
    };
    let levels: Vec<String> = (0..ladder.levels())
        .map(|k| env.topology.delay_level(k))
        .collect();
    let extra: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let before = CpuSnapshot::take();
    let started = Instant::now();
    let mut postie = env.spawn_process(&extra);
    loop {
        if depth(&probe, &intake).await == 0 && depth(&probe, &levels).await >= n as u64 {
            break;
        }
        if let Ok(Some(status)) = postie.child.try_wait() {
            panic!("postie exited early ({status}):\n{}", postie.log());
        }
        assert!(
            started.elapsed() < Duration::from_secs(120 + n as u64 / 10),
            "the relay did not park {n} jobs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leg = Measured::new(
        "relay: intake → ladder (+ pending record), 1 process",
        n,
        &before,
    );
    drop(postie);
    let _ = conn.close(200, "done".into()).await;
    leg
}

/// `n` jobs pre-published to `entry`, then drained by `instances` postie processes:
/// timed from their start until the sink has accepted `n` emails.
async fn end_to_end(n: usize, instances: usize, entry: Entry) -> EndToEnd {
    let env = TestEnv::for_bench("bench").await;
    let conn = broker_connection("postie-bench").await;
    let (exchange, queue) = match entry {
        Entry::Send => (env.topology.work_exchange(), env.topology.send_queue()),
        Entry::Delayed => (env.topology.delayed_exchange(), env.topology.intake_queue()),
    };
    let publisher = broker::confirm_channel(&conn).await.unwrap();
    publish_bodies(&publisher, exchange, ROUTING_KEY, bodies(n, "e2e")).await;
    let probe = conn.create_channel().await.unwrap();
    assert_eq!(
        depth(&probe, &[queue]).await as usize,
        n,
        "every job is queued"
    );

    let before = CpuSnapshot::take();
    let started = Instant::now();
    let started_ms = chrono::Utc::now().timestamp_millis();
    let extra = support::bench::extra_postie_env();
    let extra: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut processes: Vec<PostieProcess> =
        (0..instances).map(|_| env.spawn_process(&extra)).collect();
    let timeout = Duration::from_secs(120 + n as u64 / 10);
    loop {
        let accepted = env.sink.stats().await.accepted as usize;
        if accepted >= n {
            break;
        }
        for process in &mut processes {
            if let Ok(Some(status)) = process.child.try_wait() {
                panic!("postie exited early ({status}):\n{}", process.log());
            }
        }
        assert!(
            started.elapsed() < timeout,
            "{accepted} of {n} emails after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Read postie's own accounting before the processes go away.
    let pids: Vec<u32> = processes.iter().map(|p| p.child.id()).collect();
    let postie_cpu_s = pids.iter().map(|&pid| cpu_seconds(pid)).collect();
    let peak_rss_kib = pids.iter().map(|&pid| peak_rss_kib(pid)).collect();
    let run = Measured::new("", n, &before);
    drop(processes);

    let mut ids = BTreeSet::new();
    let mut duplicates = 0;
    let (mut first_ms, mut last_ms) = (i64::MAX, i64::MIN);
    for m in env.sink.messages(false).await {
        first_ms = first_ms.min(m.received_at_ms);
        last_ms = last_ms.max(m.received_at_ms);
        duplicates += usize::from(!ids.insert(m.message_id));
    }
    let lost = (0..n)
        .filter(|i| !ids.contains(&message_id(&format!("e2e-{i}"))))
        .count();
    let _ = conn.close(200, "done".into()).await;
    let mut result = EndToEnd {
        instances,
        entry,
        run,
        postie_cpu_s,
        peak_rss_kib,
        lost,
        duplicates,
        first_email_s: (first_ms - started_ms) as f64 / 1000.0,
        running_rate: n.saturating_sub(1) as f64 * 1000.0 / (last_ms - first_ms).max(1) as f64,
    };
    result.run.label = result.label();
    result
}

/// Ladder mode with `pending` jobs parked for 9 minutes: broker memory before and
/// with them, then the lateness of [`SHORT_JOBS`] jobs due within 5 s.
async fn backlog(pending: usize) -> Backlog {
    let env = TestEnv::for_bench("benchladder").await;
    let mut postie = env.spawn_process(&[]);
    let conn = broker_connection("postie-bench").await;
    let probe = conn.create_channel().await.unwrap();
    let DelayLayout::Ladder(ladder) = env.topology.delay() else {
        panic!("the tests run in ladder mode");
    };
    let levels: Vec<String> = (0..ladder.levels())
        .map(|k| env.topology.delay_level(k))
        .collect();
    let intake = [env.topology.intake_queue()];

    tokio::time::sleep(STATS_REFRESH).await;
    let mem_before = broker_memory().await;
    let started = Instant::now();
    publish_delayed(&env, "pend", std::iter::repeat_n(PENDING_DELAY_MS, pending)).await;
    loop {
        if depth(&probe, &intake).await == 0 && depth(&probe, &levels).await >= pending as u64 {
            break;
        }
        if let Ok(Some(status)) = postie.child.try_wait() {
            panic!("postie exited early ({status}):\n{}", postie.log());
        }
        assert!(
            started.elapsed() < Duration::from_secs(480),
            "the relay did not park {pending} jobs in 8 minutes"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let parked_s = started.elapsed().as_secs_f64();
    tokio::time::sleep(STATS_REFRESH).await;
    let mem_pending = broker_memory().await;

    let step = SHORT_SPREAD_MS / (SHORT_JOBS as i64 - 1);
    let due = publish_delayed(&env, "short", (0..SHORT_JOBS as i64).map(|i| i * step)).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    while (env.sink.stats().await.accepted as usize) < SHORT_JOBS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lateness = Lateness::measure(&due, &env.sink.messages(false).await);
    let _ = conn.close(200, "done".into()).await;
    Backlog {
        pending,
        parked_s,
        mem_before,
        mem_pending,
        lateness,
    }
}

/// 10^3, 10^4, 10^5 while at most `max` (or `max` alone when below 10^3).
fn backlog_sizes(max: usize) -> Vec<usize> {
    let sizes: Vec<usize> = [1_000, 10_000, 100_000]
        .into_iter()
        .filter(|&p| p <= max)
        .collect();
    if sizes.is_empty() {
        vec![max]
    } else {
        sizes
    }
}

async fn versions() -> String {
    let env_db = support::pg_base();
    let (client, connection) =
        tokio_postgres::connect(&format!("{env_db}/postgres"), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL");
    tokio::spawn(connection);
    let show = |name: &'static str| {
        let client = &client;
        async move {
            let row = client
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap();
            row.get::<_, String>(0)
        }
    };
    let pg = show("server_version").await;
    let sync = show("synchronous_commit").await;
    // Only the version: the end-to-end runs (`bench_paths`) need no management API.
    let rabbit = match try_management_api("overview").await {
        Ok(overview) => overview["rabbitmq_version"]
            .as_str()
            .unwrap_or("?")
            .to_string(),
        Err(_) => "? (no management API)".into(),
    };
    format!("RabbitMQ {rabbit}, PostgreSQL {pg} (synchronous_commit = {sync})")
}

/// One round: the four legs, then the end-to-end runs ([`ROUND_RUNS`]); also the
/// broker leg's publish rate.
async fn measure_round(n: usize, defaults: &Defaults) -> (Measured, Round) {
    let (publish, broker) = broker_leg(n, defaults.prefetch).await;
    let database = database_leg(n, defaults.concurrency).await;
    let smtp = smtp_leg(n, defaults.concurrency).await;
    let relay = relay_leg(n, &support::bench::extra_postie_env()).await;
    let mut runs = Vec::new();
    for (instances, entry) in ROUND_RUNS {
        runs.push(end_to_end(n, instances, entry).await);
    }
    let round = Round {
        broker,
        database,
        smtp,
        relay,
        runs,
    };
    (publish, round)
}

async fn run(n: usize, pending_max: usize, rounds: usize) -> Report {
    let defaults = Defaults::read();
    let versions = versions().await;
    let mut broker_publish = None;
    let mut measured = Vec::new();
    for _ in 0..rounds.max(1) {
        let (publish, round) = measure_round(n, &defaults).await;
        broker_publish.get_or_insert(publish);
        measured.push(round);
    }
    let mut order: Vec<usize> = (0..measured.len()).collect();
    order.sort_by(|&a, &b| measured[a].ratio_of(0).total_cmp(&measured[b].ratio_of(0)));
    let median = order[order.len() / 2];
    let sink = sink_leg(n, defaults.concurrency).await;
    let mut backlogs = Vec::new();
    for pending in backlog_sizes(pending_max) {
        backlogs.push(backlog(pending).await);
    }
    Report {
        n,
        defaults,
        versions,
        broker_publish: broker_publish.expect("at least one round"),
        rounds: measured,
        median,
        sink,
        backlogs,
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn markdown(r: &Report) -> String {
    let d = &r.defaults;
    let bound = r.fair_bound();
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "### postie throughput, N = {} emails per run", r.n);
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "postie defaults: worker.concurrency = {}, amqp.prefetch = {}, database.pool_size = {}, \
         transport.pool_size = {}, delay.relay_concurrency = {}, delay.relay_prefetch = {}. Durable: persistent messages, quorum \
         queues. {}. {} cores ({}), CLK_TCK = {}.",
        d.concurrency,
        d.prefetch,
        d.db_pool,
        d.transport_pool,
        d.relay_concurrency,
        d.relay_prefetch,
        r.versions,
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        cpu_model(),
        clock_ticks(),
    );
    let _ = writeln!(w);
    let rounds = r.rounds.len();
    let _ = writeln!(
        w,
        "{rounds} round(s), each: the four legs, then the send path and the delayed path \
         with 1 and 3 processes, each run divided by its bound from that round's legs \
         (in brackets: its pace from the first email, so without start-up). The detailed tables below show the round with the median 1-process send-path \
         ratio (round {}). `stolen` is the most CPU the hypervisor took from this machine \
         during any of a round's measurements (steal in /proc/stat): a round with much of \
         it compares measurements taken on machines of different speeds.",
        r.median + 1
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "| round | C_broker | C_db | C_smtp | C_relay | fair bound | delayed-path bound | send, 1 process | send, 3 | delayed, 1 | delayed, 3 | stolen |");
    let _ = writeln!(
        w,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (i, round) in r.rounds.iter().enumerate() {
        let runs: Vec<String> = (0..ROUND_RUNS.len())
            .map(|k| {
                let e = &round.runs[k];
                format!(
                    "{:.0}/s, **{:.2}** ({:.2})",
                    e.run.rate(),
                    round.ratio_of(k),
                    e.running_rate / round.bound_of(e)
                )
            })
            .collect();
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.0} % |",
            i + 1,
            round.broker.rate(),
            round.database.rate(),
            round.smtp.rate(),
            round.relay.rate(),
            round.fair_bound(),
            round.delayed_bound(),
            runs.join(" | "),
            round.stolen() * 100.0,
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(w, "| end to end ÷ its bound | each round | median |");
    let _ = writeln!(w, "|---|---|---:|");
    for (k, e) in r.runs().enumerate() {
        let (all, median) = r.ratios(k);
        let all: Vec<String> = all.iter().map(|x| format!("{x:.2}")).collect();
        let _ = writeln!(
            w,
            "| {} | {} | **{median:.2}** |",
            e.run.label,
            all.join(" / ")
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(w, "| end to end (pre-published, fresh topology/db/sink) | emails/s | wall | ÷ its bound (send: fair, delayed: delayed-path) | first email after | emails/s from the first email | ÷ its bound | postie CPU/email | postie peak RSS | lost | duplicates |");
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for e in r.runs() {
        let rss: Vec<String> = e
            .peak_rss_kib
            .iter()
            .map(|k| format!("{:.0}", *k as f64 / 1024.0))
            .collect();
        let cpu_s: f64 = e.postie_cpu_s.iter().sum();
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.1} s | {:.2} | {:.2} s | {:.0} | {:.2} | {:.3} ms | {} MiB | {} | {} |",
            e.run.label,
            e.run.rate(),
            e.run.cpu.wall_s,
            e.run.rate() / r.bound_of(e),
            e.first_email_s,
            e.running_rate,
            e.running_rate / r.bound_of(e),
            cpu_s * 1000.0 / e.run.n as f64,
            rss.join(" / "),
            e.lost,
            e.duplicates,
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(w, "| leg, alone | emails/s |");
    let _ = writeln!(w, "|---|---:|");
    let shown = r.shown();
    for leg in [&shown.broker, &shown.database, &shown.smtp] {
        let _ = writeln!(w, "| {} | {:.0} |", leg.label, leg.rate());
    }
    let _ = writeln!(
        w,
        "| **fair bound** 1 / (1/C_broker + 1/C_db + 1/C_smtp) | **{bound:.0}** |"
    );
    let _ = writeln!(w, "| {} | {:.0} |", shown.relay.label, shown.relay.rate());
    let _ = writeln!(
        w,
        "| **delayed-path bound** 1 / (1/C_broker + 1/C_db + 1/C_smtp + 1/C_relay) | **{:.0}** |",
        r.delayed_bound()
    );
    for leg in [&r.sink, &r.broker_publish] {
        let _ = writeln!(
            w,
            "| {} (not in the bound) | {:.0} |",
            leg.label,
            leg.rate()
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "CPU ms per email, by process (from /proc; `other` = the rest of the machine's busy time; \
         `stolen` = the machine's CPU the hypervisor took, in none of the other columns):"
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "| measurement | postie | postgres | rabbitmq | sink | harness | other | all | machine busy | stolen |");
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let all = [
        &shown.broker,
        &shown.database,
        &shown.smtp,
        &r.sink,
        &r.broker_publish,
        &shown.relay,
    ]
    .into_iter()
    .chain(r.runs().map(|e| &e.run));
    for m in all {
        let c = &m.cpu;
        let by: Vec<String> = Who::ALL
            .iter()
            .map(|&who| format!("{:.3}", c.of(who)))
            .collect();
        let _ = writeln!(
            w,
            "| {} | {} | {:.3} | {:.3} | {:.0} % | {:.0} % |",
            m.label,
            by.join(" | "),
            c.other_ms_per_email,
            c.busy_ms_per_email,
            c.machine_busy * 100.0,
            c.machine_stolen * 100.0,
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "Ladder mode, one postie process: P jobs parked for 9 min, then {SHORT_JOBS} jobs due in 0–{} s \
         (lateness = sink arrival − due):",
        SHORT_SPREAD_MS / 1000
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "| pending P | parked in | broker mem before | with P pending | per pending job | lateness p50 | p99 | max | early | lost | duplicates |");
    let _ = writeln!(
        w,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for b in &r.backlogs {
        let l = &b.lateness;
        let per_job = (b.mem_pending as f64 - b.mem_before as f64) / b.pending as f64;
        let _ = writeln!(
            w,
            "| {} | {:.1} s | {:.1} MiB | {:.1} MiB | {:.0} B | {} ms | {} ms | {} ms | {} | {} | {} |",
            b.pending,
            b.parked_s,
            mib(b.mem_before),
            mib(b.mem_pending),
            per_job,
            l.p50_ms,
            l.p99_ms,
            l.max_ms,
            l.early,
            l.lost,
            l.duplicates,
        );
    }
    md
}

fn json(r: &Report) -> serde_json::Value {
    let d = &r.defaults;
    let bound = r.fair_bound();
    let rounds: Vec<_> = r
        .rounds
        .iter()
        .map(|round| {
            let runs: Vec<_> = round
                .runs
                .iter()
                .enumerate()
                .map(|(k, e)| {
                    serde_json::json!({
                        "label": e.run.label,
                        "per_s": round3(e.run.rate()),
                        "ratio_to_its_bound": round3(round.ratio_of(k)),
                    })
                })
                .collect();
            serde_json::json!({
                "c_broker": round3(round.broker.rate()),
                "c_db": round3(round.database.rate()),
                "c_smtp": round3(round.smtp.rate()),
                "c_relay": round3(round.relay.rate()),
                "fair_bound": round3(round.fair_bound()),
                "delayed_bound": round3(round.delayed_bound()),
                "runs": runs,
                "stolen": round3(round.stolen()),
            })
        })
        .collect();
    let runs: Vec<_> = r
        .runs()
        .map(|e| {
            let mut v = e.run.json();
            v["instances"] = e.instances.into();
            v["ratio_to_fair_bound"] = round3(e.run.rate() / bound).into();
            v["ratio_to_its_bound"] = round3(e.run.rate() / r.bound_of(e)).into();
            v["first_email_s"] = round3(e.first_email_s).into();
            v["running_per_s"] = round3(e.running_rate).into();
            v["running_ratio_to_its_bound"] = round3(e.running_rate / r.bound_of(e)).into();
            v["postie_cpu_s"] = e
                .postie_cpu_s
                .iter()
                .map(|s| round3(*s))
                .collect::<Vec<_>>()
                .into();
            v["postie_peak_rss_kib"] = e.peak_rss_kib.clone().into();
            v["lost"] = e.lost.into();
            v["duplicates"] = e.duplicates.into();
            v
        })
        .collect();
    let medians: Vec<_> = r
        .runs()
        .enumerate()
        .map(|(k, e)| {
            let (all, median) = r.ratios(k);
            serde_json::json!({
                "label": e.run.label,
                "ratios": all.into_iter().map(round3).collect::<Vec<_>>(),
                "median": round3(median),
            })
        })
        .collect();
    let backlogs: Vec<_> = r
        .backlogs
        .iter()
        .map(|b| {
            let l = &b.lateness;
            serde_json::json!({
                "pending": b.pending, "parked_s": round3(b.parked_s),
                "broker_mem_used_bytes": {"before": b.mem_before, "pending": b.mem_pending},
                "short_jobs": l.jobs, "short_spread_ms": SHORT_SPREAD_MS,
                "lateness_ms": {"p50": l.p50_ms, "p99": l.p99_ms, "max": l.max_ms},
                "early": l.early, "lost": l.lost, "duplicates": l.duplicates,
            })
        })
        .collect();
    serde_json::json!({
        "n": r.n,
        "defaults": {
            "worker.concurrency": d.concurrency, "amqp.prefetch": d.prefetch,
            "database.pool_size": d.db_pool, "transport.pool_size": d.transport_pool,
            "delay.relay_concurrency": d.relay_concurrency,
            "delay.relay_prefetch": d.relay_prefetch,
        },
        "versions": r.versions,
        "cores": std::thread::available_parallelism().map_or(0, |p| p.get()),
        "cpu_model": cpu_model(),
        "legs": {
            "broker": r.shown().broker.json(), "database": r.shown().database.json(),
            "smtp": r.shown().smtp.json(),
            "sink": r.sink.json(), "broker_publish": r.broker_publish.json(), "relay": r.shown().relay.json(),
        },
        "fair_bound_per_s": round3(bound),
        "delayed_bound_per_s": round3(r.delayed_bound()),
        "rounds": rounds,
        "median_round": r.median + 1,
        "ratio_medians": medians,
        "end_to_end": runs,
        "ladder": backlogs,
    })
}

/// Sanity only: everything sent once, nothing early. No timing thresholds.
fn assert_sane(r: &Report) {
    for round in &r.rounds {
        assert_eq!(round.runs.len(), ROUND_RUNS.len());
        for (k, e) in round.runs.iter().enumerate() {
            assert_eq!((e.lost, e.duplicates), (0, 0), "{}", e.run.label);
            assert!(round.ratio_of(k) > 0.0, "{}", e.run.label);
        }
        assert!(
            round.delayed_bound() > 0.0 && round.relay.n > 0,
            "relay leg measured"
        );
        // Shares of the machine's CPU time: busy and stolen never overlap.
        let c = &round.runs[0].run.cpu;
        assert!(
            (0.0..=1.0).contains(&round.stolen())
                && c.machine_busy + c.machine_stolen <= 1.0 + 1e-9,
            "busy {} + stolen {} of the machine",
            c.machine_busy,
            c.machine_stolen
        );
    }
    for b in &r.backlogs {
        let l = &b.lateness;
        assert_eq!(
            (l.early, l.lost, l.duplicates),
            (0, 0, 0),
            "{} pending",
            b.pending
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_smoke() {
    let report = run(300, 1_000, 1).await;
    println!("{}", markdown(&report));
    assert_sane(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench"]
async fn bench_full() {
    let report = run(
        env_usize("POSTIE_BENCH_N", 20_000),
        env_usize("POSTIE_BENCH_PENDING_MAX", 100_000),
        env_usize("POSTIE_BENCH_ROUNDS", 3),
    )
    .await;
    let md = markdown(&report);
    println!("{md}");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(format!("{dir}/bench.md"), &md).unwrap();
    let json = serde_json::to_string_pretty(&json(&report)).unwrap();
    std::fs::write(format!("{dir}/bench.json"), json).unwrap();
    assert_sane(&report);
}

/// What recording each scheduled job's body (for the reconciler, issue #15) costs the
/// relay: the relay leg with `delay.reconcile` on and off, alternated for
/// POSTIE_BENCH_ROUNDS rounds (default 3) so that the machine's drift hits both.
/// `cargo test --release --locked --test bench -- --ignored --nocapture bench_relay_bodies`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: the relay with and without body recording"]
async fn bench_relay_bodies() {
    let n = env_usize("POSTIE_BENCH_N", 20_000);
    let extra = support::bench::extra_postie_env();
    let mut off = extra.clone();
    off.push(("POSTIE__DELAY__RECONCILE".into(), "false".into()));
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 1..=env_usize("POSTIE_BENCH_ROUNDS", 3) {
        for (bodies, settings, rates) in [(true, &extra, &mut with), (false, &off, &mut without)] {
            let leg = relay_leg(n, settings).await;
            println!(
                "round {round}, bodies recorded {bodies}: {:.0} jobs/s, {:.3} ms CPU/job (postie {:.3}, PostgreSQL {:.3}, RabbitMQ {:.3})",
                leg.rate(),
                leg.cpu.busy_ms_per_email,
                leg.cpu.of(Who::Postie),
                leg.cpu.of(Who::Postgres),
                leg.cpu.of(Who::Rabbitmq),
            );
            rates.push(leg.rate());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (on, off) = (median(&mut with), median(&mut without));
    println!(
        "relay leg, N = {n}, median: bodies recorded {on:.0} jobs/s, not recorded {off:.0} jobs/s ({:+.1} %)",
        100.0 * (on / off - 1.0)
    );
    assert!(on > 0.0 && off > 0.0);
}

/// One side of an A/B comparison (scripts/bench-abba.sh, `make bench-abba`): one round
/// of the legs and the send and delayed paths with 1 and 3 processes, with the postie
/// binary POSTIE_BENCH_BIN names (default: this build's). Prints one line per run and
/// writes emails/s, ÷ its bound and CPU ms per email by process to POSTIE_BENCH_OUT
/// (default target/bench/paths.json). No ladder backlog, no sink leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: one side of scripts/bench-abba.sh"]
async fn bench_paths() {
    let n = env_usize("POSTIE_BENCH_N", 20_000);
    let defaults = Defaults::read();
    let (_, round) = measure_round(n, &defaults).await;
    let runs: Vec<_> = round
        .runs
        .iter()
        .enumerate()
        .map(|(k, e)| {
            let cpu = &e.run.cpu;
            println!(
                "{}: {:.0} emails/s, {:.2} of its bound ({:.0}/s); CPU ms/email postie {:.3}, PostgreSQL {:.3}, RabbitMQ {:.3}",
                e.run.label,
                e.run.rate(),
                round.ratio_of(k),
                round.bound_of(e),
                cpu.of(Who::Postie),
                cpu.of(Who::Postgres),
                cpu.of(Who::Rabbitmq),
            );
            assert_eq!((e.lost, e.duplicates), (0, 0), "{}", e.run.label);
            serde_json::json!({
                "label": e.run.label,
                "instances": e.instances,
                "path": match e.entry { Entry::Send => "send", Entry::Delayed => "delayed" },
                "per_s": round3(e.run.rate()),
                "bound_per_s": round3(round.bound_of(e)),
                "ratio_to_its_bound": round3(round.ratio_of(k)),
                "cpu_ms_per_email": {
                    "postie": round3(cpu.of(Who::Postie)),
                    "postgres": round3(cpu.of(Who::Postgres)),
                    "rabbitmq": round3(cpu.of(Who::Rabbitmq)),
                },
            })
        })
        .collect();
    let report = serde_json::json!({
        "n": n,
        "postie_bin": support::bench::postie_bin(),
        "cpu_model": cpu_model(),
        "cores": std::thread::available_parallelism().map_or(0, |p| p.get()),
        "versions": versions().await,
        "legs_per_s": {
            "broker": round3(round.broker.rate()), "database": round3(round.database.rate()),
            "smtp": round3(round.smtp.rate()), "relay": round3(round.relay.rate()),
        },
        "stolen": round3(round.stolen()),
        "runs": runs,
    });
    let out = std::env::var("POSTIE_BENCH_OUT")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench/paths.json").into());
    if let Some(dir) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report).unwrap()).unwrap();
}
