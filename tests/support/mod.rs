//! Shared test harness: every test gets its own topology prefix, its own database and
//! its own SMTP sink process, and deletes all three when it ends (also on panic).
#![allow(dead_code, unreachable_pub)]

pub mod bench;
pub mod browser;
pub mod cluster;
pub mod db;
pub mod feedback;
pub mod moto;
pub mod providers;
pub mod proxy;
pub mod sink;
pub mod tap;

use std::collections::BTreeMap;
use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use postie::config::Settings;
use postie::testing::broker;
use postie::testing::broker::{Topology, ROUTING_KEY};
use secrecy::SecretString;
use tokio_util::sync::CancellationToken;

#[allow(unused_imports)]
pub use db::Db;
pub use sink::SmtpSink;

/// RabbitMQ for tests (override with POSTIE_TEST_AMQP_URL).
pub fn amqp_url() -> String {
    std::env::var("POSTIE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// RabbitMQ's management HTTP API for tests (override with POSTIE_TEST_MANAGEMENT_URL).
pub fn management_url() -> String {
    std::env::var("POSTIE_TEST_MANAGEMENT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

/// The `host:port` of the test broker's AMQP listener, from [`amqp_url`].
pub fn amqp_host_port() -> String {
    let url = url::Url::parse(&amqp_url()).expect("POSTIE_TEST_AMQP_URL is a URL");
    format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(5672)
    )
}

/// `rabbitmqctl` for the test broker: POSTIE_TEST_RABBITMQCTL names the command and
/// its leading arguments, split on spaces (`make test-rabbitmq-4` sets it to
/// `scripts/rabbitmq-4.sh ctl`); plain `rabbitmqctl` when unset.
pub fn rabbitmqctl_command(args: &[&str]) -> Command {
    let configured = std::env::var("POSTIE_TEST_RABBITMQCTL").unwrap_or_default();
    let mut words = configured.split_whitespace();
    let mut cmd = Command::new(words.next().unwrap_or("rabbitmqctl"));
    cmd.args(words).args(args);
    cmd
}

/// Job properties with `x-delay` = `delay_ms` and `postie-published-at` =
/// `published_ms`, so that the due time is `published_ms + delay_ms` exactly.
pub fn delayed_properties(delay_ms: i64, published_ms: i64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
    headers.insert(
        postie::testing::headers::HEADER_PUBLISHED_AT.into(),
        AMQPValue::LongLongInt(published_ms),
    );
    broker::job_properties().with_headers(headers)
}

/// PostgreSQL server for tests, without a database name (override with POSTIE_TEST_PG).
pub fn pg_base() -> String {
    std::env::var("POSTIE_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// One test's private world.
pub struct TestEnv {
    /// Topology prefix, unique to the test.
    pub prefix: String,
    /// Database name, unique to the test.
    pub db_name: String,
    /// The SMTP sink process.
    pub sink: SmtpSink,
    /// Names of the broker objects.
    pub topology: Topology,
    /// The broker address(es) this world uses (`amqp.url`, a comma-separated list).
    pub amqp_url: String,
    /// Whether dropping deletes the topology (not on a throwaway cluster, where a
    /// delete can wait on a dead node).
    pub delete_topology: bool,
    /// Settings of this world on top of the test defaults (`POSTIE__…` variables),
    /// e.g. lanes, which change the topology.
    extra: Vec<(String, String)>,
    /// The test's own connection and confirm channel, rebuilt after a broker restart.
    amqp: tokio::sync::Mutex<(Connection, Channel)>,
}

impl TestEnv {
    /// Creates the database, starts the sink, declares the topology.
    pub async fn new(name: &str) -> Self {
        Self::on_broker(name, &amqp_url()).await
    }

    /// Like [`TestEnv::new`], on the broker(s) at `amqp_url` (a comma-separated list
    /// of addresses, e.g. a [`cluster::Cluster`]'s).
    pub async fn on_broker(name: &str, amqp_url: &str) -> Self {
        Self::on_broker_with(name, amqp_url, &[]).await
    }

    /// Like [`TestEnv::new`], with `extra` settings (`POSTIE__…` variables) in every
    /// postie of this world and in the topology it declares and deletes.
    pub async fn with_settings(name: &str, extra: &[(&str, &str)]) -> Self {
        Self::on_broker_with(name, &amqp_url(), extra).await
    }

    /// Like [`TestEnv::new`], with a sink started with `sink_args` (e.g.
    /// `["--chunking"]`) instead of the default one.
    pub async fn with_sink(name: &str, sink_args: &[&str]) -> Self {
        let sink = SmtpSink::start_with(sink_args).await;
        Self::build(name, &amqp_url(), &[], sink).await
    }

    /// [`TestEnv::with_sink`] and [`TestEnv::with_settings`] at once.
    pub async fn with_sink_and_settings(
        name: &str,
        sink_args: &[&str],
        extra: &[(&str, &str)],
    ) -> Self {
        let sink = SmtpSink::start_with(sink_args).await;
        Self::build(name, &amqp_url(), extra, sink).await
    }

    /// Like [`TestEnv::new`], with an empty database (every other world's is a copy of
    /// the migrated template): for a test whose postie must migrate it itself, e.g. as
    /// a role that then owns what it creates.
    pub async fn unmigrated(name: &str) -> Self {
        Self::build_in(name, &amqp_url(), &[], SmtpSink::start().await, false).await
    }

    /// For a benchmark whose postie processes are the binary POSTIE_BENCH_BIN names: a
    /// database that binary migrates itself (`postie migrate`, before anything is
    /// timed), so that two revisions with different migrations can be compared
    /// (scripts/bench-abba.sh: a database migrated by the newer one is refused by the
    /// older). Without POSTIE_BENCH_BIN, [`TestEnv::new`].
    pub async fn for_bench(name: &str) -> Self {
        if std::env::var_os("POSTIE_BENCH_BIN").is_none() {
            return Self::new(name).await;
        }
        let env = Self::unmigrated(name).await;
        let out = Command::new(bench::postie_bin())
            .arg("migrate")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env.env_vars())
            .stdin(Stdio::null())
            .output()
            .expect("run postie migrate");
        assert!(
            out.status.success(),
            "postie migrate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        env
    }

    async fn on_broker_with(name: &str, amqp_url: &str, extra: &[(&str, &str)]) -> Self {
        Self::build(name, amqp_url, extra, SmtpSink::start().await).await
    }

    async fn build(name: &str, amqp_url: &str, extra: &[(&str, &str)], sink: SmtpSink) -> Self {
        Self::build_in(name, amqp_url, extra, sink, true).await
    }

    async fn build_in(
        name: &str,
        amqp_url: &str,
        extra: &[(&str, &str)],
        sink: SmtpSink,
        migrated: bool,
    ) -> Self {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
        let prefix = format!("t.{name}.{id}");
        let db_name = format!("postie_t_{}_{id}", name.replace(['-', '.'], "_"));
        if migrated {
            db::create_migrated(&db_name).await;
        } else {
            admin_sql(&format!("CREATE DATABASE {db_name}")).await;
        }
        let extra: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let settings = base_settings(amqp_url, &prefix, &db_name, &sink.smtp_url(), &extra);
        let topology = Topology::new(&settings.topology, &settings.delay, settings.delay.mode);
        let (conn, channel) = test_connection(amqp_url).await;
        topology
            .declare(&conn.create_channel().await.unwrap())
            .await
            .unwrap();
        Self {
            prefix,
            db_name,
            sink,
            topology,
            amqp_url: amqp_url.to_string(),
            delete_topology: true,
            extra,
            amqp: tokio::sync::Mutex::new((conn, channel)),
        }
    }

    /// The confirm channel (and its connection), reconnecting if the broker restarted.
    async fn amqp(&self) -> tokio::sync::MappedMutexGuard<'_, (Connection, Channel)> {
        let mut guard = self.amqp.lock().await;
        if !guard.0.status().connected() || !guard.1.status().connected() {
            *guard = test_connection(&self.amqp_url).await;
        }
        tokio::sync::MutexGuard::map(guard, |g| g)
    }

    /// Settings for a postie in this world: short retry steps and lease.
    pub fn settings(&self) -> Settings {
        base_settings(
            &self.amqp_url,
            &self.prefix,
            &self.db_name,
            &self.sink.smtp_url(),
            &self.extra,
        )
    }

    /// The same settings as environment variables, for a `postie` child process.
    pub fn env_vars(&self) -> Vec<(String, String)> {
        let mut vars = settings_env(
            &self.amqp_url,
            &self.prefix,
            &self.db_name,
            &self.sink.smtp_url(),
        );
        vars.extend(self.extra.iter().cloned());
        vars
    }

    /// Runs `postie serve` in this process until the handle is stopped.
    pub fn serve(&self, settings: Settings) -> Serving {
        let stop = CancellationToken::new();
        let serving = postie::testing::consume::serve(settings, stop.clone());
        // A start-up that fails says why on stderr at once: a test waiting for
        // emails would otherwise time out without a word about the cause.
        let task = tokio::spawn(async move {
            let ended = serving.await;
            if let Err(error) = &ended {
                eprintln!("postie serve (in the test process) ended: {error:#}");
            }
            ended
        });
        Serving {
            stop,
            task: Some(task),
        }
    }

    /// Starts `postie serve` as a separate OS process: this build's binary, or the one
    /// POSTIE_BENCH_BIN names (scripts/bench-abba.sh compares two builds this way; the
    /// file must be called `postie`, which is how the benchmarks find its CPU time).
    pub fn spawn_process(&self, extra_env: &[(&str, &str)]) -> PostieProcess {
        let mut cmd = Command::new(bench::postie_bin());
        cmd.arg("serve")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "warn,postie=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in self.env_vars() {
            cmd.env(k, v);
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn postie serve");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                sink.lock().unwrap().push_str(&line);
                sink.lock().unwrap().push('\n');
            }
        });
        PostieProcess { child, log }
    }

    /// Publishes a job body to the contract exchange (confirmed).
    pub async fn publish(&self, body: &serde_json::Value) {
        self.publish_raw(body.to_string().as_bytes(), broker::job_properties())
            .await;
    }

    /// Publishes raw bytes with the given properties to the contract exchange.
    pub async fn publish_raw(&self, body: &[u8], properties: BasicProperties) {
        let amqp = self.amqp().await;
        broker::publish_confirmed(
            &amqp.1,
            self.topology.delayed_exchange(),
            ROUTING_KEY,
            true,
            body,
            properties,
        )
        .await
        .expect("confirmed publish");
    }

    /// Publishes many job bodies, pipelined, then waits for every confirm.
    pub async fn publish_many(&self, bodies: &[serde_json::Value]) {
        let jobs: Vec<_> = bodies
            .iter()
            .map(|b| (b.clone(), broker::job_properties()))
            .collect();
        self.publish_many_with(&jobs).await;
    }

    /// Like [`TestEnv::publish_many`], each body with its own properties.
    pub async fn publish_many_with(&self, jobs: &[(serde_json::Value, BasicProperties)]) {
        self.publish_many_routed(ROUTING_KEY, jobs).await;
    }

    /// Like [`TestEnv::publish_many_with`], with `routing_key` (a lane's: `email.<lane>`).
    pub async fn publish_many_routed(
        &self,
        routing_key: &str,
        jobs: &[(serde_json::Value, BasicProperties)],
    ) {
        let mut confirms = Vec::with_capacity(jobs.len());
        let amqp = self.amqp().await;
        for (body, properties) in jobs {
            let confirm = amqp
                .1
                .basic_publish(
                    self.topology.delayed_exchange().into(),
                    routing_key.into(),
                    lapin::options::BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.to_string().as_bytes(),
                    properties.clone(),
                )
                .await
                .expect("publish");
            confirms.push(confirm);
        }
        for confirm in confirms {
            let confirmation = confirm.await.expect("confirm");
            assert!(confirmation.is_ack(), "publish nacked");
            assert!(
                confirmation.take_message().is_none(),
                "publish returned unroutable"
            );
        }
    }

    /// Publishes raw bytes straight to a queue (emulates an operator's move).
    pub async fn publish_to_queue(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        let amqp = self.amqp().await;
        broker::publish_confirmed(&amqp.1, "", queue, true, body, properties)
            .await
            .expect("confirmed publish");
    }

    /// Waits up to `timeout` for the sink to hold at least `n` emails.
    pub async fn wait_for_emails(&self, what: &str, n: usize, timeout: Duration) {
        eventually(what, timeout, move || async move {
            (self.sink.count().await >= n).then_some(())
        })
        .await
    }

    /// Waits up to `within` for the sink to hold `count` emails and returns the
    /// seconds it took; on timeout, fails with the end of `postie`'s log, so a stalled
    /// recovery says where it stalled.
    pub async fn emails_or_log(
        &self,
        postie: &PostieProcess,
        what: &str,
        count: usize,
        within: Duration,
    ) -> f64 {
        let from = Instant::now();
        while self.sink.count().await < count {
            if from.elapsed() > within {
                let log = postie.log();
                let tail: Vec<&str> = log.lines().rev().take(200).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "timed out after {within:?} waiting for {what} ({} of {count} emails); \
                     the last lines of postie's log:\n{}",
                    self.sink.count().await,
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        from.elapsed().as_secs_f64()
    }

    /// A passive declare: the queue's counts, or None if it does not exist.
    async fn passive_declare(&self, queue: &str) -> Option<lapin::Queue> {
        let channel = self.amqp().await.0.create_channel().await.unwrap();
        let options = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .ok()?;
        let _ = channel.close(200, "done".into()).await;
        Some(declared)
    }

    /// Ready messages in a queue.
    pub async fn depth(&self, queue: &str) -> u32 {
        self.passive_declare(queue)
            .await
            .expect("queue exists")
            .message_count()
    }

    /// How many consumers a queue has.
    pub async fn consumers(&self, queue: &str) -> u32 {
        self.passive_declare(queue)
            .await
            .expect("queue exists")
            .consumer_count()
    }

    /// Whether a queue exists.
    pub async fn queue_exists(&self, queue: &str) -> bool {
        self.passive_declare(queue).await.is_some()
    }

    /// Deletes a queue (whatever it holds), as an operator would.
    pub async fn delete_queue(&self, queue: &str) {
        let channel = self.amqp().await.0.create_channel().await.unwrap();
        channel
            .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
            .await
            .expect("queue deleted");
        let _ = channel.close(200, "done".into()).await;
    }

    /// Takes every message out of the dead-letter queue.
    pub async fn take_dead_letters(&self) -> Vec<DeadLetter> {
        let channel = self.amqp().await.0.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(msg) = channel
            .basic_get(
                self.topology.dead_queue().into(),
                BasicGetOptions::default(),
            )
            .await
            .unwrap()
        {
            let delivery = msg.delivery;
            let headers = delivery.properties.headers().clone().unwrap_or_default();
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            out.push(DeadLetter {
                body: delivery.data.clone(),
                properties: delivery.properties.clone(),
                headers: headers_as_text(&headers),
            });
        }
        out
    }

    /// Waits (up to `timeout`) until the inbox row of `key` has `status`.
    pub async fn wait_for_status(&self, key: &str, status: &str, timeout: Duration) {
        eventually(&format!("{key} {status}"), timeout, || async {
            self.inbox_row(key)
                .await
                .filter(|r| r.status == status)
                .map(|_| ())
        })
        .await;
    }

    /// One inbox row; `None` also before postie has created the table.
    pub async fn inbox_row(&self, key: &str) -> Option<InboxRow> {
        let client = self.db().await;
        client
            .query_opt(
                "SELECT status, attempts, duplicates, takeovers, last_error FROM postie_inbox WHERE key = $1",
                &[&key],
            )
            .await
            .ok()
            .flatten()
            .map(|r| InboxRow {
                status: r.get(0),
                attempts: r.get(1),
                duplicates: r.get(2),
                takeovers: r.get(3),
                last_error: r.get(4),
            })
    }

    /// Arrival times (Unix ms) of the emails the sink received, per Message-ID.
    pub async fn arrivals(&self) -> BTreeMap<String, Vec<i64>> {
        let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for m in self.sink.messages(false).await {
            out.entry(m.message_id).or_default().push(m.received_at_ms);
        }
        out
    }

    /// Emails the sink received, per Message-ID.
    pub async fn emails_per_id(&self) -> BTreeMap<String, usize> {
        self.arrivals()
            .await
            .into_iter()
            .map(|(id, at)| (id, at.len()))
            .collect()
    }

    /// Runs `postie ARGS` against this world; stdout, or stderr as the error.
    pub fn postie(&self, args: &[&str]) -> Result<String, String> {
        let run = run_postie(args, &self.env_vars());
        if run.code == Some(0) {
            Ok(run.stdout)
        } else {
            Err(run.stderr)
        }
    }

    /// A plain connection to the test database.
    pub async fn db(&self) -> tokio_postgres::Client {
        pg_admin(&self.db_name).await
    }

    /// Message-IDs of the jobs whose claim was taken over (the known duplicate
    /// window: the previous owner may have sent them).
    pub async fn taken_over_ids(&self) -> std::collections::BTreeSet<String> {
        self.db()
            .await
            .query("SELECT key FROM postie_inbox WHERE takeovers > 0", &[])
            .await
            .expect("taken-over keys")
            .iter()
            .map(|r| message_id(r.get(0)))
            .collect()
    }

    /// Lease takeovers recorded in the inbox, in all.
    pub async fn takeovers(&self) -> i64 {
        self.db()
            .await
            .query_one(
                "SELECT coalesce(sum(takeovers), 0)::bigint FROM postie_inbox",
                &[],
            )
            .await
            .expect("takeover count")
            .get(0)
    }

    /// Inbox rows matching `condition` (an SQL boolean expression).
    pub async fn inbox_count(&self, condition: &str) -> i64 {
        self.db()
            .await
            .query_one(
                &format!("SELECT count(*) FROM postie_inbox WHERE {condition}"),
                &[],
            )
            .await
            .unwrap_or_else(|e| panic!("counting inbox rows where {condition}: {e}"))
            .get(0)
    }

    /// The raw email the sink received for job `key` (its Message-ID).
    pub async fn email_of(&self, key: &str) -> String {
        let id = message_id(key);
        let messages = self.sink.messages(true).await;
        let found = messages.into_iter().find(|m| m.message_id == id);
        found
            .and_then(|m| m.raw)
            .unwrap_or_else(|| panic!("no email for {key}"))
    }

    /// The readable reasons of every dead letter (taken off the queue).
    pub async fn dead_reasons(&self) -> Vec<String> {
        self.take_dead_letters()
            .await
            .iter()
            .map(|d| d.reason().to_string())
            .collect()
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let topology = self.topology.clone();
        let db_name = self.db_name.clone();
        let amqp_url = self.amqp_url.clone();
        let delete_topology = self.delete_topology;
        // Async clean-up from a sync Drop: a throwaway runtime on its own thread.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let connected = if delete_topology {
                    broker::connect(
                        &postie::config::AmqpAddresses::parse(&SecretString::from(amqp_url))
                            .unwrap(),
                        "postie-test-cleanup",
                        Duration::from_secs(10),
                    )
                    .await
                    .map(|c| c.connection)
                    .ok()
                } else {
                    None
                };
                if let Some(conn) = connected {
                    if let Ok(channel) = conn.create_channel().await {
                        let _ = topology.delete(&channel).await;
                    }
                    let _ = conn.close(200, "bye".into()).await;
                }
                admin_sql(&format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)")).await;
            })
        })
        .join();
        if done.is_err() {
            eprintln!("test clean-up failed for {}", self.prefix);
        }
    }
}

/// An in-process `postie serve`.
pub struct Serving {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Serving {
    /// Asks it to stop and waits (it must exit cleanly).
    pub async fn stop(mut self) {
        self.stop.cancel();
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("serve stops within 60 s")
            .expect("serve task did not panic")
            .expect("serve returned Ok");
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        // On a test failure: stop it before the environment deletes its topology, or
        // a start-up still in progress would declare the queues again.
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A `postie serve` child process, killed when dropped.
pub struct PostieProcess {
    /// The child.
    pub child: Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl PostieProcess {
    /// Everything it wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGKILL, no goodbye.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to `within` for the exit status.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for PostieProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A dead letter as the tests see it.
pub struct DeadLetter {
    /// Body.
    pub body: Vec<u8>,
    /// Properties.
    pub properties: BasicProperties,
    /// Headers rendered as text.
    pub headers: BTreeMap<String, String>,
}

impl DeadLetter {
    /// The `postie-dead-reason` header.
    pub fn reason(&self) -> &str {
        self.headers
            .get(postie::testing::headers::HEADER_DEAD_REASON)
            .map(String::as_str)
            .unwrap_or("")
    }
}

/// An inbox row.
#[derive(Debug)]
pub struct InboxRow {
    /// Status.
    pub status: String,
    /// SMTP attempts.
    pub attempts: i32,
    /// Suppressed duplicates.
    pub duplicates: i32,
    /// Leases taken over.
    pub takeovers: i32,
    /// Last error.
    pub last_error: Option<String>,
}

/// A connection for the test itself, with a confirm channel.
async fn test_connection(amqp_url: &str) -> (Connection, Channel) {
    let conn = broker::connect(
        &postie::config::AmqpAddresses::parse(&SecretString::from(amqp_url.to_string())).unwrap(),
        "postie-test",
        Duration::from_secs(10),
    )
    .await
    .map(|c| c.connection)
    .expect("RabbitMQ for tests");
    let channel = broker::confirm_channel(&conn).await.unwrap();
    (conn, channel)
}

/// Restarts the machine's PostgreSQL cluster (outage tests); true if it came back.
pub fn restart_postgres() -> bool {
    let cluster = std::fs::read_dir("/etc/postgresql")
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            cluster.to_str().unwrap(),
            "main",
            "restart",
        ])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The Message-ID postie gives every email of `key` (test settings' domain).
pub fn message_id(key: &str) -> String {
    postie::testing::contract::IdempotencyKey::parse(key)
        .unwrap()
        .message_id("postie.local")
}

/// What a finished `postie` command said.
pub struct PostieRun {
    /// Exit code (None if killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `postie ARGS` with exactly `env` (plus PATH), waiting at most 60 s.
pub fn run_postie(args: &[&str], env: &[(String, String)]) -> PostieRun {
    let mut child = Command::new(env!("CARGO_BIN_EXE_postie"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn postie");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("postie {args:?} did not exit within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    PostieRun {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A port nobody listens on right now (for an HTTP endpoint under test).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `check` every 100 ms until it returns `Some`, or panics after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A valid job body for `key` to `to`.
pub fn job(key: &str, to: &str) -> serde_json::Value {
    serde_json::json!({
        "key": key,
        "from": "Shop <noreply@shop.example>",
        "to": [to],
        "subject": format!("About {key}"),
        "text": format!("Hello about {key}"),
    })
}

fn base_settings(
    amqp_url: &str,
    prefix: &str,
    db_name: &str,
    smtp_url: &str,
    extra: &[(String, String)],
) -> Settings {
    // Through the same environment parsing a deployment uses, minus the process env.
    let vars = settings_env(amqp_url, prefix, db_name, smtp_url)
        .into_iter()
        .chain(extra.iter().cloned())
        .collect();
    Settings::load_from(None, Some(vars)).expect("test settings are valid")
}

/// Test settings as `POSTIE__…` variables: short retry steps and lease.
fn settings_env(
    amqp_url: &str,
    prefix: &str,
    db_name: &str,
    smtp_url: &str,
) -> Vec<(String, String)> {
    [
        ("POSTIE__AMQP__URL", amqp_url.to_string()),
        ("POSTIE__DATABASE__URL", format!("{}/{db_name}", pg_base())),
        ("POSTIE__DATABASE__CONNECT_TIMEOUT", "2s".into()),
        ("POSTIE__TRANSPORT__URL", smtp_url.to_string()),
        ("POSTIE__TRANSPORT__TIMEOUT", "2s".into()),
        ("POSTIE__TOPOLOGY__PREFIX", prefix.to_string()),
        ("POSTIE__TOPOLOGY__RETRY_STEPS", "1s,2s,5s".into()),
        ("POSTIE__WORKER__LEASE", "5s".into()),
        ("POSTIE__WORKER__OUTAGE_BACKOFF_MAX", "1s".into()),
        ("POSTIE__HTTP__LISTEN", "".into()),
        ("POSTIE__DELAY__MODE", "ladder".into()),
        ("POSTIE__DELAY__RESOLUTION", "100ms".into()),
        ("POSTIE__DELAY__MAX", "10m".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn headers_as_text(headers: &FieldTable) -> BTreeMap<String, String> {
    headers
        .inner()
        .iter()
        .map(|(k, v)| {
            let text = match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                other => postie::testing::headers::header_text(Some(headers), k.as_str())
                    .unwrap_or_else(|| format!("{other:?}")),
            };
            (k.as_str().to_string(), text)
        })
        .collect()
}

/// A plain connection to `url` (no TLS), its driver spawned.
pub async fn connect_pg(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL for tests at {url}: {e:?}"));
    tokio::spawn(connection);
    client
}

/// GET `url`: the status and the body; `(0, "")` if nothing answered.
pub async fn http_get(url: &str) -> (u16, String) {
    match reqwest::get(url).await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(_) => (0, String::new()),
    }
}

/// Runs `clean_up` to its end on a throwaway runtime of its own thread: async
/// clean-up from a sync `Drop`, which runs inside the test's runtime.
pub fn on_own_thread(clean_up: impl Future<Output = ()> + Send + 'static) {
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(clean_up)
    })
    .join();
    if done.is_err() {
        eprintln!("a test clean-up failed");
    }
}

/// A superuser connection to database `db` of the test server.
pub async fn pg_admin(db: &str) -> tokio_postgres::Client {
    connect_pg(&format!("{}/{db}", pg_base())).await
}

/// Runs `sql` as the superuser in database `db`.
pub async fn admin_sql_in(db: &str, sql: &str) {
    pg_admin(db)
        .await
        .batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn admin_sql(sql: &str) {
    admin_sql_in("postgres", sql).await;
}

/// The value of one sample line (no labels) in a Prometheus text exposition, e.g.
/// `postie_emails_sent_total`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}
