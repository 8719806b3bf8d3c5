//! Integration tests for the `postie-smtp-sink` test server.
//!
//! Each test spawns its own sink process (ephemeral ports), talks SMTP to it through
//! lettre's pooled async transport or a raw TCP socket, and inspects and controls it
//! through its HTTP control API. The process is killed when the [`Sink`] guard drops.

#[allow(dead_code, unreachable_pub)]
#[path = "support/sink.rs"]
mod sink_client;

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lettre::transport::smtp::Error as SmtpError;
use lettre::{AsyncSmtpTransport, AsyncTransport as _, Message, Tokio1Executor};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Generous upper bound for anything that should be quick; never asserted on.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A running sink process; killed and reaped on drop.
struct Sink {
    child: Child,
    smtp_port: u16,
    control: String,
    http: reqwest::Client,
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sink {
    /// Spawns a sink with default arguments.
    fn spawn() -> Self {
        Self::spawn_with(&[])
    }

    /// Spawns a sink with extra arguments and waits for its address line.
    fn spawn_with(args: &[&str]) -> Self {
        let mut child = Command::new(sink_client::binary())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn postie-smtp-sink");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut sink = Sink {
            child,
            smtp_port: 0,
            control: String::new(),
            http: reqwest::Client::builder()
                .timeout(TIMEOUT)
                .build()
                .expect("http client"),
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(TIMEOUT).expect("sink prints its addresses");
        let (smtp, control) = parse_announce(&line);
        sink.smtp_port = smtp
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("smtp port");
        sink.control = format!("http://{control}");
        sink
    }

    /// A pooled lettre transport pointed at the sink.
    fn mailer(&self) -> AsyncSmtpTransport<Tokio1Executor> {
        AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous("127.0.0.1")
            .port(self.smtp_port)
            .timeout(Some(TIMEOUT))
            .build()
    }

    /// Opens a raw SMTP connection.
    async fn raw(&self) -> RawSmtp {
        let stream = TcpStream::connect(("127.0.0.1", self.smtp_port))
            .await
            .expect("connect to sink");
        RawSmtp {
            stream: tokio::io::BufReader::new(stream),
        }
    }

    /// `GET path`, expecting 200 and a JSON body.
    async fn get_json(&self, path: &str) -> Value {
        let resp = self
            .http
            .get(format!("{}{path}", self.control))
            .send()
            .await
            .expect("GET");
        assert_eq!(resp.status(), 200, "GET {path}");
        resp.json().await.expect("JSON body")
    }

    /// Recorded messages, optionally with raw content.
    async fn messages(&self, raw: bool) -> Vec<Value> {
        let path = if raw {
            "/messages?raw=true"
        } else {
            "/messages"
        };
        match self.get_json(path).await {
            Value::Array(items) => items,
            other => panic!("expected array, got {other}"),
        }
    }

    /// `GET /stats`.
    async fn stats(&self) -> Value {
        self.get_json("/stats").await
    }

    /// `PUT /faults`, returning the status code.
    async fn put_faults(&self, rules: Value) -> u16 {
        self.http
            .put(format!("{}/faults", self.control))
            .json(&rules)
            .send()
            .await
            .expect("PUT /faults")
            .status()
            .as_u16()
    }

    /// `DELETE path`, expecting success.
    async fn delete(&self, path: &str) {
        let resp = self
            .http
            .delete(format!("{}{path}", self.control))
            .send()
            .await
            .expect("DELETE");
        assert!(
            resp.status().is_success(),
            "DELETE {path}: {}",
            resp.status()
        );
    }
}

/// Splits `smtp=ADDR control=ADDR` into its two addresses.
fn parse_announce(line: &str) -> (String, String) {
    let mut smtp = None;
    let mut control = None;
    for part in line.split_whitespace() {
        if let Some(v) = part.strip_prefix("smtp=") {
            smtp = Some(v.to_owned());
        } else if let Some(v) = part.strip_prefix("control=") {
            control = Some(v.to_owned());
        }
    }
    match (smtp, control) {
        (Some(s), Some(c)) => (s, c),
        _ => panic!("unexpected startup line {line:?}"),
    }
}

/// Builds a plain-text message from a fixed sender.
fn email(to: &str, message_id: &str, subject: &str, body: &str) -> Message {
    Message::builder()
        .from("Postie Test <sender@example.com>".parse().expect("from"))
        .to(to.parse().expect("to"))
        .subject(subject)
        .message_id(Some(message_id.to_owned()))
        .body(body.to_owned())
        .expect("valid message")
}

/// Sends one message with the given transport.
async fn send(
    mailer: &AsyncSmtpTransport<Tokio1Executor>,
    to: &str,
    message_id: &str,
) -> Result<(), SmtpError> {
    mailer
        .send(email(to, message_id, "Test", "Hello.\r\n"))
        .await
        .map(|_| ())
}

/// Gives lettre's pool time to take back a connection.
///
/// lettre returns a connection to its pool from a spawned task when the send
/// finishes, so a send issued immediately afterwards may open a second connection.
async fn let_pool_recycle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A raw SMTP client for protocol-level checks.
struct RawSmtp {
    stream: tokio::io::BufReader<TcpStream>,
}

impl RawSmtp {
    /// Sends bytes verbatim.
    async fn send(&mut self, data: &str) {
        self.stream
            .get_mut()
            .write_all(data.as_bytes())
            .await
            .expect("write");
    }

    /// Reads one (possibly multi-line) reply; returns its lines without CRLF, or
    /// an empty vector on EOF.
    async fn reply(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout(TIMEOUT, self.stream.read_line(&mut line))
                .await
                .expect("reply within timeout")
                .expect("read");
            if n == 0 {
                return lines;
            }
            let line = line.trim_end_matches(['\r', '\n']).to_owned();
            let last = line.as_bytes().get(3) != Some(&b'-');
            lines.push(line);
            if last {
                return lines;
            }
        }
    }

    /// True if nothing at all arrives (not even EOF) for 700 ms.
    async fn silent(&mut self) -> bool {
        let mut line = String::new();
        let read = self.stream.read_line(&mut line);
        tokio::time::timeout(Duration::from_millis(700), read)
            .await
            .is_err()
    }

    /// Reads a single-line reply and returns it.
    async fn line(&mut self) -> String {
        let lines = self.reply().await;
        assert_eq!(lines.len(), 1, "expected one reply line, got {lines:?}");
        lines.into_iter().next().unwrap_or_default()
    }
}

/// Extracts a string field.
fn str_field<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[tokio::test]
async fn records_message_headers_and_unstuffed_body() {
    let sink = Sink::spawn();
    let body = "first line\r\n.leading dot line\r\n..two dots\r\nlast line\r\n";
    let msg = email(
        "Rcpt One <rcpt@example.net>",
        "<id-1@postie.test>",
        "Hello sink",
        body,
    );
    sink.mailer().send(msg).await.expect("send");

    let listed = sink.messages(false).await;
    assert_eq!(listed.len(), 1);
    let m = &listed[0];
    assert_eq!(m["seq"], 1);
    assert_eq!(str_field(m, "message_id"), "<id-1@postie.test>");
    assert_eq!(str_field(m, "mail_from"), "sender@example.com");
    assert_eq!(m["rcpt_to"], json!(["rcpt@example.net"]));
    assert_eq!(str_field(m, "subject"), "Hello sink");
    assert!(m.get("raw").is_none(), "raw only on request: {m}");
    let received = m["received_at_ms"].as_i64().expect("received_at_ms");
    assert!(received > 1_600_000_000_000, "unix ms: {received}");

    let with_raw = sink.messages(true).await;
    let raw = str_field(&with_raw[0], "raw");
    assert!(raw.contains("\r\n\r\nfirst line\r\n.leading dot line\r\n..two dots\r\nlast line"));
    assert!(!raw.contains("..leading"), "dot-unstuffed: {raw:?}");
    assert!(raw.contains("Message-ID: <id-1@postie.test>\r\n"));
    assert_eq!(with_raw[0]["size"], raw.len());
}

#[tokio::test]
async fn folded_subject_is_unfolded() {
    let sink = Sink::spawn();
    let subject = "A rather long subject line that a well-behaved client will fold \
                   across several physical lines when it writes the header out";
    let msg = email("rcpt@example.net", "<fold@postie.test>", subject, "x\r\n");
    sink.mailer().send(msg).await.expect("send");
    let m = &sink.messages(true).await[0];
    let raw_headers = str_field(m, "raw").split("\r\n\r\n").next().unwrap_or("");
    assert!(
        raw_headers.contains("\r\n "),
        "subject was folded: {raw_headers:?}"
    );
    assert_eq!(str_field(m, "subject"), subject);
}

#[tokio::test]
async fn pooled_connection_carries_two_messages() {
    let sink = Sink::spawn();
    let mailer = sink.mailer();
    send(&mailer, "a@example.net", "<pool-1@postie.test>")
        .await
        .expect("first send");
    let_pool_recycle().await;
    send(&mailer, "b@example.net", "<pool-2@postie.test>")
        .await
        .expect("second send");

    let msgs = sink.messages(false).await;
    let ids: Vec<_> = msgs.iter().map(|m| str_field(m, "message_id")).collect();
    assert_eq!(ids, ["<pool-1@postie.test>", "<pool-2@postie.test>"]);
    assert_eq!(msgs[1]["seq"], 2);
    let stats = sink.stats().await;
    assert_eq!(stats["accepted"], 2);
    assert_eq!(stats["connections"], 1, "one pooled connection: {stats}");
}

#[tokio::test]
async fn transient_rcpt_fault_fires_limited_times() {
    let sink = Sink::spawn();
    let rules = json!([{
        "stage": "rcpt",
        "action": {"reply": "451 4.3.0 try again later"},
        "times": 2
    }]);
    assert_eq!(sink.put_faults(rules).await, 200);
    let mailer = sink.mailer();

    for attempt in 1..=2 {
        let err = send(&mailer, "r@example.net", "<t@postie.test>")
            .await
            .expect_err("rejected while the rule is active");
        assert!(err.is_transient(), "attempt {attempt}: {err}");
    }
    send(&mailer, "r@example.net", "<t@postie.test>")
        .await
        .expect("third attempt succeeds");

    let faults = sink.get_json("/faults").await;
    assert_eq!(faults[0]["times"], 0, "{faults}");
    let stats = sink.stats().await;
    assert_eq!(stats["faults_applied"], 2);
    assert_eq!(stats["accepted"], 1);
    assert_eq!(sink.messages(false).await.len(), 1);
}

#[tokio::test]
async fn permanent_rcpt_fault_matches_recipient_substring() {
    let sink = Sink::spawn();
    let rules = json!([
        {
            "stage": "rcpt",
            "rcpt_contains": "reject",
            "action": {"reply": "550 5.1.1 no such user"}
        },
        {
            "stage": "data_end",
            "rcpt_contains": "spam",
            "action": {"reply": "554 5.7.1 looks like spam"}
        }
    ]);
    assert_eq!(sink.put_faults(rules).await, 200);
    let mailer = sink.mailer();

    let err = send(&mailer, "reject-me@example.net", "<p1@postie.test>")
        .await
        .expect_err("rejected");
    assert!(err.is_permanent(), "{err}");
    let err = send(&mailer, "spam@example.net", "<p3@postie.test>")
        .await
        .expect_err("rejected after the final dot");
    assert!(err.is_permanent(), "{err}");
    send(&mailer, "fine@example.net", "<p2@postie.test>")
        .await
        .expect("other recipients pass");

    let msgs = sink.messages(false).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0]["rcpt_to"], json!(["fine@example.net"]));
    let faults = sink.get_json("/faults").await;
    assert!(faults[0]["times"].is_null(), "unlimited: {faults}");
}

#[tokio::test]
async fn data_end_drop_with_deliver_records_but_client_fails() {
    let sink = Sink::spawn();
    let rules = json!([{
        "stage": "data_end",
        "action": {"drop": true, "deliver": true},
        "times": 1
    }]);
    assert_eq!(sink.put_faults(rules).await, 200);
    let mailer = sink.mailer();

    let err = send(&mailer, "d@example.net", "<lost-reply@postie.test>").await;
    assert!(err.is_err(), "client must not see success");
    let msgs = sink.messages(false).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(
        str_field(&msgs[0], "message_id"),
        "<lost-reply@postie.test>"
    );

    send(&mailer, "d@example.net", "<after@postie.test>")
        .await
        .expect("pool recovers with a new connection");
    let stats = sink.stats().await;
    assert_eq!(stats["dropped"], 1);
    assert_eq!(stats["faults_applied"], 1);
    assert_eq!(stats["accepted"], 2);
}

#[tokio::test]
async fn delay_fault_slows_the_send() {
    let sink = Sink::spawn();
    let rules = json!([{"stage": "mail", "action": {"delay_ms": 400}}]);
    assert_eq!(sink.put_faults(rules).await, 200);

    let started = Instant::now();
    send(&sink.mailer(), "slow@example.net", "<slow@postie.test>")
        .await
        .expect("delayed send succeeds");
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(400), "{elapsed:?}");
    assert_eq!(sink.stats().await["faults_applied"], 1);
    assert_eq!(sink.messages(false).await.len(), 1);
}

#[tokio::test]
async fn delete_messages_clears_and_seq_keeps_counting() {
    let sink = Sink::spawn();
    let mailer = sink.mailer();
    send(&mailer, "x@example.net", "<first@postie.test>")
        .await
        .expect("send");
    assert_eq!(sink.messages(false).await.len(), 1);

    sink.delete("/messages").await;
    assert!(sink.messages(false).await.is_empty());

    send(&mailer, "x@example.net", "<second@postie.test>")
        .await
        .expect("send");
    let msgs = sink.messages(false).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0]["seq"], 2);
}

#[tokio::test]
async fn raw_protocol_sequence_errors_and_pipelining() {
    let sink = Sink::spawn();
    let mut c = sink.raw().await;
    assert_eq!(c.line().await, "220 postie-smtp-sink ESMTP");

    c.send("MAIL FROM:<a@example.com>\r\n").await;
    assert!(c.line().await.starts_with("503 "), "MAIL before EHLO");
    c.send("ehlo client.test\r\n").await;
    let ehlo = c.reply().await;
    assert_eq!(ehlo.len(), 4, "{ehlo:?}");
    assert!(ehlo.contains(&"250-SIZE 52428800".to_owned()));
    assert!(ehlo.contains(&"250-8BITMIME".to_owned()));
    assert_eq!(ehlo[3], "250 PIPELINING");

    c.send("FROB\r\n").await;
    assert!(c.line().await.starts_with("500 "));
    c.send("VRFY someone\r\n").await;
    assert!(c.line().await.starts_with("252 "));
    c.send("RCPT TO:<x@example.net>\r\n").await;
    assert!(c.line().await.starts_with("503 "), "RCPT before MAIL");
    c.send(&format!("NOOP {}\r\n", "x".repeat(10_000))).await;
    assert!(c.line().await.starts_with("500 "), "overlong line");
    c.send("NOOP\r\n").await;
    assert!(c.line().await.starts_with("250 "));

    // Everything up to DATA pipelined in one write.
    c.send(
        "MAIL FROM:<a@example.com> BODY=8BITMIME\r\nRCPT TO:<c@example.net>\r\n\
         rcpt to: <e@example.net> NOTIFY=NEVER\r\nDATA\r\n",
    )
    .await;
    for _ in 0..3 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert!(c.line().await.starts_with("354 "));
    c.send("Subject: raw\r\nmessage-id:  <raw@x> \r\n\r\n..x\r\n.\r\n")
        .await;
    assert_eq!(c.line().await, "250 2.0.0 Ok: queued as 1");

    c.send("DATA\r\n").await;
    assert!(c.line().await.starts_with("503 "), "DATA without MAIL");
    c.send("MAIL FROM:<>\r\nRSET\r\nRCPT TO:<c@example.net>\r\n")
        .await;
    assert!(c.line().await.starts_with("250 "));
    assert!(c.line().await.starts_with("250 "));
    assert!(
        c.line().await.starts_with("503 "),
        "RSET ended the transaction"
    );
    c.send("QUIT\r\n").await;
    assert!(c.line().await.starts_with("221 "));
    assert!(c.reply().await.is_empty(), "closed after QUIT");

    let m = &sink.messages(true).await[0];
    assert_eq!(str_field(m, "mail_from"), "a@example.com");
    assert_eq!(m["rcpt_to"], json!(["c@example.net", "e@example.net"]));
    assert_eq!(str_field(m, "message_id"), "<raw@x>");
    assert_eq!(str_field(m, "subject"), "raw");
    assert_eq!(
        str_field(m, "raw"),
        "Subject: raw\r\nmessage-id:  <raw@x> \r\n\r\n.x\r\n"
    );
}

/// `--chunking`: CHUNKING advertised; BDAT chunks read whatever the reply, then the
/// message recorded after `LAST` and marked chunked; a `data` rule fires at the first
/// chunk; a BDAT that cannot be parsed closes the session. Without `--chunking`, BDAT
/// is not implemented (its chunk still read).
#[tokio::test]
async fn raw_bdat_chunks_refusals_and_faults() {
    let sink = Sink::spawn_with(&["--chunking"]);
    let mut c = sink.raw().await;
    assert_eq!(c.line().await, "220 postie-smtp-sink ESMTP");
    c.send("EHLO client.test\r\n").await;
    let ehlo = c.reply().await;
    assert_eq!(
        ehlo.last().map(String::as_str),
        Some("250 CHUNKING"),
        "{ehlo:?}"
    );
    assert!(ehlo.contains(&"250-PIPELINING".to_owned()), "{ehlo:?}");

    // Without MAIL, and without an accepted recipient: the chunk is read and refused.
    c.send("BDAT 5 LAST\r\nNOOP\r").await;
    assert!(c.line().await.starts_with("503 "), "BDAT without MAIL");
    c.send("MAIL FROM:<a@example.com>\r\nBDAT 4 LAST\r\nRSET")
        .await;
    assert!(c.line().await.starts_with("250 "));
    assert!(
        c.line().await.starts_with("554 "),
        "BDAT without a recipient"
    );

    // Two chunks, the envelope and the first chunk in one write; dots are data.
    let first = "Subject: chunk\r\n\r\n.x\r\n";
    c.send(&format!(
        "MAIL FROM:<a@example.com>\r\nRCPT TO:<c@example.net>\r\nBDAT {}\r\n{first}",
        first.len()
    ))
    .await;
    assert!(c.line().await.starts_with("250 "));
    assert!(c.line().await.starts_with("250 "));
    assert_eq!(
        c.line().await,
        format!("250 2.0.0 Ok: {} octets", first.len())
    );
    c.send("BDAT 3 LAST\r\nend").await;
    assert_eq!(c.line().await, "250 2.0.0 Ok: queued as 1");

    // A `data` rule at the first chunk; the chunk is still read.
    let rules = json!([{"stage": "data", "action": {"reply": "452 4.3.1 full"}, "times": 1}]);
    assert_eq!(sink.put_faults(rules).await, 200);
    c.send("MAIL FROM:<a@example.com>\r\nRCPT TO:<c@example.net>\r\nBDAT 2 LAST\r\nhi")
        .await;
    assert!(c.line().await.starts_with("250 "));
    assert!(c.line().await.starts_with("250 "));
    assert_eq!(c.line().await, "452 4.3.1 full");
    c.send("NOOP\r\n").await;
    assert!(
        c.line().await.starts_with("250 "),
        "in step after the chunk"
    );

    c.send("BDAT many\r\n").await;
    assert!(c.line().await.starts_with("501 "));
    assert!(
        c.reply().await.is_empty(),
        "closed after a BDAT without a size"
    );

    let messages = sink.messages(true).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(
        str_field(&messages[0], "raw"),
        "Subject: chunk\r\n\r\n.x\r\nend"
    );
    assert_eq!(messages[0]["chunked"], json!(true));
    assert_eq!(str_field(&messages[0], "subject"), "chunk");

    let plain = Sink::spawn();
    let mut c = plain.raw().await;
    assert_eq!(c.line().await, "220 postie-smtp-sink ESMTP");
    c.send("EHLO client.test\r\n").await;
    assert!(!c.reply().await.contains(&"250 CHUNKING".to_owned()));
    c.send("BDAT 6 LAST\r\nQUIT\r\nNOOP\r\n").await;
    assert!(c.line().await.starts_with("502 "));
    assert!(
        c.line().await.starts_with("250 "),
        "the chunk was not a command"
    );
}

#[tokio::test]
async fn connect_and_data_faults_over_raw_smtp() {
    let sink = Sink::spawn();
    let rules = json!([
        {"stage": "connect", "action": {"reply": "421 4.3.2 busy"}, "times": 1},
        {"stage": "data", "action": {"reply": "452 4.3.1 full"}, "times": 1}
    ]);
    assert_eq!(sink.put_faults(rules).await, 200);

    let mut refused = sink.raw().await;
    assert_eq!(refused.line().await, "421 4.3.2 busy");
    assert!(
        refused.reply().await.is_empty(),
        "closed after connect fault"
    );

    let mut c = sink.raw().await;
    assert!(c.line().await.starts_with("220 "));
    c.send("HELO t\r\nMAIL FROM:<a@b>\r\nRCPT TO:<c@d>\r\nDATA\r\nRCPT TO:<c@d>\r\n")
        .await;
    for _ in 0..3 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert_eq!(c.line().await, "452 4.3.1 full");
    assert!(c.line().await.starts_with("503 "), "transaction was reset");

    let stats = sink.stats().await;
    assert_eq!(stats["connections"], 2);
    assert_eq!(stats["faults_applied"], 2);
}

/// A `hang` rule: a session that meets it never gets another byte, even once the rule
/// is gone; sessions opened after that are answered normally.
#[tokio::test]
async fn hang_faults_never_answer_even_after_the_rule_is_gone() {
    let sink = Sink::spawn();
    let rules = json!([
        {"stage": "connect", "action": {"hang": true}, "times": 1},
        {"stage": "rcpt", "action": {"hang": true}, "times": 1}
    ]);
    assert_eq!(sink.put_faults(rules).await, 200);
    let mut at_greeting = sink.raw().await;
    assert!(at_greeting.silent().await, "no greeting while hung");

    let mut at_rcpt = sink.raw().await;
    assert!(at_rcpt.line().await.starts_with("220 "));
    at_rcpt.send("HELO t\r\nMAIL FROM:<a@b>\r\n").await;
    assert!(at_rcpt.line().await.starts_with("250 "));
    assert!(at_rcpt.line().await.starts_with("250 "));
    at_rcpt.send("RCPT TO:<c@d>\r\n").await;
    assert!(at_rcpt.silent().await, "no reply to RCPT while hung");

    sink.delete("/faults").await;
    at_rcpt.send("NOOP\r\n").await;
    assert!(at_greeting.silent().await, "a hung session stays hung");
    assert!(at_rcpt.silent().await, "a hung session stays hung");
    let mut fresh = sink.raw().await;
    assert!(
        fresh.line().await.starts_with("220 "),
        "new sessions answer"
    );
    assert_eq!(sink.stats().await["hung"], 2);
    assert_eq!(
        sink.put_faults(json!([{"stage": "rcpt", "action": {"hang": true, "delay_ms": 1}}]))
            .await,
        400
    );
}

#[tokio::test]
async fn control_api_validates_and_clears_rules() {
    let sink = Sink::spawn();
    let health = sink
        .http
        .get(format!("{}/health", sink.control))
        .send()
        .await
        .expect("GET /health");
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await.expect("body"), "ok");

    let bad = [
        json!([{"stage": "nope", "action": {"delay_ms": 1}}]),
        json!([{"stage": "rcpt", "action": {}}]),
        json!([{"stage": "rcpt", "action": {"reply": "oops"}}]),
        json!([{"stage": "rcpt", "action": {"delay_ms": 1, "drop": true}}]),
        json!({"stage": "rcpt"}),
    ];
    for rules in bad {
        assert_eq!(sink.put_faults(rules.clone()).await, 400, "{rules}");
    }

    let rules = json!([{"stage": "data_end", "action": {"drop": true}, "times": 3}]);
    assert_eq!(sink.put_faults(rules).await, 200);
    let listed = sink.get_json("/faults").await;
    assert_eq!(listed[0]["stage"], "data_end");
    assert_eq!(listed[0]["action"]["drop"], true);
    assert_eq!(listed[0]["action"]["deliver"], false);
    assert_eq!(listed[0]["times"], 3);

    sink.delete("/faults").await;
    assert_eq!(sink.get_json("/faults").await, json!([]));
    assert_eq!(
        sink.stats().await,
        json!({"accepted": 0, "connections": 0, "faults_applied": 0, "dropped": 0, "hung": 0})
    );
}

#[tokio::test]
async fn maildir_receives_eml_copies() {
    let dir: PathBuf = std::env::temp_dir().join(format!("postie-sink-{}", uuid::Uuid::new_v4()));
    let dir_arg = dir.to_str().expect("utf-8 temp path").to_owned();
    let sink = Sink::spawn_with(&["--maildir", &dir_arg]);
    send(&sink.mailer(), "m@example.net", "<eml@postie.test>")
        .await
        .expect("send");

    let raw = str_field(&sink.messages(true).await[0], "raw").to_owned();
    let written = std::fs::read_to_string(dir.join("1.eml")).expect("1.eml written");
    assert_eq!(written, raw);
    drop(sink);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pooled lettre transport for a sink started through the shared client.
fn mailer_at(addr: &str) -> AsyncSmtpTransport<Tokio1Executor> {
    let port = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("smtp port");
    AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous("127.0.0.1")
        .port(port)
        .timeout(Some(TIMEOUT))
        .build()
}

/// Asserts that a send was refused with the quota's 454 reply.
fn assert_throttled(result: &Result<(), SmtpError>, what: &str) {
    let err = result
        .as_ref()
        .expect_err(&format!("{what}: over the quota"));
    assert!(err.is_transient(), "{what}: {err}");
    assert_eq!(
        err.status().map(|c| c.to_string()).as_deref(),
        Some("454"),
        "{what}: {err}"
    );
    assert!(
        err.to_string()
            .contains("Throttling failure: Maximum sending rate exceeded."),
        "{what}: {err}"
    );
}

#[tokio::test]
async fn quota_flag_throttles_a_burst_then_admits_after_the_window() {
    let sink = sink_client::SmtpSink::start_with(&["--quota-per-second", "5"]).await;
    let mailer = mailer_at(sink.smtp_addr());

    let started = Instant::now();
    let mut results = Vec::new();
    for i in 0..20 {
        results.push(
            send(
                &mailer,
                "q@example.net",
                &format!("<burst-{i}@postie.test>"),
            )
            .await,
        );
    }
    let elapsed = started.elapsed();
    // The quota holds for any one-second window; the exact split below needs the
    // burst to fit in one (it takes a few ms per send on loopback).
    assert!(
        elapsed < Duration::from_millis(900),
        "20 sends took {elapsed:?}: too slow for one quota window"
    );
    for (i, result) in results.iter().enumerate() {
        if i < 5 {
            assert!(result.is_ok(), "send {i} within the quota: {result:?}");
        } else {
            assert_throttled(result, &format!("send {i}"));
        }
    }
    let q = sink.quota().await;
    assert_eq!(q.per_second, Some(5));
    assert_eq!(q.reply, sink_client::THROTTLE_REPLY);
    assert_eq!((q.accepted, q.throttled), (5, 15), "{q:?}");
    assert_eq!(sink.count().await, 5, "throttled messages are not recorded");

    // Once the burst's second has passed, new messages are accepted again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for i in 0..5 {
        send(
            &mailer,
            "q@example.net",
            &format!("<later-{i}@postie.test>"),
        )
        .await
        .expect("accepted in a new window");
    }

    let q = sink.quota().await;
    assert_eq!((q.accepted, q.throttled), (10, 15), "{q:?}");
    let per_second: u64 = q.accepted_per_second.iter().map(|s| s.accepted).sum();
    assert_eq!(per_second, 10, "{q:?}");
    assert!(q.busiest_second() <= 5, "{q:?}");
    assert!(
        q.accepted_per_second
            .windows(2)
            .all(|w| w[0].second < w[1].second),
        "oldest first: {q:?}"
    );
    let messages = sink.messages(false).await;
    assert_eq!(messages.len(), 10);
    assert_eq!(sink_client::busiest_window(&messages), 5);
    assert_eq!(sink.stats().await.accepted, 10);
}

#[tokio::test]
async fn quota_set_at_runtime_through_the_typed_client() {
    let sink = sink_client::SmtpSink::start().await;
    let mailer = mailer_at(sink.smtp_addr());
    let q = sink.quota().await;
    assert_eq!((q.per_second, q.accepted, q.throttled), (None, 0, 0));

    let started = Instant::now();
    for i in 0..3 {
        send(&mailer, "r@example.net", &format!("<free-{i}@postie.test>"))
            .await
            .expect("no quota");
    }
    // The three just accepted count against a quota turned on within their second.
    let q = sink.set_quota(Some(3)).await;
    assert_eq!(q.per_second, Some(3));
    let over = send(&mailer, "r@example.net", "<over@postie.test>").await;
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_millis(900),
        "4 sends took {elapsed:?}: too slow for one quota window"
    );
    assert_throttled(&over, "fourth message within a second");

    let q = sink.set_quota(None).await;
    assert_eq!(q.per_second, None);
    for i in 0..10 {
        send(&mailer, "r@example.net", &format!("<off-{i}@postie.test>"))
            .await
            .expect("quota off");
    }
    let q = sink.quota().await;
    assert_eq!((q.accepted, q.throttled), (13, 1), "{q:?}");
    assert_eq!(q.accepted, sink.stats().await.accepted);
    assert_eq!(
        q.accepted_per_second
            .iter()
            .map(|s| s.accepted)
            .sum::<u64>(),
        q.accepted
    );
}

#[tokio::test]
async fn quota_over_raw_smtp_replies_after_the_final_dot_and_keeps_the_session() {
    let sink = Sink::spawn();
    let status = sink
        .http
        .put(format!("{}/quota", sink.control))
        .json(&json!({"per_second": 1}))
        .send()
        .await
        .expect("PUT /quota")
        .status();
    assert_eq!(status, 200);

    let mut c = sink.raw().await;
    assert!(c.line().await.starts_with("220 "));
    c.send("EHLO t\r\n").await;
    assert_eq!(c.reply().await.len(), 4);
    let transaction = "MAIL FROM:<a@b>\r\nRCPT TO:<c@d>\r\nDATA\r\n";
    c.send(transaction).await;
    for _ in 0..2 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert!(c.line().await.starts_with("354 "));
    c.send("Subject: one\r\n\r\nx\r\n.\r\n").await;
    assert_eq!(c.line().await, "250 2.0.0 Ok: queued as 1");

    // The second message in the same second: MAIL, RCPT and DATA pass, the final dot
    // gets the throttling reply (as SES answers after DATA).
    c.send(transaction).await;
    for _ in 0..2 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert!(c.line().await.starts_with("354 "));
    c.send("Subject: two\r\n\r\nx\r\n.\r\n").await;
    assert_eq!(
        c.line().await,
        "454 4.7.0 Throttling failure: Maximum sending rate exceeded."
    );
    // The transaction is over, the session is not.
    c.send("RCPT TO:<c@d>\r\nNOOP\r\n").await;
    assert!(c.line().await.starts_with("503 "), "transaction ended");
    assert!(c.line().await.starts_with("250 "));

    let quota = sink.get_json("/quota").await;
    assert_eq!(quota["per_second"], 1);
    assert_eq!(quota["accepted"], 1);
    assert_eq!(quota["throttled"], 1);
    assert_eq!(quota["accepted_per_second"][0]["accepted"], 1);
    assert_eq!(sink.messages(false).await.len(), 1);

    // A custom reply; 0 throttles everything.
    let status = sink
        .http
        .put(format!("{}/quota", sink.control))
        .json(&json!({"per_second": 0, "reply": "421 4.7.0 slow down"}))
        .send()
        .await
        .expect("PUT /quota")
        .status();
    assert_eq!(status, 200);
    c.send(transaction).await;
    for _ in 0..2 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert!(c.line().await.starts_with("354 "));
    c.send("Subject: three\r\n\r\nx\r\n.\r\n").await;
    assert_eq!(c.line().await, "421 4.7.0 slow down");

    for bad in [
        json!({"per_second": -1}),
        json!({"per_second": 5, "reply": "250 2.0.0 fine"}),
        json!({"per_second": 5, "reply": "oops"}),
        json!({"per_sec": 5}),
        json!("five"),
    ] {
        let status = sink
            .http
            .put(format!("{}/quota", sink.control))
            .json(&bad)
            .send()
            .await
            .expect("PUT /quota")
            .status();
        assert_eq!(status, 400, "{bad}");
    }
    assert_eq!(sink.get_json("/quota").await["per_second"], 0, "unchanged");

    sink.delete("/quota").await;
    let quota = sink.get_json("/quota").await;
    assert!(quota["per_second"].is_null(), "{quota}");
    assert_eq!(quota["throttled"], 2, "counters carry on: {quota}");
    c.send(transaction).await;
    for _ in 0..2 {
        assert!(c.line().await.starts_with("250 "));
    }
    assert!(c.line().await.starts_with("354 "));
    c.send("Subject: four\r\n\r\nx\r\n.\r\n").await;
    assert_eq!(c.line().await, "250 2.0.0 Ok: queued as 2");
}
