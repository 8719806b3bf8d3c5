//! Client for the `postie-smtp-sink` process: find or build it, start it, read what
//! it received, tell it which faults to inject, and switch its quota mode.
//!
//! The sink is its own workspace crate (tests/smtp-sink), so Cargo does not build it
//! for postie's tests and `CARGO_BIN_EXE_postie-smtp-sink` does not exist: the tests
//! build it themselves, once per test process, with [`binary`]. `tests/smtp_sink.rs`
//! includes this file too (`#[path]`).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// One message the sink accepted.
#[derive(Debug, Clone, Deserialize)]
pub struct SinkMessage {
    /// Arrival order.
    pub seq: u64,
    /// The Message-ID header.
    pub message_id: String,
    /// Envelope sender.
    pub mail_from: String,
    /// Envelope recipients.
    pub rcpt_to: Vec<String>,
    /// Subject header.
    pub subject: String,
    /// Arrival time, Unix ms.
    pub received_at_ms: i64,
    /// The raw message (only when asked for).
    #[serde(default)]
    pub raw: Option<String>,
    /// It came in `BDAT` chunks, not after `DATA` (a sink started with `--chunking`).
    #[serde(default)]
    pub chunked: bool,
    /// Its size in bytes (after dot-unstuffing).
    #[serde(default)]
    pub size: usize,
}

/// The sink's counters (`GET /stats`).
#[derive(Debug, Clone, Deserialize)]
pub struct SinkStats {
    /// Messages recorded.
    pub accepted: u64,
    /// SMTP connections accepted.
    pub connections: u64,
    /// Sessions hung by a `{"hang": true}` fault.
    #[serde(default)]
    pub hung: u64,
}

/// The `postie-smtp-sink` executable, built on first use.
///
/// `POSTIE_SMTP_SINK=/path/to/postie-smtp-sink` uses that file instead. Otherwise this
/// runs `cargo build -p postie-smtp-sink` (with `$CARGO`, as Cargo sets it for tests;
/// `--release` when this test binary is optimised, so both come from one profile) and
/// takes the executable's path from Cargo's JSON artifact messages rather than
/// guessing the target directory's layout. Cargo leaves the build once it is done
/// (a no-op build takes a fraction of a second).
///
/// The nested build uses the same target directory as the `cargo test` that runs
/// us. That does not deadlock: `cargo test` releases the target directory's lock once
/// the test binaries are built, before it runs them. Checked with cargo 1.95: after a
/// change to the sink's sources, `cargo test --test smtp_sink` rebuilt the sink from
/// inside the tests and passed. (Were that ever to block, a separate `--target-dir`,
/// e.g. target/sink, would avoid the lock at the cost of a second copy of the deps.)
pub fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| match std::env::var_os("POSTIE_SMTP_SINK") {
        Some(path) => PathBuf::from(path),
        None => build_binary("postie-smtp-sink"),
    })
}

/// Builds the workspace binary `package` (of the package of that name) with Cargo, as
/// [`binary`] says, and returns the path of its executable.
pub fn build_binary(package: &str) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "build",
        "--locked",
        "-p",
        package,
        "--bin",
        package,
        "--message-format=json-render-diagnostics",
    ]);
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run cargo to build {package}: {e}"));
    assert!(
        out.status.success(),
        "cargo build -p {package} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // One JSON object per line; the binary's "compiler-artifact" names the executable.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|msg| msg["reason"] == "compiler-artifact")
        .filter(|msg| msg["target"]["name"] == package)
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reported the {package} executable"))
}

/// The reply of a sink in quota mode to a message over the quota (Amazon SES's words).
pub const THROTTLE_REPLY: &str = "454 4.7.0 Throttling failure: Maximum sending rate exceeded.";

/// The sink's quota mode and its counters (`GET /quota`).
#[derive(Debug, Clone, Deserialize)]
pub struct SinkQuota {
    /// Messages accepted per one-second window; `None` when quota mode is off.
    pub per_second: Option<u32>,
    /// The reply to a message over the quota.
    pub reply: String,
    /// Messages recorded (quota mode or not).
    pub accepted: u64,
    /// Messages refused because they were over the quota.
    pub throttled: u64,
    /// Recorded messages by wall-clock second, oldest first (seconds with none left out).
    pub accepted_per_second: Vec<SecondCount>,
}

/// Messages the sink recorded in one wall-clock second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct SecondCount {
    /// Unix time in seconds.
    pub second: i64,
    /// Messages recorded in that second.
    pub accepted: u64,
}

impl SinkQuota {
    /// Most messages recorded in one wall-clock second (0 if none). For the busiest
    /// sliding 1,000 ms, see [`busiest_window`] over the messages' arrival times.
    pub fn busiest_second(&self) -> u64 {
        self.accepted_per_second
            .iter()
            .map(|s| s.accepted)
            .max()
            .unwrap_or(0)
    }
}

/// Most messages received within any 1,000 ms (a sliding window over `received_at_ms`).
pub fn busiest_window(messages: &[SinkMessage]) -> usize {
    let mut times: Vec<i64> = messages.iter().map(|m| m.received_at_ms).collect();
    times.sort_unstable();
    let mut busiest = 0;
    let mut start = 0;
    for (end, &t) in times.iter().enumerate() {
        while times[start] <= t - 1000 {
            start += 1;
        }
        busiest = busiest.max(end - start + 1);
    }
    busiest
}

/// A running sink process, killed on drop.
pub struct SmtpSink {
    child: Child,
    smtp: String,
    control: String,
    http: reqwest::Client,
}

impl SmtpSink {
    /// Starts a sink on ephemeral ports, with the arguments `POSTIE_TEST_SINK_ARGS`
    /// gives (none by default; `--chunking` runs a test, or a benchmark, against a
    /// relay that takes BDAT).
    pub async fn start() -> Self {
        let args = std::env::var("POSTIE_TEST_SINK_ARGS").unwrap_or_default();
        Self::start_with(&args.split_whitespace().collect::<Vec<_>>()).await
    }

    /// Starts a sink on ephemeral ports with extra arguments, e.g.
    /// `["--quota-per-second", "40"]`.
    pub async fn start_with(args: &[&str]) -> Self {
        let mut child = Command::new(binary())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn postie-smtp-sink");
        let stdout = child.stdout.take().unwrap();
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map(|_| line)
        })
        .await
        .unwrap()
        .expect("sink announces its ports");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("sink line {line:?} has no {name}="))
                .to_string()
        };
        Self {
            smtp: field("smtp"),
            control: field("control"),
            child,
            http: reqwest::Client::new(),
        }
    }

    /// `smtp://127.0.0.1:PORT` for postie.
    pub fn smtp_url(&self) -> String {
        format!("smtp://{}", self.smtp)
    }

    /// The SMTP listen address.
    pub fn smtp_addr(&self) -> &str {
        &self.smtp
    }

    /// Every message received so far (with raw text if `raw`).
    pub async fn messages(&self, raw: bool) -> Vec<SinkMessage> {
        self.http
            .get(format!("http://{}/messages?raw={raw}", self.control))
            .send()
            .await
            .expect("sink control")
            .json()
            .await
            .expect("sink messages JSON")
    }

    /// Number of messages received.
    pub async fn count(&self) -> usize {
        self.messages(false).await.len()
    }

    /// The counters: cheap to poll, unlike [`SmtpSink::messages`] (which sends
    /// every message's metadata).
    pub async fn stats(&self) -> SinkStats {
        self.http
            .get(format!("http://{}/stats", self.control))
            .send()
            .await
            .expect("sink control")
            .json()
            .await
            .expect("sink stats JSON")
    }

    /// Replaces the fault rules (see the sink's module docs for the format).
    pub async fn set_faults(&self, rules: Value) {
        let status = self
            .http
            .put(format!("http://{}/faults", self.control))
            .json(&rules)
            .send()
            .await
            .expect("sink control")
            .status();
        assert!(status.is_success(), "sink refused fault rules: {status}");
    }

    /// Removes every fault rule.
    pub async fn clear_faults(&self) {
        self.set_faults(Value::Array(vec![])).await;
    }

    /// Turns quota mode on (at most `per_second` messages in any one-second window,
    /// [`THROTTLE_REPLY`] to the rest) or, with `None`, off; returns the new state.
    pub async fn set_quota(&self, per_second: Option<u32>) -> SinkQuota {
        let resp = self
            .http
            .put(format!("http://{}/quota", self.control))
            .json(&serde_json::json!({ "per_second": per_second }))
            .send()
            .await
            .expect("sink control");
        assert!(
            resp.status().is_success(),
            "sink refused the quota: {}",
            resp.status()
        );
        resp.json().await.expect("sink quota JSON")
    }

    /// Quota mode and its counters: accepted, throttled, accepted per second.
    pub async fn quota(&self) -> SinkQuota {
        self.http
            .get(format!("http://{}/quota", self.control))
            .send()
            .await
            .expect("sink control")
            .json()
            .await
            .expect("sink quota JSON")
    }
}

impl Drop for SmtpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
