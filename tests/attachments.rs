//! Attachments (issue 49) end to end: a real RabbitMQ, PostgreSQL, the SMTP test
//! server, `postie serve` processes, and the provider test server's file routes as
//! the `url` store (loopback HTTP, `GET /files/{seed}/{size}`).
//!
//! - one email with a fetched PDF (3 MB), an inline logo the HTML shows by `cid:`
//!   and a calendar invitation (`method=REQUEST`), decoded by the test from what the
//!   SMTP server received: names, types, Content-ID, and every byte (SHA-256); the
//!   same job published twice is sent once;
//! - the job's faults are dead letters whose reasons name the attachment: a 404, a
//!   digest mismatch, a file longer than its size, a size over the limit, a host not
//!   on `attachments.url_hosts`, a redirect to another host;
//! - a store that is down (10 s here, 20 s in `slow_`) is no dead letter: the job
//!   waits in the retry ladder without counting attempts and is sent once the store
//!   is back;
//! - every provider API (SES, SendGrid, Postmark, Mailgun) receives the files, read
//!   back from the MIME or the JSON the provider test server got; a 9 MB file is
//!   refused for Postmark's 10 MB limit before sending;
//! - an S3 store refusing postie's own credentials is waited out, never a dead letter;
//! - a spool file that fails to read mid-send (cut short through `/proc`), over
//!   SMTP and through SendGrid: the message or request abandoned before its end,
//!   the job waiting uncounted, then sent whole;
//! - a spool directory postie cannot write to stops start-up when files may be
//!   fetched;
//! - a small spool shared by jobs of several files: each job's room taken at once, so
//!   none waits on another's forever;
//! - each transport's own limit before anything is sent: an SMTP relay's `SIZE`, and
//!   SES's 40 MB, SendGrid's 30 MB and Mailgun's 25 MB, each a dead letter naming it;
//! - memory: each instance's peak RSS under 384 MiB with 20 MB attachments, through
//!   SMTP (3 jobs on 1 instance here; 200 jobs on 3 instances in `slow_`) and SES (2
//!   jobs here; 10 jobs of 28 MB, SES's largest, in `slow_`).
//!
//! `make bench-attachments` (ignored here): emails/s, CPU and peak RSS with 1 MB and
//! 20 MB files.

mod support;

use std::time::{Duration, Instant};

use base64::Engine as _;
use mail_parser::MimeHeaders as _;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use support::bench::peak_rss_kib;
use support::moto::Moto;
use support::providers::{file_bytes, ProviderServer};
use support::{job, TestEnv};

const WAIT: Duration = Duration::from_secs(90);
/// The bound the issue sets on each instance's peak resident set.
const PEAK_RSS_MIB: u64 = 384;

/// Settings: `url` sources from `localhost` (the provider server's files), which is
/// a private address, so allowed here.
const FETCHING: &[(&str, &str)] = &[
    ("POSTIE__ATTACHMENTS__URL_HOSTS", "localhost"),
    ("POSTIE__ATTACHMENTS__ALLOW_PRIVATE_ADDRESSES", "true"),
];

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// An attachment of `bytes` inline.
fn inline(name: &str, content_type: &str, bytes: &[u8]) -> Value {
    json!({
        "filename": name, "content_type": content_type, "size": bytes.len(),
        "sha256": sha256_hex(bytes),
        "source": {"inline": base64::engine::general_purpose::STANDARD.encode(bytes)},
    })
}

/// An attachment fetched from `url`, said to be the server's file `seed` of `size`.
fn fetched(name: &str, url: &str, seed: u64, size: u64) -> Value {
    json!({
        "filename": name, "content_type": "application/pdf", "size": size,
        "sha256": sha256_hex(&file_bytes(seed, size)),
        "source": {"url": url},
    })
}

fn with_attachments(key: &str, attachments: Vec<Value>) -> Value {
    let mut body = job(key, "ann@example.com");
    body["attachments"] = Value::Array(attachments);
    body
}

/// Dead letters' reasons, until there are `n` (or `WAIT` passes).
async fn reasons(env: &TestEnv, n: usize) -> Vec<String> {
    let mut reasons = Vec::new();
    let deadline = Instant::now() + WAIT;
    while reasons.len() < n && Instant::now() < deadline {
        reasons.extend(env.dead_reasons().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    reasons
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_arrives_byte_for_byte_over_smtp() {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_settings("att-sources", FETCHING).await;
    let postie = env.spawn_process(&[]);
    let pdf_size = 3_000_000;
    let logo = b"\x89PNG\r\n\x1a\n a small logo".to_vec();
    let invite = b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nMETHOD:REQUEST\r\nBEGIN:VEVENT\r\n\
                   UID:42@shop.example\r\nDTSTART:20270101T100000Z\r\nSUMMARY:Pick-up\r\n\
                   END:VEVENT\r\nEND:VCALENDAR\r\n"
        .to_vec();
    let mut logo_part = inline("logo.png", "image/png", &logo);
    logo_part["disposition"] = json!("inline");
    logo_part["content_id"] = json!("logo@shop");
    let mut body = with_attachments(
        "att-1",
        vec![
            fetched(
                "Rechnung März.pdf",
                &files.file_url("localhost", 1, pdf_size),
                1,
                pdf_size,
            ),
            logo_part,
            inline(
                "invite.ics",
                "text/calendar; method=REQUEST; charset=UTF-8",
                &invite,
            ),
        ],
    );
    body["html"] = json!("<p><img src=\"cid:logo@shop\"> Your invoice.</p>");
    env.publish(&body).await;
    env.publish(&body).await;
    env.wait_for_status("att-1", "sent", WAIT).await;

    let raw = env.email_of("att-1").await.into_bytes();
    let parsed = mail_parser::MessageParser::default()
        .parse(&raw)
        .expect("a MIME message");
    let parts: Vec<_> = parsed.attachments().collect();
    assert_eq!(parts.len(), 3, "three files");
    let part = |name: &str| {
        parts
            .iter()
            .find(|p| p.attachment_name() == Some(name))
            .unwrap_or_else(|| panic!("no part named {name}"))
    };
    let pdf = part("Rechnung März.pdf");
    assert_eq!(
        sha256_hex(pdf.contents()),
        sha256_hex(&file_bytes(1, pdf_size))
    );
    assert_eq!(pdf.content_type().unwrap().subtype(), Some("pdf"));
    assert!(pdf.content_disposition().unwrap().is_attachment());
    let got_logo = part("logo.png");
    assert_eq!(got_logo.contents(), &logo[..]);
    assert_eq!(got_logo.content_id(), Some("logo@shop"));
    assert!(got_logo.content_disposition().unwrap().is_inline());
    let ics = part("invite.ics");
    assert_eq!(ics.contents(), &invite[..]);
    let calendar = ics.content_type().unwrap();
    assert_eq!(
        (calendar.ctype(), calendar.subtype()),
        ("text", Some("calendar"))
    );
    assert_eq!(calendar.attribute("method"), Some("REQUEST"));
    assert!(parsed.body_html(0).unwrap().contains("cid:logo@shop"));
    assert!(
        raw.split(|b| *b == b'\n').all(|line| line.len() <= 78),
        "no line over 76 characters and its CRLF"
    );

    // The second publish of the same key found it sent.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.get(&support::message_id("att-1")), Some(&1));
    drop(postie);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_faults_are_dead_letters_naming_the_attachment() {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_settings("att-faults", FETCHING).await;
    let _postie = env.spawn_process(&[]);
    let port = files.api_addr().rsplit(':').next().unwrap().to_string();
    let local = |path: &str| format!("http://localhost:{port}{path}");
    let elsewhere = format!("http://127.0.0.1:{port}/files/2/100");
    let cases = [
        (
            "f-404",
            fetched("missing.pdf", &local("/files/missing"), 2, 100),
            "attachments[0] (\"missing.pdf\"): http://localhost:",
            "answered 404",
        ),
        (
            "f-digest",
            fetched("bent.pdf", &local("/files/2/100?corrupt=true"), 2, 100),
            "attachments[0] (\"bent.pdf\")",
            "SHA-256 is not its sha256",
        ),
        (
            "f-longer",
            fetched("long.pdf", &local("/files/3/200"), 3, 100),
            "attachments[0] (\"long.pdf\")",
            "longer than its size (100 bytes)",
        ),
        (
            "f-host",
            fetched("other.pdf", &elsewhere, 2, 100),
            "attachments[0] (\"other.pdf\")",
            "is not on attachments.url_hosts",
        ),
        (
            "f-redirect",
            fetched(
                "moved.pdf",
                &local(&format!("/redirect?to={elsewhere}")),
                2,
                100,
            ),
            "attachments[0] (\"moved.pdf\")",
            "redirected to http://127.0.0.1:",
        ),
        (
            "f-big",
            fetched("huge.pdf", &local("/files/4/100"), 4, 30 * 1024 * 1024),
            "attachments[0] (\"huge.pdf\") is 31457280 bytes",
            "over the limit of 20971520 per file",
        ),
    ];
    for (key, attachment, _, _) in &cases {
        env.publish(&with_attachments(key, vec![attachment.clone()]))
            .await;
    }
    let reasons = reasons(&env, cases.len()).await;
    for (key, _, names, why) in &cases {
        assert!(
            reasons.iter().any(|r| r.contains(names) && r.contains(why)),
            "{key}: no dead letter with {names:?} and {why:?} in {reasons:#?}"
        );
    }
    assert_eq!(reasons.len(), cases.len(), "{reasons:#?}");
    assert!(
        reasons
            .iter()
            .all(|r| !r.contains("?corrupt") && !r.contains("?to=")),
        "a URL's query is never shown: {reasons:#?}"
    );
    assert_eq!(env.sink.stats().await.accepted, 0, "nothing was sent");
}

/// The files of a provider's request: (name, bytes), from the MIME (SES, Mailgun) or
/// the JSON's base64 (SendGrid `attachments`, Postmark `Attachments`).
fn files_in(provider: &str, raw: &str) -> Vec<(String, Vec<u8>, Option<String>)> {
    let decode = |v: &Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
    };
    let text = |v: &Value| v.as_str().map(str::to_string);
    match provider {
        "sendgrid" | "postmark" => {
            let json: Value = serde_json::from_str(raw).expect("the request's JSON");
            let (list, name, content, cid) = if provider == "sendgrid" {
                ("attachments", "filename", "content", "content_id")
            } else {
                ("Attachments", "Name", "Content", "ContentID")
            };
            json[list]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| (text(&f[name]).unwrap(), decode(&f[content]), text(&f[cid])))
                .collect()
        }
        _ => {
            let parsed = mail_parser::MessageParser::default()
                .parse(raw.as_bytes())
                .expect("a MIME message");
            parsed
                .attachments()
                .map(|p| {
                    let name = p.attachment_name().unwrap().to_string();
                    (
                        name,
                        p.contents().to_vec(),
                        p.content_id().map(str::to_string),
                    )
                })
                .collect()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_provider_api_receives_the_files() {
    let server = ProviderServer::start().await;
    let env = TestEnv::with_settings("att-providers", FETCHING).await;
    let size = 1_000_000;
    let logo = b"\x89PNG\r\n\x1a\n logo".to_vec();
    for provider in ["ses", "sendgrid", "postmark", "mailgun"] {
        let mut settings = env.settings();
        settings.transport.url = Some(server.url(provider).into());
        let serving = env.serve(settings);
        let key = format!("p-{provider}");
        let mut logo_part = inline("logo.png", "image/png", &logo);
        logo_part["disposition"] = json!("inline");
        logo_part["content_id"] = json!("logo@shop");
        let url = server.file_url("localhost", 21, size);
        let mut body = with_attachments(
            &key,
            vec![fetched("invoice.pdf", &url, 21, size), logo_part],
        );
        body["html"] = json!("<img src=\"cid:logo@shop\">");
        env.publish(&body).await;
        // Over Postmark's 10 MB: refused before sending, on that provider only.
        let over = format!("over-{provider}");
        let big = server.file_url("localhost", 22, 9_000_000);
        env.publish(&with_attachments(
            &over,
            vec![fetched("big.pdf", &big, 22, 9_000_000)],
        ))
        .await;
        env.wait_for_status(&key, "sent", WAIT).await;
        if provider == "postmark" {
            let why = reasons(&env, 1).await;
            assert!(
                why.iter()
                    .any(|r| r.contains("over Postmark's 10 MB message limit")),
                "{why:?}"
            );
        } else {
            env.wait_for_status(&over, "sent", WAIT).await;
        }
        serving.stop().await;
        let raw = &server.raw_of(&key).await;
        let files = files_in(provider, raw);
        assert_eq!(files.len(), 2, "{provider}");
        let pdf = files.iter().find(|f| f.0 == "invoice.pdf").unwrap();
        assert_eq!(
            sha256_hex(&pdf.1),
            sha256_hex(&file_bytes(21, size)),
            "{provider}"
        );
        let got_logo = files.iter().find(|f| f.0 == "logo.png").unwrap();
        assert_eq!(got_logo.1, logo, "{provider}");
        let cid = got_logo.2.as_deref().unwrap_or("");
        assert!(cid.ends_with("logo@shop"), "{provider}: {cid:?}");
    }
}

/// Settings for files up to 32 MiB (each transport's limit is then what refuses).
fn large_files_allowed() -> Vec<(&'static str, &'static str)> {
    let mut settings = FETCHING.to_vec();
    settings.push(("POSTIE__ATTACHMENTS__MAX_FILE_BYTES", "33554432"));
    settings.push(("POSTIE__ATTACHMENTS__MAX_TOTAL_BYTES", "33554432"));
    settings
}

/// An SMTP relay's `SIZE` (the test server advertising 1 MB) is checked before MAIL
/// FROM: an email with a 2 MB file is a dead letter saying so, and the relay never
/// sees it; one with a 100 KB file goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_email_over_the_relay_s_size_is_a_dead_letter_before_mail_from() {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_sink_and_settings("att-size", &["--size", "1000000"], FETCHING).await;
    let _postie = env.spawn_process(&[]);
    for (key, seed, size) in [("s-big", 51, 2_000_000), ("s-small", 52, 100_000)] {
        let url = files.file_url("localhost", seed, size);
        let body = with_attachments(key, vec![fetched("file.pdf", &url, seed, size)]);
        env.publish(&body).await;
    }
    env.wait_for_status("s-small", "sent", WAIT).await;
    let why = reasons(&env, 1).await;
    assert!(
        why.iter()
            .any(|r| r.contains("over the relay's SIZE limit of 1000000")),
        "{why:?}"
    );
    let big = support::message_id("s-big");
    let got = env.sink.messages(false).await;
    assert!(got.iter().all(|m| m.message_id != big), "the relay got it");
    assert_eq!(got.len(), 1, "only the small one");
}

/// SES's 40 MB a message as sent, SendGrid's 30 MB and Mailgun's 25 MB a request
/// (Postmark's 10 MB: `every_provider_api_receives_the_files`) are checked before the
/// request: a file whose email is just over each is a dead letter naming the limit,
/// and the provider never receives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_email_over_a_provider_s_limit_is_a_dead_letter_before_the_request() {
    let server = ProviderServer::start().await;
    let env = TestEnv::with_settings("att-limits", &large_files_allowed()).await;
    let cases = [
        ("ses", 30_000_000, "over SES's limit of 40000000"),
        (
            "sendgrid",
            23_000_000,
            "over SendGrid's 30 MB request limit",
        ),
        ("mailgun", 19_000_000, "over Mailgun's 25 MB message limit"),
    ];
    for (seed, (provider, size, reason)) in (61..).zip(cases) {
        let mut settings = env.settings();
        settings.transport.url = Some(server.url(provider).into());
        let serving = env.serve(settings);
        let key = format!("l-{provider}");
        let url = server.file_url("localhost", seed, size);
        env.publish(&with_attachments(
            &key,
            vec![fetched("big.pdf", &url, seed, size)],
        ))
        .await;
        let why = reasons(&env, 1).await;
        serving.stop().await;
        assert!(
            why.iter().any(|r| r.contains(reason)),
            "{provider}: {why:?}"
        );
        let id = support::message_id(&key);
        let got = server.messages(false).await;
        assert!(got.iter().all(|m| m.message_id != id), "{provider} got it");
    }
}

/// A store that refuses postie's own credentials (S3's 403 `InvalidAccessKeyId`, as
/// moto answers once it checks them) is the operator's to mend, not the job's fault:
/// the job waits in the ladder, no dead letter, the log naming the code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_store_refusing_postie_s_credentials_is_waited_out_not_dead_lettered() {
    // Two requests without checks: the bucket and the object.
    let moto = Moto::start_checking_credentials_after(2).await;
    moto.bucket("invoices").await;
    moto.put("invoices", "1042.pdf", file_bytes(33, 1_000))
        .await;
    let (env, postie) = reading_invoices("att-s3-creds", &moto, "postie-unknown").await;
    let object = from_s3("invoice.pdf", "invoices", "1042.pdf", 33, 1_000);
    env.publish(&with_attachments("s3-creds", vec![object]))
        .await;
    // The ladder (1 s, 2 s, 5 s) dead-letters a counted failure after four attempts.
    support::eventually("five waits", WAIT, || async {
        let log = postie.log();
        (log.matches("an attachment is unavailable (its store")
            .count()
            >= 5)
            .then_some(())
    })
    .await;
    let log = postie.log();
    assert!(
        log.contains("the store refused postie's credentials (InvalidAccessKeyId)"),
        "{log}"
    );
    assert!(
        !log.contains("postie-test-secret"),
        "the secret is never logged"
    );
    assert!(env.dead_reasons().await.is_empty(), "no dead letter");
    assert_eq!(env.sink.stats().await.accepted, 0);
}

/// The spool's budget is taken for all of a job's files at once: with room for one
/// and a half jobs (3 MiB; each job two 1 MB files), twelve jobs waiting together all
/// go. Taken file by file, three jobs would each hold one file's room and wait for a
/// second forever, and with them every send slot they held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_several_files_share_a_small_spool_without_waiting_on_each_other() {
    let files = ProviderServer::start().await;
    let mut settings = FETCHING.to_vec();
    settings.extend([
        ("POSTIE__ATTACHMENTS__MAX_FILE_BYTES", "2097152"),
        ("POSTIE__ATTACHMENTS__MAX_TOTAL_BYTES", "2097152"),
        ("POSTIE__ATTACHMENTS__INFLIGHT_BYTES", "3145728"),
    ]);
    let env = TestEnv::with_settings("att-spool", &settings).await;
    let size = 1_000_000;
    let bodies: Vec<Value> = (0..12u64)
        .map(|i| {
            let (a, b) = (100 + 2 * i, 101 + 2 * i);
            let parts = vec![
                fetched("one.pdf", &files.file_url("localhost", a, size), a, size),
                fetched("two.pdf", &files.file_url("localhost", b, size), b, size),
            ];
            with_attachments(&format!("sp-{i}"), parts)
        })
        .collect();
    env.publish_many(&bodies).await;
    let _postie = env.spawn_process(&[]);
    env.wait_for_emails("the twelve emails", 12, WAIT).await;
    for i in 0..12 {
        env.wait_for_status(&format!("sp-{i}"), "sent", WAIT).await;
    }
    assert!(env.dead_reasons().await.is_empty(), "no dead letter");
}

/// A spool directory of the test's own (postie's files in it are unlinked; the
/// test finds them through `/proc`).
fn spool_dir() -> std::path::PathBuf {
    let spool = std::env::temp_dir().join(format!(
        "postie-spool-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&spool).unwrap();
    spool
}

/// A world for a test of a spool that fails mid-send: a spool directory of its own,
/// and a transport timeout longer than the test server holds the send (4 s), the
/// window in which the test cuts the file.
async fn failing_spool(name: &str) -> (TestEnv, std::path::PathBuf) {
    let spool = spool_dir();
    let dir = spool.to_string_lossy().into_owned();
    let mut settings = FETCHING.to_vec();
    settings.extend([
        ("POSTIE__ATTACHMENTS__SPOOL_DIR", dir.as_str()),
        ("POSTIE__TRANSPORT__TIMEOUT", "10s"),
        ("POSTIE__WORKER__LEASE", "60s"),
    ]);
    (TestEnv::with_settings(name, &settings).await, spool)
}

/// Publishes `key` with one fetched file (`url`, the file server's `seed`, `size`
/// bytes) and cuts postie's (`postie`) spool file short, to nothing, once it holds
/// all of it (fetched whole, its hash checked as it came): a disk failing under it.
async fn publish_and_cut_the_spool_file(
    env: &TestEnv,
    postie: &support::PostieProcess,
    spool: &std::path::Path,
    key: &str,
    (url, seed, size): (&str, u64, u64),
) {
    env.publish(&with_attachments(
        key,
        vec![fetched("statement.pdf", url, seed, size)],
    ))
    .await;
    let fds = format!("/proc/{}/fd", postie.child.id());
    support::eventually("the spool file, fetched", WAIT, || async {
        let entries = std::fs::read_dir(&fds).ok()?;
        entries.flatten().find_map(|entry| {
            let target = std::fs::read_link(entry.path()).ok()?;
            let whole = std::fs::metadata(entry.path()).ok()?.len() == size;
            (target.starts_with(spool) && whole).then(|| {
                let file = std::fs::OpenOptions::new().write(true).open(entry.path());
                file.and_then(|f| f.set_len(0))
                    .expect("truncating the spool file");
            })
        })
    })
    .await;
}

/// What a send abandoned on the spool leaves: the job `key` sent at last without a
/// counted attempt, no dead letter, and the log naming the spool.
async fn waited_uncounted(env: &TestEnv, postie: &support::PostieProcess, key: &str) {
    env.wait_for_status(key, "sent", WAIT).await;
    let log = postie.log();
    assert!(log.contains("reading the spooled attachment"), "{log}");
    assert!(
        log.contains("an attachment is unavailable (its store"),
        "{log}"
    );
    let row = env.inbox_row(key).await.expect("an inbox row");
    assert_eq!(row.attempts, 1, "the abandoned send counted no attempt");
    assert!(env.dead_reasons().await.is_empty(), "no dead letter");
}

/// A spool file that can no longer be read while its email is sent (a disk fault;
/// here the test truncates postie's unlinked spool file through `/proc` while the
/// relay holds its reply to `DATA`): the message is abandoned before its final dot,
/// so the relay takes nothing, and the job waits in the retry ladder without counting
/// an attempt, then goes whole with its file fetched again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_failing_mid_send_abandons_the_message_and_waits_uncounted() {
    let files = ProviderServer::start().await;
    let (env, spool) = failing_spool("att-spool-fault").await;
    env.sink
        .set_faults(json!([{"stage": "data", "action": {"delay_ms": 4000}, "times": 1}]))
        .await;
    let postie = env.spawn_process(&[]);
    let size = 1_000_000;
    let url = files.file_url("localhost", 77, size);
    publish_and_cut_the_spool_file(&env, &postie, &spool, "spool-1", (&url, 77, size)).await;
    waited_uncounted(&env, &postie, "spool-1").await;
    let messages = env.sink.messages(true).await;
    assert_eq!(messages.len(), 1, "the relay took only the whole email");
    let raw = env.email_of("spool-1").await.into_bytes();
    let parsed = mail_parser::MessageParser::default()
        .parse(&raw)
        .expect("a MIME message");
    let part = parsed.attachments().next().expect("the file");
    assert_eq!(
        sha256_hex(part.contents()),
        sha256_hex(&file_bytes(77, size))
    );
    drop(postie);
    let _ = std::fs::remove_dir_all(&spool);
}

/// The same through a provider's API (SendGrid, files in the JSON): the provider
/// test server leaves the request's body unread for 4 s, so a 20 MB file's body
/// stalls in the socket, and the test cuts the file meanwhile. The request breaks
/// off short of its `Content-Length`: the provider takes nothing, the send is not
/// uncertain, and the job waits uncounted, then goes whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_failing_mid_request_abandons_it_and_waits_uncounted() {
    let server = ProviderServer::start().await;
    let (env, spool) = failing_spool("att-spool-api").await;
    server
        .set_faults(json!([{"provider": "sendgrid", "action": {"slow_read_ms": 4000}, "times": 1}]))
        .await;
    let sendgrid = server.url("sendgrid");
    let postie = env.spawn_process(&[("POSTIE__TRANSPORT__URL", sendgrid.as_str())]);
    let size = 20_000_000;
    let url = server.file_url("localhost", 78, size);
    publish_and_cut_the_spool_file(&env, &postie, &spool, "spool-api", (&url, 78, size)).await;
    waited_uncounted(&env, &postie, "spool-api").await;
    let log = postie.log();
    assert!(
        log.contains("the request was abandoned before its end"),
        "{log}"
    );
    assert_eq!(server.messages(false).await.len(), 1, "one request taken");
    let files = files_in("sendgrid", &server.raw_of("spool-api").await);
    assert_eq!(files.len(), 1);
    assert_eq!(sha256_hex(&files[0].1), sha256_hex(&file_bytes(78, size)));
    drop(postie);
    let _ = std::fs::remove_dir_all(&spool);
}

/// A spool directory postie cannot write to stops `postie serve` with one line
/// naming it, when files may be fetched; with nothing to fetch it is never used, and
/// postie serves (inline files only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_that_cannot_take_a_file_stops_start_up() {
    let env = TestEnv::with_settings("att-spool-missing", FETCHING).await;
    let missing = std::env::temp_dir().join(format!("postie-no-such-dir-{}", std::process::id()));
    let dir = missing.to_string_lossy().into_owned();
    let mut postie = env.spawn_process(&[("POSTIE__ATTACHMENTS__SPOOL_DIR", dir.as_str())]);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = postie.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < WAIT,
            "postie still runs:\n{}",
            postie.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success());
    let log = postie.log();
    let said: Vec<&str> = log.lines().filter(|l| l.contains("spool_dir")).collect();
    assert_eq!(
        said,
        [format!(
            "postie: attachments.spool_dir ({dir}): cannot create a spool file there: \
             No such file or directory (os error 2)"
        )],
        "{log}"
    );
    // Nothing to fetch: the spool is never used, and postie serves.
    drop(env);
    let env = TestEnv::with_settings(
        "att-spool-unused",
        &[("POSTIE__ATTACHMENTS__SPOOL_DIR", dir.as_str())],
    )
    .await;
    let serving = env.spawn_process(&[]);
    env.publish(&job("no-files", "bob@example.com")).await;
    env.wait_for_status("no-files", "sent", WAIT).await;
    drop(serving);
}

/// The core's takeover rule holds with attachments: one of two instances is killed
/// (SIGKILL) mid-run; every job is sent, and an email sent twice is only ever one
/// whose claim was taken over after the killed instance's lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_s_jobs_are_taken_over_and_sent() {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_settings("att-takeover", FETCHING).await;
    let mut first = env.spawn_process(&[]);
    let second = env.spawn_process(&[]);
    let (n, size) = (30, 2_000_000);
    let url = files.file_url("localhost", 41, size);
    let bodies: Vec<Value> = (0..n)
        .map(|i| with_attachments(&format!("take-{i}"), vec![fetched("t.pdf", &url, 41, size)]))
        .collect();
    env.publish_many(&bodies).await;
    support::eventually("the first emails", WAIT, || async {
        (env.sink.count().await >= 5).then_some(())
    })
    .await;
    first.kill9();
    support::eventually("every job sent", WAIT * 2, || async {
        (env.inbox_count("status = 'sent'").await as usize >= n).then_some(())
    })
    .await;
    let per_id = env.emails_per_id().await;
    assert_eq!(per_id.len(), n, "every job reached the relay");
    let taken_over = env.taken_over_ids().await;
    for (id, count) in &per_id {
        assert!(
            *count == 1 || taken_over.contains(id),
            "{id} sent {count} times without a takeover"
        );
    }
    drop(second);
}

/// An attachment from an S3 object, said to be the provider server's file `seed`.
/// A world whose postie reads the bucket `invoices` (only) of `moto`, with the
/// access key `access_key` and the secret `postie-test-secret`.
async fn reading_invoices(
    name: &str,
    moto: &Moto,
    access_key: &str,
) -> (TestEnv, support::PostieProcess) {
    let endpoint = moto.endpoint();
    let env = TestEnv::with_settings(
        name,
        &[
            ("POSTIE__ATTACHMENTS__S3__BUCKETS", "invoices"),
            ("POSTIE__ATTACHMENTS__S3__REGION", "eu-west-1"),
            ("POSTIE__ATTACHMENTS__S3__ENDPOINT", &endpoint),
        ],
    )
    .await;
    let postie = env.spawn_process(&[
        ("AWS_ACCESS_KEY_ID", access_key),
        ("AWS_SECRET_ACCESS_KEY", "postie-test-secret"),
    ]);
    (env, postie)
}

fn from_s3(name: &str, bucket: &str, key: &str, seed: u64, size: u64) -> Value {
    json!({
        "filename": name, "content_type": "application/pdf", "size": size,
        "sha256": sha256_hex(&file_bytes(seed, size)),
        "source": {"s3": {"bucket": bucket, "key": key}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_object_is_read_with_postie_s_credentials_and_sent() {
    let moto = Moto::start().await;
    moto.bucket("invoices").await;
    moto.bucket("payroll").await;
    let size = 700_000;
    moto.put("invoices", "2026/1042.pdf", file_bytes(31, size))
        .await;
    moto.put("payroll", "salaries.pdf", file_bytes(32, 100))
        .await;
    let (env, _postie) = reading_invoices("att-s3", &moto, "postie-test").await;
    let object = from_s3("invoice-1042.pdf", "invoices", "2026/1042.pdf", 31, size);
    env.publish(&with_attachments("s3-1", vec![object])).await;
    let missing = from_s3("gone.pdf", "invoices", "2026/0000.pdf", 31, size);
    env.publish(&with_attachments("s3-missing", vec![missing]))
        .await;
    let other = from_s3("salaries.pdf", "payroll", "salaries.pdf", 32, 100);
    env.publish(&with_attachments("s3-other-bucket", vec![other]))
        .await;
    env.wait_for_status("s3-1", "sent", WAIT).await;
    let raw = env.email_of("s3-1").await;
    let files = files_in("ses", &raw);
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].0, "invoice-1042.pdf");
    assert_eq!(sha256_hex(&files[0].1), sha256_hex(&file_bytes(31, size)));
    let reasons = reasons(&env, 2).await;
    for (name, why) in [
        ("gone.pdf", "s3://invoices/2026/0000.pdf does not exist"),
        (
            "salaries.pdf",
            "s3 bucket \"payroll\" is not on attachments.s3.buckets",
        ),
    ] {
        assert!(
            reasons
                .iter()
                .any(|r| r.contains(&format!("(\"{name}\")")) && r.contains(why)),
            "{name}: {reasons:#?}"
        );
    }
    assert_eq!(
        env.sink.stats().await.accepted,
        1,
        "only the allowed object"
    );
}

/// The store goes down for `down`, a job needing it is published, and it is sent once
/// the store is back: no dead letter, however long the outage.
async fn store_down_for(name: &str, down: u64) {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_settings(name, FETCHING).await;
    let metrics = support::free_port();
    let listen = format!("127.0.0.1:{metrics}");
    let postie = env.spawn_process(&[("POSTIE__HTTP__LISTEN", &listen)]);
    let ready = format!("http://{listen}/readyz");
    support::eventually("postie ready", WAIT, || async {
        (support::http_get(&ready).await.0 == 200).then_some(())
    })
    .await;
    files.go_down(down).await;
    let went_down = Instant::now();
    let url = files.file_url("localhost", 5, 50_000);
    env.publish(&with_attachments(
        "down-1",
        vec![fetched("later.pdf", &url, 5, 50_000)],
    ))
    .await;
    // While the store is down: postie stays ready (the transport's breaker and
    // readiness are not the store's), and other jobs are sent.
    env.publish(&job("down-other", "bob@example.com")).await;
    env.wait_for_status("down-other", "sent", WAIT).await;
    assert!(
        went_down.elapsed() < Duration::from_secs(down),
        "a job without attachments went while the store was down"
    );
    let (status, body) = support::http_get(&ready).await;
    assert_eq!(status, 200, "ready while the store is down: {body}");
    env.wait_for_status("down-1", "sent", WAIT + Duration::from_secs(down))
        .await;
    assert!(
        went_down.elapsed() >= Duration::from_secs(down),
        "sent only after the store came back"
    );
    assert!(
        env.dead_reasons().await.is_empty(),
        "an outage is no dead letter"
    );
    let row = env.inbox_row("down-1").await.expect("an inbox row");
    assert_eq!(row.status, "sent");
    assert_eq!(row.attempts, 1, "the waits recorded no SMTP attempt");
    let log = postie.log();
    let waits = log
        .matches("an attachment is unavailable (its store")
        .count();
    // The ladder (1 s, 2 s, 5 s) would have dead-lettered a counted transient
    // failure after four attempts, within about 8 s.
    assert!(waits >= 3, "waited {waits} times:\n{log}");
    assert!(
        log.contains("attachments[0] (\\\"later.pdf\\\"): fetching")
            || log.contains("attachments[0] (\"later.pdf\"): fetching"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_for_10s_delays_the_job_and_dead_letters_nothing() {
    store_down_for("att-down", 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_store_down_for_20s_delays_the_job_and_dead_letters_nothing() {
    store_down_for("att-down-slow", 20).await;
}

/// `jobs` jobs, each with one attachment of `size` bytes, through `instances`
/// instances sending to `transport` (`smtp`, or `ses` on the provider test server):
/// all sent once, and each instance's peak RSS under [`PEAK_RSS_MIB`].
async fn large_files(name: &str, transport: &str, jobs: usize, instances: usize, size: u64) {
    let server = ProviderServer::start_with(&["--keep-bytes", "4096"]).await;
    let limit = size.to_string();
    let mut settings = FETCHING.to_vec();
    settings.push(("POSTIE__ATTACHMENTS__MAX_FILE_BYTES", &limit));
    settings.push(("POSTIE__ATTACHMENTS__MAX_TOTAL_BYTES", &limit));
    let env = TestEnv::with_sink_and_settings(name, &["--keep-bytes", "4096"], &settings).await;
    let ses = server.url("ses");
    let extra: Vec<(&str, &str)> = match transport {
        "ses" => vec![("POSTIE__TRANSPORT__URL", ses.as_str())],
        _ => vec![],
    };
    let postie: Vec<_> = (0..instances).map(|_| env.spawn_process(&extra)).collect();
    let url = server.file_url("localhost", 9, size);
    let attachment = fetched("big.pdf", &url, 9, size);
    let bodies: Vec<Value> = (0..jobs)
        .map(|i| with_attachments(&format!("big-{i}"), vec![attachment.clone()]))
        .collect();
    let started = Instant::now();
    env.publish_many(&bodies).await;
    let ids: Vec<String> = if transport == "ses" {
        support::eventually("the emails through SES", WAIT * 4, || async {
            let ids: Vec<String> = server
                .messages(false)
                .await
                .into_iter()
                .map(|m| m.message_id)
                .collect();
            (ids.len() >= jobs).then_some(ids)
        })
        .await
    } else {
        env.wait_for_emails("the emails", jobs, WAIT * 4).await;
        let messages = env.sink.messages(false).await;
        let encoded = size * 4 / 3;
        assert!(
            messages.iter().all(|m| m.size as u64 > encoded),
            "each carries its file, encoded"
        );
        messages.into_iter().map(|m| m.message_id).collect()
    };
    let took = started.elapsed();
    let distinct: std::collections::BTreeSet<&String> = ids.iter().collect();
    let logs: String = postie.iter().map(|p| p.log()).collect();
    let notes: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .take(20)
        .collect();
    assert_eq!(
        (distinct.len(), ids.len()),
        (jobs, jobs),
        "each sent once\n{notes:#?}"
    );
    let peaks: Vec<u64> = postie
        .iter()
        .map(|p| peak_rss_kib(p.child.id()) / 1024)
        .collect();
    println!(
        "FIGURES attachments: {jobs} jobs x {} MB through {transport} on {instances} instance(s) in {:.1} s; \
         peak RSS per instance (MiB): {peaks:?}",
        size / 1_000_000,
        took.as_secs_f64()
    );
    assert!(
        peaks.iter().all(|p| *p > 0 && *p <= PEAK_RSS_MIB),
        "peak RSS over {PEAK_RSS_MIB} MiB: {peaks:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_20mb_attachments_stream_through_smtp_in_bounded_memory() {
    large_files("att-mem", "smtp", 3, 1, 20_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_20mb_attachments_stream_through_ses_in_bounded_memory() {
    large_files("att-mem-ses", "ses", 2, 1, 20_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_two_hundred_20mb_attachments_through_ses_on_three_instances_in_bounded_memory() {
    large_files("att-mem-ses-200", "ses", 200, 3, 20_000_000).await;
}

/// SES takes at most 40 MB a message as sent, so its largest file is 28 MB (37.3 MB
/// once encoded, with the rest of the email).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_ten_28mb_attachments_through_ses_in_bounded_memory() {
    large_files("att-mem-ses-slow", "ses", 10, 1, 28_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_two_hundred_20mb_attachments_on_three_instances_in_bounded_memory() {
    large_files("att-mem-slow", "smtp", 200, 3, 20_000_000).await;
}

/// One benchmark run: `n` jobs with one attachment of `size` bytes, pre-published,
/// drained by one `postie serve` process: (emails/s, postie CPU ms per email, peak
/// RSS MiB).
async fn bench_run(label: &str, transport: &str, n: usize, size: u64) -> (f64, f64, u64) {
    let files = ProviderServer::start().await;
    let env = TestEnv::with_sink_and_settings(
        &format!("att-bench-{}", size >> 20),
        &["--keep-bytes", "4096"],
        FETCHING,
    )
    .await;
    let url = files.file_url("localhost", 11, size);
    let attachment = fetched("bench.pdf", &url, 11, size);
    let bodies: Vec<Value> = (0..n)
        .map(|i| with_attachments(&format!("bench-{i}"), vec![attachment.clone()]))
        .collect();
    env.publish_many(&bodies).await;
    let mut extra = support::bench::extra_postie_env();
    if transport == "ses" {
        extra.push(("POSTIE__TRANSPORT__URL".into(), files.url("ses")));
    }
    let extra: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let started = Instant::now();
    let postie = env.spawn_process(&extra);
    if transport == "ses" {
        support::eventually(label, WAIT * 10, || async {
            (files.stats().await.accepted as usize >= n).then_some(())
        })
        .await;
    } else {
        env.wait_for_emails(label, n, WAIT * 10).await;
    }
    let took = started.elapsed().as_secs_f64();
    let pid = postie.child.id();
    let (cpu, peak) = (support::bench::cpu_seconds(pid), peak_rss_kib(pid) / 1024);
    let sent = if transport == "ses" {
        let ids: std::collections::BTreeSet<String> = files
            .messages(false)
            .await
            .into_iter()
            .map(|m| m.message_id)
            .collect();
        ids.len()
    } else {
        env.emails_per_id().await.len()
    };
    assert_eq!(sent, n, "each sent once");
    let row = (n as f64 / took, cpu * 1000.0 / n as f64, peak);
    println!(
        "{label}: {n} emails in {took:.1} s: {:.1} emails/s, postie {:.1} CPU ms/email, peak RSS {} MiB",
        row.0, row.1, row.2
    );
    row
}

/// `make bench-attachments`: emails with a 1 MB and a 20 MB attachment through SMTP
/// and SES, each A B B A (POSTIE_BENCH_N jobs of 1 MB, a tenth as many of 20 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-attachments"]
async fn bench_attachments() {
    let n = support::bench::env_usize("POSTIE_BENCH_N", 200);
    let runs = [
        ("smtp, 1 MB", "smtp", n, 1_000_000),
        ("smtp, 20 MB", "smtp", n / 10, 20_000_000),
        ("smtp, 20 MB", "smtp", n / 10, 20_000_000),
        ("smtp, 1 MB", "smtp", n, 1_000_000),
        ("ses, 1 MB", "ses", n, 1_000_000),
        ("ses, 20 MB", "ses", n / 10, 20_000_000),
        ("ses, 20 MB", "ses", n / 10, 20_000_000),
        ("ses, 1 MB", "ses", n, 1_000_000),
    ];
    for (label, transport, n, size) in runs {
        bench_run(label, transport, n, size).await;
    }
}
