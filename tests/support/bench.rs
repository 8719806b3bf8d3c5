//! Shared pieces of the benchmarks (`tests/bench.rs`, `tests/bench_delay.rs`): knobs
//! from the environment, RabbitMQ's memory, delayed and pipelined publishing,
//! lateness statistics, and CPU and memory accounting read from `/proc`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, PublisherConfirm};
use postie::testing::broker;
use postie::testing::contract::IdempotencyKey;
use postie::testing::headers::HEADER_PUBLISHED_AT;
use secrecy::SecretString;

use super::sink::SinkMessage;
use super::{amqp_url, job, TestEnv};

/// The machine's CPU model, from `/proc/cpuinfo` (`model name`, else `?`): figures from
/// an AMD EPYC and an Intel Xeon differ, so every report names its machine.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, model)| model.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "?".into())
}

/// The postie binary the benchmarks run: POSTIE_BENCH_BIN (a file named `postie`,
/// whose processes [`CpuSnapshot`] finds by that name), else this build's.
pub fn postie_bin() -> String {
    std::env::var("POSTIE_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_postie").into())
}

/// A size knob from the environment, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A GET on RabbitMQ's management API (guest/guest), as JSON.
pub async fn management_api(path: &str) -> serde_json::Value {
    try_management_api(path).await.expect("management API")
}

/// The same, or the error when the management API does not answer (the plugin off).
pub async fn try_management_api(path: &str) -> reqwest::Result<serde_json::Value> {
    reqwest::Client::new()
        .get(format!("{}/api/{path}", super::management_url()))
        .basic_auth("guest", Some("guest"))
        .send()
        .await?
        .json()
        .await
}

/// RabbitMQ's `mem_used` (bytes) from the management API.
pub async fn broker_memory() -> u64 {
    management_api("nodes").await[0]["mem_used"]
        .as_u64()
        .unwrap_or(0)
}

/// A connection of the benchmark's own to the test broker.
pub async fn broker_connection(name: &str) -> Connection {
    broker::connect(
        &postie::config::AmqpAddresses::parse(&SecretString::from(amqp_url())).unwrap(),
        name,
        Duration::from_secs(10),
    )
    .await
    .map(|c| c.connection)
    .expect("RabbitMQ for benchmarks")
}

/// Publishes every body (persistent JSON) on a confirm channel, 1,000 at a time
/// in flight, and waits for all confirms.
pub async fn publish_bodies(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    bodies: impl Iterator<Item = Vec<u8>>,
) {
    let mut confirms = Vec::with_capacity(1000);
    for body in bodies {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                &body,
                broker::job_properties(),
            )
            .await
            .expect("publish");
        confirms.push(confirm);
        if confirms.len() == 1000 {
            await_confirms(&mut confirms).await;
        }
    }
    await_confirms(&mut confirms).await;
}

async fn await_confirms(confirms: &mut Vec<PublisherConfirm>) {
    for confirm in confirms.drain(..) {
        assert!(confirm.await.expect("confirm").is_ack(), "publish nacked");
    }
}

/// Publishes one job per delay to the contract exchange, each stamped with
/// `postie-published-at`; returns the due time (Unix ms) per Message-ID.
pub async fn publish_delayed(
    env: &TestEnv,
    prefix: &str,
    delays: impl Iterator<Item = i64>,
) -> BTreeMap<String, i64> {
    let mut due = BTreeMap::new();
    let mut batch = Vec::new();
    for (i, delay) in delays.enumerate() {
        let key = format!("{prefix}-{i}");
        let published = chrono::Utc::now().timestamp_millis();
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay));
        headers.insert(
            HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(published),
        );
        batch.push((
            job(&key, "bench@example.com"),
            broker::job_properties().with_headers(headers),
        ));
        due.insert(message_id(&key), published + delay);
        if batch.len() == 1000 {
            env.publish_many_with(&batch).await;
            batch.clear();
        }
    }
    env.publish_many_with(&batch).await;
    due
}

/// The Message-ID postie gives the email for `key` (test settings' domain).
pub fn message_id(key: &str) -> String {
    IdempotencyKey::parse(key)
        .unwrap()
        .message_id("postie.local")
}

/// How late the emails arrived relative to their due times.
#[derive(Debug, Clone, Default)]
pub struct Lateness {
    /// Jobs expected.
    pub jobs: usize,
    /// Median lateness of the first arrival per job, ms.
    pub p50_ms: i64,
    /// 99th percentile, ms.
    pub p99_ms: i64,
    /// Largest, ms.
    pub max_ms: i64,
    /// First arrivals before the due time.
    pub early: usize,
    /// Jobs that never arrived.
    pub lost: usize,
    /// Arrivals beyond the first per job.
    pub duplicates: usize,
}

impl Lateness {
    /// Compares arrivals (sink `received_at_ms`) with `due` (per Message-ID).
    pub fn measure(due: &BTreeMap<String, i64>, received: &[SinkMessage]) -> Self {
        let mut arrivals: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for m in received {
            arrivals
                .entry(m.message_id.as_str())
                .or_default()
                .push(m.received_at_ms);
        }
        let mut report = Self {
            jobs: due.len(),
            ..Self::default()
        };
        let mut lateness = Vec::with_capacity(due.len());
        for (id, due_ms) in due {
            match arrivals.get(id.as_str()) {
                None => report.lost += 1,
                Some(times) => {
                    report.duplicates += times.len() - 1;
                    let late = times.iter().min().unwrap() - due_ms;
                    report.early += usize::from(late < 0);
                    lateness.push(late);
                }
            }
        }
        lateness.sort_unstable();
        if let Some(&max) = lateness.last() {
            let pct = |p: f64| lateness[((lateness.len() as f64 - 1.0) * p).round() as usize];
            (report.p50_ms, report.p99_ms, report.max_ms) = (pct(0.5), pct(0.99), max);
        }
        report
    }
}

/// Who a process's CPU time is counted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Who {
    /// This test process (publishers, probes, the legs' clients).
    Harness,
    /// `postie` processes this test started.
    Postie,
    /// PostgreSQL (every `postgres` process: backends, WAL writer, …).
    Postgres,
    /// RabbitMQ (`beam.smp`).
    Rabbitmq,
    /// The SMTP sink this test started.
    Sink,
}

impl Who {
    /// Every group, in report order.
    pub const ALL: [Who; 5] = [
        Who::Postie,
        Who::Postgres,
        Who::Rabbitmq,
        Who::Sink,
        Who::Harness,
    ];

    /// A short label.
    pub fn name(self) -> &'static str {
        match self {
            Who::Harness => "harness",
            Who::Postie => "postie",
            Who::Postgres => "postgres",
            Who::Rabbitmq => "rabbitmq",
            Who::Sink => "sink",
        }
    }
}

/// One process as `/proc/<pid>/stat` shows it.
struct ProcStat {
    comm: String,
    ppid: u32,
    /// utime + stime, in clock ticks.
    ticks: u64,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    Some(ProcStat {
        comm: text[open + 1..close].to_string(),
        ppid: fields.get(1)?.parse().ok()?,
        ticks: fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?,
    })
}

/// CPU time (utime + stime) of one process, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    proc_stat(pid).map_or(0.0, |s| s.ticks as f64 / clock_ticks() as f64)
}

/// Peak resident set (`VmHWM`) of one process, in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:"))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Clock ticks per second (`getconf CLK_TCK`, else 100).
pub fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// The machine's CPU ticks since boot, summed over its cores.
struct MachineTicks {
    /// Spent working: user, nice, system, irq, softirq.
    busy: u64,
    /// Taken by the hypervisor for other guests while this one wanted to run.
    steal: u64,
    /// Everything, idle included.
    total: u64,
}

/// The machine's busy, stolen and total ticks, from the first line of `/proc/stat`.
fn machine_ticks() -> MachineTicks {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let values: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let at = |i: usize| values.get(i).copied().unwrap_or(0);
    let total: u64 = values.iter().take(8).sum();
    MachineTicks {
        busy: total - at(3) - at(4) - at(7),
        steal: at(7),
        total,
    }
}

/// CPU ticks per process (grouped by [`Who`]) and for the whole machine, at one instant.
pub struct CpuSnapshot {
    at: Instant,
    procs: BTreeMap<u32, (Who, u64)>,
    machine: MachineTicks,
}

impl CpuSnapshot {
    /// Reads every process in `/proc` that belongs to a group.
    pub fn take() -> Self {
        let me = std::process::id();
        let mut procs = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Some(stat) = proc_stat(pid) else { continue };
            let who = match stat.comm.as_str() {
                _ if pid == me => Who::Harness,
                "postie" if stat.ppid == me => Who::Postie,
                // comm is cut at 15 characters.
                "postie-smtp-sin" if stat.ppid == me => Who::Sink,
                "postgres" => Who::Postgres,
                "beam.smp" => Who::Rabbitmq,
                _ => continue,
            };
            procs.insert(pid, (who, stat.ticks));
        }
        Self {
            at: Instant::now(),
            procs,
            machine: machine_ticks(),
        }
    }

    /// What was used between `self` and `later`, spread over `emails`.
    pub fn until(&self, later: &CpuSnapshot, emails: usize) -> CpuUse {
        let tick_ms = 1000.0 / clock_ticks() as f64;
        let mut by_who: BTreeMap<Who, f64> = Who::ALL.iter().map(|&w| (w, 0.0)).collect();
        for (pid, (who, ticks)) in &later.procs {
            let before = match self.procs.get(pid) {
                Some((was, t)) if was == who => *t,
                _ => 0,
            };
            *by_who.get_mut(who).unwrap() += ticks.saturating_sub(before) as f64 * tick_ms;
        }
        let (was, is) = (&self.machine, &later.machine);
        let busy_ticks = is.busy.saturating_sub(was.busy) as f64;
        let busy_ms = busy_ticks * tick_ms;
        let total = is.total.saturating_sub(was.total).max(1) as f64;
        let emails = emails.max(1) as f64;
        let grouped: f64 = by_who.values().sum();
        CpuUse {
            wall_s: later.at.duration_since(self.at).as_secs_f64(),
            ms_per_email: by_who.into_iter().map(|(w, ms)| (w, ms / emails)).collect(),
            other_ms_per_email: (busy_ms - grouped).max(0.0) / emails,
            busy_ms_per_email: busy_ms / emails,
            machine_busy: busy_ticks / total,
            machine_stolen: is.steal.saturating_sub(was.steal) as f64 / total,
        }
    }
}

/// CPU used during one measurement.
#[derive(Debug, Clone)]
pub struct CpuUse {
    /// Wall time between the snapshots, s.
    pub wall_s: f64,
    /// CPU ms per email, by group.
    pub ms_per_email: BTreeMap<Who, f64>,
    /// CPU ms per email spent outside the groups (kernel threads, other processes).
    pub other_ms_per_email: f64,
    /// All CPU ms per email on the machine.
    pub busy_ms_per_email: f64,
    /// Fraction of the machine's CPU time that was busy (1.0 = every core).
    pub machine_busy: f64,
    /// Fraction of the machine's CPU time the hypervisor gave to other guests while
    /// this one had work (`steal` in /proc/stat). Not in `machine_busy` nor in any
    /// ms per email; a measurement with much of it ran on a slower machine.
    pub machine_stolen: f64,
}

impl CpuUse {
    /// CPU ms per email of one group.
    pub fn of(&self, who: Who) -> f64 {
        self.ms_per_email.get(&who).copied().unwrap_or(0.0)
    }

    /// As JSON.
    pub fn json(&self) -> serde_json::Value {
        let mut by: serde_json::Map<String, serde_json::Value> = self
            .ms_per_email
            .iter()
            .map(|(w, ms)| (w.name().to_string(), round3(*ms).into()))
            .collect();
        by.insert("other".into(), round3(self.other_ms_per_email).into());
        serde_json::json!({
            "wall_s": round3(self.wall_s),
            "cpu_ms_per_email": by,
            "cpu_ms_per_email_all": round3(self.busy_ms_per_email),
            "machine_busy": round3(self.machine_busy),
            "machine_stolen": round3(self.machine_stolen),
        })
    }
}

/// Rounds to three decimals (for JSON).
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Extra settings for the benchmarked postie processes, from POSTIE_BENCH_POSTIE_ENV
/// (`KEY=VALUE,KEY=VALUE`), e.g. `POSTIE__DELAY__TRACK_PENDING=false` to measure what
/// pending visibility costs.
pub fn extra_postie_env() -> Vec<(String, String)> {
    std::env::var("POSTIE_BENCH_POSTIE_ENV")
        .unwrap_or_default()
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}
