//! Asynchronous feedback (issue 30, item 4) end to end: a real RabbitMQ, a real
//! PostgreSQL, the SMTP test server or the provider test server sending the jobs first
//! (so that their rows carry a Message-ID or a provider's id), then `postie serve`'s
//! `/feedback/<provider>` (on `feedback.listen`) or `postie feedback ingest`.
//!
//! - each webhook (SES through SNS, SendGrid, Postmark, Mailgun) with a valid
//!   signature or credentials (keys made here: `openssl` for SNS's RSA certificate and
//!   SendGrid's P-256 key, `ring` for Mailgun's HMAC): one suppression with the right
//!   reason, the job's row `feedback` set; a bad signature: refused (403) and counted
//!   in `/metrics`; the same notification again: 200 and nothing changes (one
//!   feedback row, one audit add);
//! - SNS's subscription confirmation: the `SubscribeURL` fetched once (a tiny HTTP
//!   server here, allow-listed); one on a host not allowed: refused, never fetched;
//! - a DSN and an ARF report piped to `postie feedback ingest`: matched by Message-ID,
//!   suppressed as `hard_bounce` and `complaint`; piped again: a duplicate.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use secrecy::SecretString;
use serde_json::{json, Value};
use support::providers::ProviderServer;
use support::{eventually, free_port, job, message_id, sample, TestEnv};

const WAIT: Duration = Duration::from_secs(60);
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A scratch directory for keys, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("feedback-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `openssl ARGS` with `input` on stdin; its stdout.
fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
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
fn sign(key: &Path, digest: &str, data: &[u8]) -> Vec<u8> {
    openssl(&["dgst", digest, "-sign", key.to_str().unwrap()], data)
}

/// A world with feedback and metrics on free ports; `transport` its `smtp.url`
/// (None: the SMTP sink).
async fn world(name: &str, transport: Option<String>) -> (TestEnv, postie::config::Settings) {
    let env = TestEnv::new(name).await;
    let mut settings = env.settings();
    if let Some(url) = transport {
        settings.smtp.url = SecretString::from(url);
    }
    settings.feedback.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    settings.http.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    (env, settings)
}

/// Where a world's postie listens: feedback and metrics.
struct Addrs {
    feedback: std::net::SocketAddr,
    metrics: std::net::SocketAddr,
}

impl Addrs {
    fn of(settings: &postie::config::Settings) -> Self {
        Self {
            feedback: settings.feedback.listen.unwrap(),
            metrics: settings.http.listen.unwrap(),
        }
    }
}

/// POSTs `body` to `/feedback/<provider>` (waiting for the endpoint to be up); the
/// status and the reply.
async fn post(at: &Addrs, provider: &str, headers: &[(&str, String)], body: &str) -> (u16, String) {
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
async fn counted(at: &Addrs, provider: &str, result: &str) -> f64 {
    let url = format!("http://{}/metrics", at.metrics);
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    let name = format!(
        "postie_feedback_notifications_total{{provider=\"{provider}\",result=\"{result}\"}}"
    );
    sample(&text, &name).unwrap_or(0.0)
}

/// Sends `key` to `to` and waits for its row to be `sent`.
async fn sent(env: &TestEnv, key: &str, to: &str) {
    env.publish(&job(key, to)).await;
    env.wait_for_status(key, "sent", WAIT).await;
}

/// What the database holds about `address` and `key`: (feedback rows, audit adds,
/// live suppression reason, the row's feedback).
async fn state(
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

/// The provider's id recorded for `key`.
async fn provider_id(env: &TestEnv, key: &str) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_sendgrid_and_mailgun_webhooks_match_by_message_id() {
    let scratch = Scratch::new();
    let ec = scratch.path("ec.pem");
    openssl(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            ec.to_str().unwrap(),
        ],
        b"",
    );
    let spki = openssl(
        &[
            "ec",
            "-in",
            ec.to_str().unwrap(),
            "-pubout",
            "-outform",
            "DER",
        ],
        b"",
    );
    let (env, mut settings) = world("feedback-sg-mg", None).await;
    settings.feedback.sendgrid.public_key = Some(SecretString::from(B64.encode(&spki)));
    settings.feedback.mailgun.signing_key = Some(SecretString::from("mg-signing-key".to_string()));
    settings.feedback.max_body_bytes = 64 * 1024;
    let at = Addrs::of(&settings);
    let serving = env.serve(settings);
    sent(&env, "fb-sg", "sg@example.com").await;
    sent(&env, "fb-mg", "mg@example.com").await;

    // SendGrid: a hard bounce (type bounce), signed over timestamp + body.
    let events = json!([
        {"email": "sg@example.com", "event": "bounce", "type": "bounce", "status": "5.1.1",
         "reason": "550 5.1.1 no such user", "sg_event_id": "sg-ev-1",
         "sg_message_id": "sgid.filter0001", "smtp-id": message_id("fb-sg"), "timestamp": 1},
        {"email": "sg@example.com", "event": "delivered", "sg_event_id": "sg-ev-0"}
    ])
    .to_string();
    let ts = chrono::Utc::now().timestamp().to_string();
    let sig = sign(&ec, "-sha256", format!("{ts}{events}").as_bytes());
    let signed = |sig: &[u8]| {
        vec![
            ("X-Twilio-Email-Event-Webhook-Signature", B64.encode(sig)),
            ("X-Twilio-Email-Event-Webhook-Timestamp", ts.clone()),
        ]
    };
    let bad = sign(&ec, "-sha256", format!("{ts}[]").as_bytes());
    assert_eq!(post(&at, "sendgrid", &signed(&bad), &events).await.0, 403);
    assert_eq!(post(&at, "sendgrid", &[], &events).await.0, 401);
    let huge = format!("[{}]", " ".repeat(100 * 1024));
    assert_eq!(
        post(&at, "sendgrid", &signed(&sig), &huge).await.0,
        413,
        "over feedback.max_body_bytes"
    );
    assert_eq!(post(&at, "sendgrid", &signed(&sig), &events).await.0, 200);
    assert_eq!(
        post(&at, "sendgrid", &signed(&sig), &events).await.0,
        200,
        "replay"
    );
    let sg = state(&env, "sg@example.com", "fb-sg").await;
    assert_eq!(
        sg,
        (1, 1, Some("hard_bounce".into()), Some("bounced".into()))
    );
    assert_eq!(counted(&at, "sendgrid", "refused").await, 2.0);
    assert_eq!(counted(&at, "sendgrid", "recorded").await, 1.0);
    assert_eq!(counted(&at, "sendgrid", "duplicate").await, 1.0);

    // Mailgun: a complaint, HMAC-SHA256(key, timestamp + token).
    let mailgun = |key: &[u8], ts: i64| {
        let token = "tok-1";
        let mac = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
            format!("{ts}{token}").as_bytes(),
        );
        json!({
            "signature": {"timestamp": ts.to_string(), "token": token, "signature": hex::encode(mac.as_ref())},
            "event-data": {"event": "complained", "id": "mg-ev-1", "recipient": "mg@example.com",
                "message": {"headers": {"message-id": message_id("fb-mg").trim_matches(['<', '>'])}}}
        })
        .to_string()
    };
    let now = chrono::Utc::now().timestamp();
    assert_eq!(
        post(&at, "mailgun", &[], &mailgun(b"wrong-key", now))
            .await
            .0,
        403
    );
    assert_eq!(
        post(&at, "mailgun", &[], &mailgun(b"mg-signing-key", now - 3600))
            .await
            .0,
        403,
        "stale"
    );
    assert_eq!(post(&at, "mailgun", &[], "{not json").await.0, 400);
    assert_eq!(
        post(&at, "mailgun", &[], &mailgun(b"mg-signing-key", now))
            .await
            .0,
        200
    );
    assert_eq!(
        post(&at, "mailgun", &[], &mailgun(b"mg-signing-key", now))
            .await
            .0,
        200
    );
    let mg = state(&env, "mg@example.com", "fb-mg").await;
    assert_eq!(
        mg,
        (1, 1, Some("complaint".into()), Some("complained".into()))
    );
    assert_eq!(counted(&at, "mailgun", "refused").await, 2.0);
    assert_eq!(counted(&at, "mailgun", "malformed").await, 1.0);
    serving.stop().await;
    eprintln!("FIGURES feedback sendgrid+mailgun: valid -> 1 suppression each (hard_bounce, complaint), row feedback set; bad signature/stale -> 403 counted; replay -> 200, still 1 feedback row and 1 audit add");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_postmark_webhook_matches_by_provider_id() {
    let server = ProviderServer::start().await;
    let (env, mut settings) = world("feedback-pm", Some(server.url("postmark"))).await;
    settings.feedback.postmark.user = Some("hook".into());
    settings.feedback.postmark.password = Some(SecretString::from("s3cret".to_string()));
    let at = Addrs::of(&settings);
    let serving = env.serve(settings);
    sent(&env, "fb-pm", "pm@example.com").await;
    sent(&env, "fb-pm-soft", "soft@example.com").await;
    let bounce = |id: u64, key_id: String, email: &str, kind: &str| {
        json!({"RecordType": "Bounce", "ID": id, "Type": kind, "MessageID": key_id,
               "Email": email, "Description": "The server was unable to deliver your message"})
        .to_string()
    };
    let hard = bounce(
        4242,
        provider_id(&env, "fb-pm").await,
        "pm@example.com",
        "HardBounce",
    );
    let auth = |user: &str, pass: &str| {
        vec![(
            "Authorization",
            format!("Basic {}", B64.encode(format!("{user}:{pass}"))),
        )]
    };
    assert_eq!(
        post(&at, "postmark", &auth("hook", "wrong"), &hard).await.0,
        403
    );
    assert_eq!(post(&at, "postmark", &[], &hard).await.0, 401);
    assert_eq!(
        post(&at, "postmark", &auth("hook", "s3cret"), &hard)
            .await
            .0,
        200
    );
    assert_eq!(
        post(&at, "postmark", &auth("hook", "s3cret"), &hard)
            .await
            .0,
        200
    );
    let pm = state(&env, "pm@example.com", "fb-pm").await;
    assert_eq!(
        pm,
        (1, 1, Some("hard_bounce".into()), Some("bounced".into()))
    );
    // A soft bounce: recorded on the row, not suppressed.
    let soft = bounce(
        4243,
        provider_id(&env, "fb-pm-soft").await,
        "soft@example.com",
        "SoftBounce",
    );
    assert_eq!(
        post(&at, "postmark", &auth("hook", "s3cret"), &soft)
            .await
            .0,
        200
    );
    let soft_state = state(&env, "soft@example.com", "fb-pm-soft").await;
    assert_eq!(soft_state, (1, 0, None, Some("bounced".into())));
    let complaint = json!({"RecordType": "SpamComplaint", "ID": 4244, "MessageID": "unknown-id",
                           "Email": "someone@example.com"})
    .to_string();
    assert_eq!(
        post(&at, "postmark", &auth("hook", "s3cret"), &complaint)
            .await
            .0,
        200
    );
    assert_eq!(
        state(&env, "someone@example.com", "none")
            .await
            .2
            .as_deref(),
        Some("complaint"),
        "unmatched still suppresses"
    );
    assert_eq!(counted(&at, "postmark", "refused").await, 2.0);
    assert_eq!(counted(&at, "postmark", "recorded").await, 2.0);
    assert_eq!(counted(&at, "postmark", "duplicate").await, 1.0);
    assert_eq!(counted(&at, "postmark", "unmatched").await, 1.0);
    serving.stop().await;
    eprintln!("FIGURES feedback postmark: hard bounce by provider id -> 1 suppression; soft -> row only; unmatched complaint -> suppressed; wrong password 403, none 401 (counted 2)");
}

/// A tiny HTTP server answering 200 to anything; the paths it was asked for.
async fn subscribe_server() -> (u16, Arc<Mutex<Vec<String>>>) {
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

/// An SNS message of `kind` with `fields`, signed (SignatureVersion `version`) by `key`.
fn sns_message(key: &Path, version: &str, kind: &str, fields: &[(&str, &str)]) -> String {
    let mut m: serde_json::Map<String, Value> = fields
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    m.insert("Type".into(), json!(kind));
    m.insert("Timestamp".into(), json!("2026-12-02T03:00:00.000Z"));
    m.insert(
        "TopicArn".into(),
        json!("arn:aws:sns:eu-west-1:123456789012:ses-feedback"),
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_ses_through_sns_verifies_signatures_and_confirms_subscriptions() {
    let scratch = Scratch::new();
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
    let other = scratch.path("other.key");
    openssl(&["genrsa", "-out", other.to_str().unwrap(), "2048"], b"");
    let (port, hits) = subscribe_server().await;
    let server = ProviderServer::start().await;
    let (env, mut settings) = world("feedback-ses", Some(server.url("ses"))).await;
    settings.feedback.sns.certificate_file = Some(cert.clone());
    settings.feedback.sns.allowed_hosts = vec![format!("http://127.0.0.1:{port}")];
    let at = Addrs::of(&settings);
    let serving = env.serve(settings);

    // The subscription: confirmed by one fetch of its URL (SignatureVersion 1).
    let confirm = |url: &str| {
        sns_message(
            &key,
            "1",
            "SubscriptionConfirmation",
            &[
                ("Message", "You have chosen to subscribe"),
                ("MessageId", "sub-1"),
                ("Token", "tok"),
                ("SubscribeURL", url),
            ],
        )
    };
    let good_url = format!("http://127.0.0.1:{port}/confirm?Token=tok");
    assert_eq!(
        post(&at, "ses", &[], &confirm(&good_url)).await,
        (200, "subscribed\n".into())
    );
    let evil_url = format!("http://localhost:{port}/evil");
    assert_eq!(post(&at, "ses", &[], &confirm(&evil_url)).await.0, 403);
    assert_eq!(
        *hits.lock().unwrap(),
        vec!["/confirm?Token=tok".to_string()],
        "fetched once, never the host not allowed"
    );

    // A permanent bounce (SignatureVersion 2), matched by SES's id.
    sent(&env, "fb-ses", "ses@example.com").await;
    let ses = json!({"notificationType": "Bounce",
        "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                   "bouncedRecipients": [{"emailAddress": "ses@example.com", "status": "5.1.1",
                                          "diagnosticCode": "smtp; 550 5.1.1 user unknown"}]},
        "mail": {"messageId": provider_id(&env, "fb-ses").await}})
    .to_string();
    let note = |key: &Path| {
        sns_message(
            key,
            "2",
            "Notification",
            &[("Message", ses.as_str()), ("MessageId", "sns-n-1")],
        )
    };
    assert_eq!(
        post(&at, "ses", &[], &note(&other)).await.0,
        403,
        "signed by another key"
    );
    assert_eq!(post(&at, "ses", &[], &note(&key)).await.0, 200);
    assert_eq!(post(&at, "ses", &[], &note(&key)).await.0, 200);
    let st = state(&env, "ses@example.com", "fb-ses").await;
    assert_eq!(
        st,
        (1, 1, Some("hard_bounce".into()), Some("bounced".into()))
    );
    assert_eq!(counted(&at, "ses", "refused").await, 2.0);
    assert_eq!(counted(&at, "ses", "recorded").await, 1.0);
    assert_eq!(counted(&at, "ses", "duplicate").await, 1.0);
    serving.stop().await;
    eprintln!("FIGURES feedback ses/sns: SubscribeURL fetched 1 time, the one on a host not allowed 0 times; bounce by SES id -> 1 suppression; wrong key 403 counted; replay no-op");
}

/// Runs `postie feedback ingest` with `report` on stdin: exit code, stdout, stderr.
fn ingest(env: &TestEnv, report: &str) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_postie"))
        .args(["feedback", "ingest"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.env_vars())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(report.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_ingest_reads_a_dsn_and_an_arf_report() {
    let (env, settings) = world("feedback-ingest", None).await;
    let serving = env.serve(settings);
    let mut typed = job("fb-dsn", "gone@example.com");
    typed["type"] = serde_json::json!("order");
    env.publish(&typed).await;
    env.wait_for_status("fb-dsn", "sent", WAIT).await;
    sent(&env, "fb-arf", "angry@example.com").await;
    serving.stop().await;
    // The delivery events the reports write (no instance runs to publish them now).
    let events = |outcome: &'static str| {
        let env = &env;
        async move {
            env.db()
                .await
                .query(
                    "SELECT key, coalesce(type, '-') FROM postie_events WHERE outcome = $1",
                    &[&outcome],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
                .collect::<Vec<_>>()
        }
    };
    let dsn = format!(
        "From: MAILER-DAEMON@mx.example\r\nMessage-ID: <dsn-77@mx.example>\r\nSubject: Undelivered\r\n\
Content-Type: multipart/report; report-type=delivery-status;\r\n boundary=\"=_b1\"\r\n\r\n\
--=_b1\r\nContent-Type: text/plain\r\n\r\nThis message could not be delivered.\r\n\
--=_b1\r\nContent-Type: message/delivery-status\r\n\r\nReporting-MTA: dns; mx.example\r\nArrival-Date: Wed, 2 Dec 2026 03:00:00 +0000\r\n\r\n\
Final-Recipient: rfc822; gone@example.com\r\nAction: failed\r\nStatus: 5.1.1\r\nDiagnostic-Code: smtp; 550 5.1.1\r\n <gone@example.com>: no such user\r\n\r\n\
--=_b1\r\nContent-Type: text/rfc822-headers\r\n\r\nFrom: noreply@shop.example\r\nTo: gone@example.com\r\nMessage-ID: {}\r\nSubject: About fb-dsn\r\n\r\n\
--=_b1--\r\n",
        message_id("fb-dsn")
    );
    let (code, out, err) = ingest(&env, &dsn);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("recorded: bounce (hard_bounce) from dsn, key fb-dsn"),
        "{out}"
    );
    let st = state(&env, "gone@example.com", "fb-dsn").await;
    assert_eq!(
        st,
        (1, 1, Some("hard_bounce".into()), Some("bounced".into()))
    );
    let (code, out, _) = ingest(&env, &dsn);
    assert_eq!(code, Some(0));
    assert!(out.contains("duplicate"), "{out}");
    assert_eq!(state(&env, "gone@example.com", "fb-dsn").await.0, 1);
    let kind: String = env
        .db()
        .await
        .query_one("SELECT type FROM postie_feedback WHERE key = 'fb-dsn'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(kind, "order", "counted under its job's type");
    assert_eq!(
        events("bounced").await,
        [("fb-dsn".to_string(), "order".to_string())],
        "one bounced event, the replay wrote none"
    );

    let arf = format!(
        "From: fbl@isp.example\r\nMessage-ID: <arf-9@isp.example>\r\nMIME-Version: 1.0\r\n\
Content-Type: multipart/report; report-type=feedback-report; boundary=\"part\"\r\n\r\n\
--part\r\nContent-Type: text/plain\r\n\r\nThis is an email abuse report.\r\n\
--part\r\nContent-Type: message/feedback-report\r\n\r\nFeedback-Type: abuse\r\nUser-Agent: SomeISP/1.0\r\nVersion: 1\r\n\r\n\
--part\r\nContent-Type: message/rfc822\r\n\r\nFrom: noreply@shop.example\r\nTo: Angry <angry@example.com>\r\nMessage-ID: {}\r\nSubject: About fb-arf\r\n\r\nHello about fb-arf\r\n\
--part--\r\n",
        message_id("fb-arf")
    );
    let (code, out, err) = ingest(&env, &arf);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("recorded: complaint (complaint) from arf, key fb-arf"),
        "{out}"
    );
    let st = state(&env, "angry@example.com", "fb-arf").await;
    assert_eq!(
        st,
        (1, 1, Some("complaint".into()), Some("complained".into()))
    );
    assert_eq!(
        events("complained").await,
        [("fb-arf".to_string(), "-".to_string())]
    );
    let (code, _, err) = ingest(&env, "Subject: hello\r\n\r\nnot a report\r\n");
    assert_ne!(code, Some(0));
    assert!(err.contains("not a report"), "{err}");
    eprintln!("FIGURES feedback ingest: DSN 5.1.1 -> hard_bounce matched by Message-ID, again -> duplicate; ARF abuse -> complaint matched; a plain email refused with a non-zero exit");
}
