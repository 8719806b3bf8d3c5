//! One-click unsubscribe (issue 50, RFC 8058) end to end: a real RabbitMQ, PostgreSQL,
//! the SMTP test server, `postie serve` processes, and Debian's headless Chromium.
//!
//! - an email of a lane with `unsubscribe = true` carries `List-Unsubscribe` (the
//!   HTTPS link and the mailto, one token for its recipient, which reads back to the
//!   address, the job's type and key) and `List-Unsubscribe-Post`; a job naming
//!   `"unsubscribe": {"scope": …}` on another lane too; a transactional job's email
//!   carries neither; a job with two recipients is refused with its reason, and a
//!   producer's own `List-Unsubscribe` is left alone;
//! - the one-click POST as Gmail sends it (RFC 8058's body, no cookie) to one of two
//!   instances: 200, the suppression row (`unsubscribe`, `one-click`), one
//!   `unsubscribed` event (schema-valid, `email.unsubscribed.<type>`), the next bulk
//!   jobs to the address suppressed on both instances while a transactional one is
//!   sent; a second POST changes nothing. Prints the time from the POST to the next
//!   job recorded suppressed;
//! - a GET changes nothing; a tampered token, one of a retired key past its grace, an
//!   unknown key, an empty or wrong body: refused (400/403) and counted; a link of
//!   the previous key in its grace still works;
//! - the mailto form through `postie feedback unsubscribe`;
//! - the same headers through each provider's API (SES and Mailgun in the MIME,
//!   SendGrid and Postmark in the JSON's headers), as the provider test server
//!   received them;
//! - the confirmation page in headless Chromium: it renders, and its button
//!   unsubscribes.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use postie::config::{UnsubscribeKey, UnsubscribeSettings};
use postie::testing::mail::{Link, Links};
use secrecy::SecretString;
use serde_json::{json, Value};
use support::browser::Browser;
use support::feedback::feedback_command;
use support::providers::ProviderServer;
use support::tap::{check_each, Tap};
use support::{eventually, free_port, job, sample, PostieProcess, TestEnv};

const WAIT: Duration = Duration::from_secs(90);
const SECRET_NOW: &str = "now-now-now-now-now-now-now-now-now-now!";
const SECRET_PREVIOUS: &str = "previous-previous-previous-previous-key";
const SECRET_RETIRED: &str = "retired-retired-retired-retired-retired";
const ONE_CLICK: &str = "List-Unsubscribe=One-Click";

/// A world with two lanes (`transactional`, the default, and `bulk` with
/// unsubscribe links), three keys (`k2` signs, `k1` in its grace, `k0` past it),
/// and the feedback listener on `feedback`.
async fn world(name: &str, feedback: u16) -> TestEnv {
    let url = format!("http://127.0.0.1:{feedback}/u/");
    let settings: Vec<(&str, &str)> = vec![
        ("POSTIE__TOPOLOGY__DEFAULT_LANE", "transactional"),
        ("POSTIE__TOPOLOGY__LANES__TRANSACTIONAL__WEIGHT", "9"),
        ("POSTIE__TOPOLOGY__LANES__BULK__WEIGHT", "1"),
        ("POSTIE__TOPOLOGY__LANES__BULK__UNSUBSCRIBE", "true"),
        // The listener serves the one-click endpoint; no provider's webhook is used.
        ("POSTIE__FEEDBACK__SNS__ENABLED", "false"),
        ("POSTIE__UNSUBSCRIBE__URL", &url),
        ("POSTIE__UNSUBSCRIBE__MAILTO", "unsubscribe@shop.example"),
        ("POSTIE__UNSUBSCRIBE__SIGN_WITH", "k2"),
        ("POSTIE__UNSUBSCRIBE__KEYS__K2__SECRET", SECRET_NOW),
        ("POSTIE__UNSUBSCRIBE__KEYS__K1__SECRET", SECRET_PREVIOUS),
        (
            "POSTIE__UNSUBSCRIBE__KEYS__K1__ACCEPT_UNTIL",
            "2099-01-01T00:00:00Z",
        ),
        ("POSTIE__UNSUBSCRIBE__KEYS__K0__SECRET", SECRET_RETIRED),
        (
            "POSTIE__UNSUBSCRIBE__KEYS__K0__ACCEPT_UNTIL",
            "2020-01-01T00:00:00Z",
        ),
    ];
    TestEnv::with_settings(name, &settings).await
}

/// The world's links as postie makes them, signed with `key` (its secret as the
/// world configures it).
fn links_signed_with(env: &TestEnv, key: &str) -> Links {
    let settings = env.settings();
    let keys: BTreeMap<String, UnsubscribeKey> = [
        ("k2", SECRET_NOW),
        ("k1", SECRET_PREVIOUS),
        ("k0", SECRET_RETIRED),
    ]
    .into_iter()
    .map(|(id, secret)| {
        let key = UnsubscribeKey {
            secret: secret.to_string().into(),
            accept_until: None,
        };
        (id.to_string(), key)
    })
    .collect();
    let unsubscribe = UnsubscribeSettings {
        sign_with: key.into(),
        keys,
        ..settings.unsubscribe.clone()
    };
    Links::new(&unsubscribe, &settings.transport.message_id_domain).unwrap()
}

fn typed(key: &str, to: &str, kind: &str, lane: Option<&str>) -> Value {
    let mut body = job(key, to);
    body["type"] = json!(kind);
    if let Some(lane) = lane {
        body["lane"] = json!(lane);
    }
    body
}

/// A header of a raw message, unfolded; `None` if absent.
fn header(raw: &str, name: &str) -> Option<String> {
    let head = raw.split("\r\n\r\n").next().unwrap_or("");
    let unfolded = head.replace("\r\n ", " ").replace("\r\n\t", " ");
    unfolded.lines().find_map(|line| {
        let (n, value) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name)
            .then(|| value.trim().to_owned())
    })
}

/// The two URIs of a `List-Unsubscribe` value.
fn uris(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(|u| {
            u.trim()
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_owned()
        })
        .collect()
}

/// The token of the HTTPS link in `raw`'s `List-Unsubscribe`, read back by `links`.
fn link_in(raw: &str, links: &Links) -> (String, Link) {
    let value = header(raw, "List-Unsubscribe").expect("a List-Unsubscribe header");
    let http = uris(&value)[0].clone();
    let token = http.rsplit('/').next().unwrap().to_owned();
    let link = links
        .read(&token, jiff::Timestamp::now())
        .expect("postie's token reads back");
    (token, link)
}

async fn request(method: &str, url: &str, body: Option<&str>) -> (u16, String) {
    let client = reqwest::Client::new();
    let builder = match method {
        "GET" => client.get(url),
        _ => client
            .post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.unwrap_or("").to_owned()),
    };
    eventually(&format!("an answer from {url}"), WAIT, || async {
        let reply = builder.try_clone()?.send().await.ok()?;
        let status = reply.status().as_u16();
        Some((status, reply.text().await.unwrap_or_default()))
    })
    .await
}

/// `postie_unsubscribe_requests_total{result}` on the metrics port.
async fn counted(metrics: u16, result: &str) -> f64 {
    let url = format!("http://127.0.0.1:{metrics}/metrics");
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    sample(
        &text,
        &format!("postie_unsubscribe_requests_total{{result=\"{result}\"}}"),
    )
    .unwrap_or(0.0)
}

/// The suppression rows of `address`: (scope, reason, source).
async fn rows(env: &TestEnv, address: &str) -> Vec<(String, String, String)> {
    env.db()
        .await
        .query(
            "SELECT scope, reason, source FROM postie_suppression WHERE address = $1 ORDER BY scope",
            &[&address],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

fn spawn(env: &TestEnv, feedback: Option<u16>, metrics: u16) -> PostieProcess {
    let feedback = feedback.map(|p| format!("127.0.0.1:{p}"));
    let metrics = format!("127.0.0.1:{metrics}");
    let mut extra = vec![("POSTIE__HTTP__LISTEN", metrics.as_str())];
    if let Some(feedback) = &feedback {
        extra.push(("POSTIE__FEEDBACK__LISTEN", feedback.as_str()));
    }
    env.spawn_process(&extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_lane_email_carries_one_click_headers_and_a_transactional_one_none() {
    let feedback = free_port();
    let env = world("unsub-headers", feedback).await;
    let postie = spawn(&env, Some(feedback), free_port());
    env.publish(&typed("h-bulk", "ann@example.com", "digest", Some("bulk")))
        .await;
    env.publish(&typed("h-receipt", "ann@example.com", "receipt", None))
        .await;
    let mut own_scope = typed("h-own", "bob@example.com", "reminder", None);
    own_scope["unsubscribe"] = json!({"scope": "reminders"});
    env.publish(&own_scope).await;
    let mut two = typed("h-two", "ann@example.com", "digest", Some("bulk"));
    two["cc"] = json!(["bob@example.com"]);
    env.publish(&two).await;
    let mut producers = typed("h-producers", "cy@example.com", "digest", Some("bulk"));
    producers["headers"] = json!({"List-Unsubscribe": "<https://producer.example/u/1>"});
    env.publish(&producers).await;
    let mut star = typed("h-star", "cy@example.com", "digest", None);
    star["unsubscribe"] = json!({"scope": "*"});
    env.publish(&star).await;

    for key in ["h-bulk", "h-receipt", "h-own", "h-producers"] {
        env.wait_for_status(key, "sent", WAIT).await;
    }
    // Refused before any claim: dead letters with their reasons, no inbox row.
    let mut reasons = Vec::new();
    let deadline = Instant::now() + WAIT;
    while reasons.len() < 2 && Instant::now() < deadline {
        reasons.extend(env.dead_reasons().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        reasons
            .iter()
            .any(|r| r
                .contains("a one-click unsubscribe link is for one recipient and this job has 2")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("\"unsubscribe.scope\" must name what the recipient leaves")),
        "{reasons:?}"
    );
    let links = links_signed_with(&env, "k2");

    let bulk = env.email_of("h-bulk").await;
    let value = header(&bulk, "List-Unsubscribe").expect("the bulk email's List-Unsubscribe");
    let [http, mailto] = <[String; 2]>::try_from(uris(&value)).expect("two URIs");
    let (token, link) = link_in(&bulk, &links);
    assert_eq!(http, format!("http://127.0.0.1:{feedback}/u/{token}"));
    assert_eq!(
        mailto,
        format!("mailto:unsubscribe@shop.example?subject={token}")
    );
    assert_eq!(
        header(&bulk, "List-Unsubscribe-Post").as_deref(),
        Some(ONE_CLICK)
    );
    assert_eq!(
        (
            link.address.as_str(),
            link.scope.as_str(),
            link.key.as_str()
        ),
        ("ann@example.com", "digest", "h-bulk")
    );
    assert_eq!(link.key_id, "k2");
    assert!(
        (jiff::Timestamp::now().as_second() - link.issued).abs() < 600,
        "issued {}",
        link.issued
    );

    let own = env.email_of("h-own").await;
    let (_, link) = link_in(&own, &links);
    assert_eq!(
        (link.address.as_str(), link.scope.as_str()),
        ("bob@example.com", "reminders")
    );

    let receipt = env.email_of("h-receipt").await;
    assert_eq!(header(&receipt, "List-Unsubscribe"), None);
    assert_eq!(header(&receipt, "List-Unsubscribe-Post"), None);

    let producers = env.email_of("h-producers").await;
    assert_eq!(
        header(&producers, "List-Unsubscribe").as_deref(),
        Some("<https://producer.example/u/1>")
    );
    assert_eq!(header(&producers, "List-Unsubscribe-Post"), None);
    drop(postie);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_click_as_gmail_sends_it_suppresses_the_scope_fleet_wide_and_tells_the_producer() {
    let feedback = free_port();
    let env = world("unsub-click", feedback).await;
    let tap = Tap::new(&env).await;
    let metrics = free_port();
    let first = spawn(&env, Some(feedback), metrics);
    let second = spawn(&env, None, free_port());
    env.publish(&typed("c-first", "ann@example.com", "digest", Some("bulk")))
        .await;
    env.wait_for_status("c-first", "sent", WAIT).await;
    let (token, _) = link_in(
        &env.email_of("c-first").await,
        &links_signed_with(&env, "k2"),
    );
    let url = format!("http://127.0.0.1:{feedback}/u/{token}");

    // A link previewer's GET: the page, nothing changed.
    let (status, page) = request("GET", &url, None).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("a…@example.com") && page.contains("digest"),
        "{page}"
    );
    assert!(rows(&env, "ann@example.com").await.is_empty());

    // Gmail's one-click POST: exactly RFC 8058's body, no cookie.
    let (status, reply) = request("POST", &url, Some(ONE_CLICK)).await;
    let posted = Instant::now();
    assert_eq!(status, 200, "{reply}");
    // Then a bulk job to the address every 200 ms for 6 s, which both instances take
    // in turn, and a receipt (another scope), which is sent. The instance that took
    // the POST knows at once; the other within its suppression filter's refresh
    // (`REFRESH`, 1 s). The jobs published from 4 s on must all be suppressed.
    let mut next = Vec::new();
    while posted.elapsed() < Duration::from_secs(6) {
        let key = format!("c-next-{}", next.len());
        env.publish(&typed(&key, "ann@example.com", "digest", Some("bulk")))
            .await;
        next.push((key, posted.elapsed()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.publish(&typed("c-receipt", "ann@example.com", "receipt", None))
        .await;
    env.wait_for_status("c-receipt", "sent", WAIT).await;
    let db = env.db().await;
    let mut outcomes = Vec::new();
    for (key, at) in &next {
        let status = eventually(&format!("{key} finished"), WAIT, || async {
            let row = db
                .query_opt(
                    "SELECT status FROM postie_inbox WHERE key = $1 AND status IN ('sent', 'suppressed')",
                    &[key],
                )
                .await
                .unwrap()?;
            Some(row.get::<_, String>(0))
        })
        .await;
        outcomes.push((*at, status));
    }
    let late_sent: Vec<_> = outcomes
        .iter()
        .filter(|(at, status)| *at >= Duration::from_secs(4) && status == "sent")
        .collect();
    assert!(
        late_sent.is_empty(),
        "sent 4 s or more after the POST: {late_sent:?}"
    );
    // Which instance suppressed which job: each says so in its log.
    let counted_in = |log: String, outcome: &str| {
        let outcome = format!("outcome=\"{outcome}\"");
        log.lines()
            .filter(|l| l.contains("key=\"c-next-") && l.contains(&outcome))
            .count()
    };
    let by_instance = [
        counted_in(first.log(), "suppressed"),
        counted_in(second.log(), "suppressed"),
    ];
    let sent_by = [
        counted_in(first.log(), "sent"),
        counted_in(second.log(), "sent"),
    ];
    assert!(
        by_instance.iter().all(|n| *n > 0),
        "both instances suppress: {by_instance:?} of {outcomes:?}"
    );
    let last_sent = outcomes
        .iter()
        .filter(|(_, status)| status == "sent")
        .map(|(at, _)| at.as_millis())
        .max();
    let first_suppressed = outcomes
        .iter()
        .find(|(_, status)| status == "suppressed")
        .map(|(at, _)| at.as_millis());
    assert_eq!(
        rows(&env, "ann@example.com").await,
        vec![(
            "digest".to_owned(),
            "unsubscribe".to_owned(),
            "one-click".to_owned()
        )]
    );

    // A second POST: 200, nothing more.
    let (status, _) = request("POST", &url, Some(ONE_CLICK)).await;
    assert_eq!(status, 200);
    let (_, adds, _, _) = support::feedback::state(&env, "ann@example.com", "-").await;
    assert_eq!(adds, 1, "one suppression added, with its audit row");

    // The producer's preference centre hears of it once.
    eventually("the unsubscribed event", WAIT, || async {
        tap.events()
            .iter()
            .any(|e| e.body["outcome"] == "unsubscribed")
            .then_some(())
    })
    .await;
    // Every other event of the test has come too (the second POST's would be among
    // them had it written one).
    env.wait_for_status("c-receipt", "sent", WAIT).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events = tap.events();
    check_each(&events);
    let unsubscribed: Vec<_> = events
        .iter()
        .filter(|e| e.body["outcome"] == "unsubscribed")
        .collect();
    assert_eq!(unsubscribed.len(), 1, "{unsubscribed:?}");
    let event = &unsubscribed[0];
    assert_eq!(event.routing_key, "email.unsubscribed.digest");
    assert_eq!(event.body["key"], "c-first");
    assert_eq!(event.body["message_id"], support::message_id("c-first"));
    assert_eq!(event.body["reason"], "unsubscribed from digest (one-click)");
    assert_eq!(counted(metrics, "unsubscribed").await, 1.0);
    assert_eq!(counted(metrics, "duplicate").await, 1.0);
    assert_eq!(counted(metrics, "page").await, 1.0);
    let sent = outcomes.iter().filter(|(_, s)| s == "sent").count();
    let sent_to_ann = env
        .sink
        .messages(false)
        .await
        .iter()
        .filter(|m| m.rcpt_to.iter().any(|r| r == "ann@example.com"))
        .count();
    assert_eq!(
        sent_to_ann,
        2 + sent,
        "c-first, c-receipt and the bulk jobs recorded sent"
    );
    println!(
        "FIGURES unsubscribe: {} bulk jobs published every 200 ms after the POST's 200, on 2 instances: {sent} sent (the last published {:?} ms after the POST), the rest suppressed (the first published {:?} ms after it); sent by [the instance that took the POST, the other] {sent_by:?}, suppressed by them {by_instance:?}",
        outcomes.len(),
        last_sent,
        first_suppressed
    );
    drop(first);
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_tokens_and_bodies_change_nothing_and_are_counted() {
    let feedback = free_port();
    let env = world("unsub-refuse", feedback).await;
    let metrics = free_port();
    let postie = spawn(&env, Some(feedback), metrics);
    let url = |token: &str| format!("http://127.0.0.1:{feedback}/u/{token}");
    let now = jiff::Timestamp::now().as_second();
    let token = |key: &str, address: &str| {
        links_signed_with(&env, key)
            .token(address, "digest", "r-key", now)
            .unwrap()
    };

    let good = token("k2", "ann@example.com");
    let mut tampered = good.clone().into_bytes();
    let at = tampered.len() - 3;
    tampered[at] = if tampered[at] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    let retired = token("k0", "ann@example.com");
    let unknown = good.replacen("k2.", "k9.", 1);
    for (what, token, body, want) in [
        ("tampered", tampered.as_str(), ONE_CLICK, 403),
        ("retired past its grace", retired.as_str(), ONE_CLICK, 403),
        ("an unknown key", unknown.as_str(), ONE_CLICK, 403),
        ("not a token", "hello", ONE_CLICK, 400),
        ("an empty body", good.as_str(), "", 400),
        ("another body", good.as_str(), "List-Unsubscribe=Yes", 400),
    ] {
        let (status, reply) = request("POST", &url(token), Some(body)).await;
        assert_eq!(status, want, "{what}: {reply}");
    }
    let (status, _) = request("GET", &url(&tampered), None).await;
    assert_eq!(status, 403, "a tampered token's page");
    // The page: never framed, cached or sent on with a referrer; no script.
    let page = reqwest::get(url(&good)).await.unwrap();
    let header = |name: &str| {
        page.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    assert!(header("content-security-policy").contains("frame-ancestors 'none'"));
    assert!(header("content-security-policy").starts_with("default-src 'none'"));
    assert_eq!(header("x-frame-options"), "DENY");
    assert_eq!(header("cache-control"), "no-store");
    assert_eq!(header("referrer-policy"), "no-referrer");
    assert!(
        rows(&env, "ann@example.com").await.is_empty(),
        "nothing was suppressed"
    );
    assert_eq!(counted(metrics, "forbidden").await, 4.0);
    assert_eq!(counted(metrics, "malformed").await, 3.0);
    assert_eq!(counted(metrics, "page").await, 1.0);

    // A link of the previous key, in its grace: still honoured.
    let previous = token("k1", "bob@example.com");
    let (status, reply) = request("POST", &url(&previous), Some(ONE_CLICK)).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        rows(&env, "bob@example.com").await,
        vec![(
            "digest".to_owned(),
            "unsubscribe".to_owned(),
            "one-click".to_owned()
        )]
    );

    // The mailto form: an email whose Subject is the token, through the CLI.
    let mailto = token("k2", "cy@example.com");
    let message = format!(
        "From: cy@example.com\r\nTo: unsubscribe@shop.example\r\nSubject: {mailto}\r\n\r\nunsubscribe\r\n"
    );
    let (code, out, err) = feedback_command(&env, "unsubscribe", &message, &[]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("unsubscribed from digest"), "{out}");
    assert_eq!(
        rows(&env, "cy@example.com").await,
        vec![(
            "digest".to_owned(),
            "unsubscribe".to_owned(),
            "mailto".to_owned()
        )]
    );
    let forged = format!("Subject: {tampered}\r\n\r\n");
    let (code, _, err) = feedback_command(&env, "unsubscribe", &forged, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("the signature does not match"), "{err}");
    // The list shows where each came from.
    let list = env
        .postie(&["suppression", "list"])
        .expect("suppression list");
    assert!(
        list.lines()
            .any(|l| l.contains("cy@example.com") && l.contains("mailto")),
        "{list}"
    );
    drop(postie);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_confirmation_page_renders_in_chromium_and_its_button_unsubscribes() {
    let feedback = free_port();
    let env = world("unsub-browser", feedback).await;
    let postie = spawn(&env, Some(feedback), free_port());
    let now = jiff::Timestamp::now().as_second();
    let token = links_signed_with(&env, "k2")
        .token("dee@example.com", "digest", "b-key", now)
        .unwrap();
    let url = format!("http://127.0.0.1:{feedback}/u/{token}");
    request("GET", &url, None).await; // up
    let browser = Browser::start().await;
    browser.open(&url).await;
    browser
        .wait_for_text("Stop sending digest emails to d…@example.com?")
        .await;
    assert!(
        rows(&env, "dee@example.com").await.is_empty(),
        "the page alone changes nothing"
    );
    browser.click("button#unsubscribe").await;
    browser
        .wait_for_text("You will get no more digest emails at d…@example.com.")
        .await;
    browser.close().await;
    assert_eq!(
        rows(&env, "dee@example.com").await,
        vec![(
            "digest".to_owned(),
            "unsubscribe".to_owned(),
            "one-click".to_owned()
        )]
    );
    drop(postie);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_headers_go_through_every_provider_api() {
    let env = world("unsub-providers", free_port()).await;
    let server = ProviderServer::start().await;
    let links = links_signed_with(&env, "k2");
    for provider in ["ses", "sendgrid", "postmark", "mailgun"] {
        let mut settings = env.settings();
        settings.transport.url = Some(SecretString::from(server.url(provider)));
        let serving = env.serve(settings);
        let key = format!("p-{provider}");
        let mut body = typed(&key, "ann@example.com", "news", None);
        body["unsubscribe"] = json!({});
        env.publish(&body).await;
        env.wait_for_status(&key, "sent", WAIT).await;
        serving.stop().await;
        let raw = &server.raw_of(&key).await;
        // The token for this job, as postie made it: the only one that reads back to
        // this key, whatever its issue second.
        let token = raw
            .split(|c: char| !(c.is_ascii_alphanumeric() || "-_.".contains(c)))
            .find(|word| {
                word.starts_with("k2.")
                    && links
                        .read(word, jiff::Timestamp::now())
                        .is_ok_and(|l| l.key == key && l.scope == "news")
            })
            .unwrap_or_else(|| panic!("{provider}: no token for {key} in {raw}"));
        assert!(
            raw.contains(&format!("/u/{token}>"))
                && raw.contains(&format!(
                    "<mailto:unsubscribe@shop.example?subject={token}>"
                )),
            "{provider}: both links in {raw}"
        );
        assert!(raw.contains("List-Unsubscribe-Post"), "{provider}: {raw}");
        assert!(raw.contains(ONE_CLICK), "{provider}: {raw}");
    }
}
