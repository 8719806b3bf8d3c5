//! The feedback tests' tools (`tests/feedback.rs`, `tests/feedback_trust.rs`): keys
//! made with `openssl`, a world with the feedback endpoint on a free port, posting to
//! it, reading what the database holds about an address, SNS messages signed as SNS
//! signs them, and `postie feedback ingest` run as a process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use secrecy::SecretString;
use serde_json::{json, Value};

use super::{eventually, free_port, job, sample, TestEnv};

/// How long a feedback test waits for anything.
pub const WAIT: Duration = Duration::from_secs(60);
/// Base64 as the providers write it.
pub const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
/// The topic the tests' SES notifications come from (the operator's).
pub const TOPIC: &str = "arn:aws:sns:eu-west-1:123456789012:ses-feedback";

/// A scratch directory for keys, removed when dropped.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("feedback-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `openssl ARGS` with `input` on stdin; its stdout.
pub fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("openssl on the PATH");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Signs `data` with the PEM key at `key` (`-sha1` or `-sha256`).
pub fn sign(key: &Path, digest: &str, data: &[u8]) -> Vec<u8> {
    openssl(&["dgst", digest, "-sign", key.to_str().unwrap()], data)
}

/// A self-signed RSA certificate and its key in `scratch` (`sns.pem`, `sns.key`),
/// standing in for SNS's (`feedback.sns.certificate_file`).
pub fn sns_certificate(scratch: &Scratch) -> (PathBuf, PathBuf) {
    let (key, cert) = (scratch.path("sns.key"), scratch.path("sns.pem"));
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
            "-days",
            "1",
            "-subj",
            "/CN=sns.postie.test",
        ],
        b"",
    );
    (key, cert)
}

/// A world with feedback and metrics on free ports; `transport` its `transport.url`
/// (None: the SMTP sink). SES's endpoint takes notifications from [`TOPIC`].
pub async fn world(name: &str, transport: Option<String>) -> (TestEnv, postie::config::Settings) {
    let env = TestEnv::new(name).await;
    let mut settings = env.settings();
    if let Some(url) = transport {
        settings.transport.url = Some(SecretString::from(url));
    }
    settings.feedback.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    settings.http.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    settings.feedback.sns.topic_arns = vec![TOPIC.to_string()];
    (env, settings)
}

/// Where a world's postie listens: feedback and metrics.
pub struct Addrs {
    pub feedback: std::net::SocketAddr,
    pub metrics: std::net::SocketAddr,
}

impl Addrs {
    pub fn of(settings: &postie::config::Settings) -> Self {
        Self {
            feedback: settings.feedback.listen.unwrap(),
            metrics: settings.http.listen.unwrap(),
        }
    }
}

/// POSTs `body` to `/feedback/<provider>` (waiting for the endpoint to be up); the
/// status and the reply.
pub async fn post(
    at: &Addrs,
    provider: &str,
    headers: &[(&str, String)],
    body: &str,
) -> (u16, String) {
    let url = format!("http://{}/feedback/{provider}", at.feedback);
    let client = reqwest::Client::new();
    eventually(&format!("an answer from {url}"), WAIT, || async {
        let mut request = client.post(&url).body(body.to_string());
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let reply = request.send().await.ok()?;
        let status = reply.status().as_u16();
        Some((status, reply.text().await.unwrap_or_default()))
    })
    .await
}

/// `postie_feedback_notifications_total{provider,result}`.
pub async fn counted(at: &Addrs, provider: &str, result: &str) -> f64 {
    let url = format!("http://{}/metrics", at.metrics);
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    let name = format!(
        "postie_feedback_notifications_total{{provider=\"{provider}\",result=\"{result}\"}}"
    );
    sample(&text, &name).unwrap_or(0.0)
}

/// Sends `key` to `to` and waits for its row to be `sent`.
pub async fn sent(env: &TestEnv, key: &str, to: &str) {
    env.publish(&job(key, to)).await;
    env.wait_for_status(key, "sent", WAIT).await;
}

/// What the database holds about `address` and `key`: (feedback rows, audit adds,
/// live suppression reason, the row's feedback).
pub async fn state(
    env: &TestEnv,
    address: &str,
    key: &str,
) -> (i64, i64, Option<String>, Option<String>) {
    let db = env.db().await;
    let one = |sql: &'static str, arg: String| {
        let db = &db;
        async move { db.query_one(sql, &[&arg]).await.unwrap() }
    };
    let feedback: i64 = one(
        "SELECT count(*) FROM postie_feedback WHERE address = $1",
        address.into(),
    )
    .await
    .get(0);
    let adds: i64 = one(
        "SELECT count(*) FROM postie_suppression_audit WHERE address = $1 AND action = 'add'",
        address.into(),
    )
    .await
    .get(0);
    let reason: Option<String> = one(
        "SELECT max(reason) FROM postie_suppression WHERE address = $1",
        address.into(),
    )
    .await
    .get(0);
    let row: Option<String> = one(
        "SELECT max(feedback) FROM postie_inbox WHERE key = $1",
        key.into(),
    )
    .await
    .get(0);
    (feedback, adds, reason, row)
}

/// Whether `address` is on the suppression list (any scope, any reason).
pub async fn suppressed(env: &TestEnv, address: &str) -> bool {
    state(env, address, "-").await.2.is_some()
}

/// The provider's id recorded for `key`.
pub async fn provider_id(env: &TestEnv, key: &str) -> String {
    env.db()
        .await
        .query_one(
            "SELECT provider_message_id FROM postie_inbox WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// A tiny HTTP server answering 200 to anything; the paths it was asked for.
pub async fn subscribe_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(Mutex::new(Vec::new()));
    let seen = hits.clone();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = vec![0u8; 4096];
            let n = socket.read(&mut buf).await.unwrap_or(0);
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
            seen.lock().unwrap().push(path);
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .await;
        }
    });
    (port, hits)
}

/// SNS's `Timestamp` for a moment `ago` before now.
pub fn sns_time(ago: Duration) -> String {
    let at = chrono::Utc::now() - chrono::Duration::from_std(ago).unwrap();
    at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// An SNS message of `kind` from `topic` at `timestamp` with `fields`, signed
/// (SignatureVersion `version`) by `key` over SNS's canonical string.
pub fn sns_message_from(
    key: &Path,
    version: &str,
    kind: &str,
    topic: &str,
    timestamp: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut m: serde_json::Map<String, Value> = fields
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    m.insert("Type".into(), json!(kind));
    m.insert("Timestamp".into(), json!(timestamp));
    m.insert("TopicArn".into(), json!(topic));
    let signed: &[&str] = match kind {
        "Notification" => &[
            "Message",
            "MessageId",
            "Subject",
            "Timestamp",
            "TopicArn",
            "Type",
        ],
        _ => &[
            "Message",
            "MessageId",
            "SubscribeURL",
            "Timestamp",
            "Token",
            "TopicArn",
            "Type",
        ],
    };
    let mut canonical = String::new();
    for name in signed {
        if let Some(v) = m.get(*name).and_then(Value::as_str) {
            canonical.push_str(&format!("{name}\n{v}\n"));
        }
    }
    let digest = if version == "1" { "-sha1" } else { "-sha256" };
    m.insert("SignatureVersion".into(), json!(version));
    m.insert(
        "Signature".into(),
        json!(B64.encode(sign(key, digest, canonical.as_bytes()))),
    );
    m.insert(
        "SigningCertURL".into(),
        json!("https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-x.pem"),
    );
    Value::Object(m).to_string()
}

/// [`sns_message_from`] the operator's [`TOPIC`], now.
pub fn sns_message(key: &Path, version: &str, kind: &str, fields: &[(&str, &str)]) -> String {
    sns_message_from(key, version, kind, TOPIC, &sns_time(Duration::ZERO), fields)
}

/// SES's notification of a permanent bounce of `address`, for the email SES knows as
/// `ses_id` (None: an id no job has).
pub fn ses_bounce(address: &str, ses_id: Option<&str>) -> String {
    json!({"notificationType": "Bounce",
        "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                   "bouncedRecipients": [{"emailAddress": address, "status": "5.1.1",
                                          "diagnosticCode": "smtp; 550 5.1.1 user unknown"}]},
        "mail": {"messageId": ses_id.unwrap_or("0100018c-nobody-knows-this-one")}})
    .to_string()
}

/// Runs `postie feedback ingest` with `report` on stdin and `extra` settings: exit
/// code, stdout, stderr.
pub fn ingest_with(
    env: &TestEnv,
    report: &str,
    extra: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    feedback_command(env, "ingest", report, extra)
}

/// Runs `postie feedback <command>` with `input` on stdin and `extra` settings: exit
/// code, stdout, stderr.
pub fn feedback_command(
    env: &TestEnv,
    command: &str,
    input: &str,
    extra: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_postie"))
        .args(["feedback", command])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.env_vars())
        .envs(extra.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// [`ingest_with`] the world's settings alone.
pub fn ingest(env: &TestEnv, report: &str) -> (Option<i32>, String, String) {
    ingest_with(env, report, &[])
}

/// A DSN from `mx.example` (its own Message-ID `dsn_id`) saying that the email
/// `original_id` failed for `to` with 5.1.1, every part as plain text.
pub fn dsn(dsn_id: &str, to: &str, original_id: &str) -> String {
    format!(
        "From: MAILER-DAEMON@mx.example\r\nMessage-ID: {dsn_id}\r\nSubject: Undelivered\r\n\
MIME-Version: 1.0\r\nContent-Type: multipart/report; report-type=delivery-status;\r\n boundary=\"=_b1\"\r\n\r\n\
--=_b1\r\nContent-Type: text/plain\r\n\r\nThis message could not be delivered.\r\n\
--=_b1\r\nContent-Type: message/delivery-status\r\n\r\nReporting-MTA: dns; mx.example\r\nArrival-Date: Wed, 2 Dec 2026 03:00:00 +0000\r\n\r\n\
Final-Recipient: rfc822; {to}\r\nAction: failed\r\nStatus: 5.1.1\r\nDiagnostic-Code: smtp; 550 5.1.1\r\n <{to}>: no such user\r\n\r\n\
--=_b1\r\nContent-Type: text/rfc822-headers\r\n\r\nFrom: noreply@shop.example\r\nTo: {to}\r\nMessage-ID: {original_id}\r\nSubject: About it\r\n\r\n\
--=_b1--\r\n"
    )
}
