//! Client for the `postie-smtp-sink` process: start it, read what it received,
//! and tell it which faults to inject.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

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
}

/// The sink's counters (`GET /stats`).
#[derive(Debug, Clone, Deserialize)]
pub struct SinkStats {
    /// Messages recorded.
    pub accepted: u64,
    /// SMTP connections accepted.
    pub connections: u64,
}

/// A running sink process, killed on drop.
pub struct SmtpSink {
    child: Child,
    smtp: String,
    control: String,
    http: reqwest::Client,
}

impl SmtpSink {
    /// Starts a sink on ephemeral ports.
    pub async fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_postie-smtp-sink"))
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
}

impl Drop for SmtpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
