//! Feedback only from who may send it (issue 45, item 2): each attack on the feedback
//! webhooks and on `postie feedback ingest` tried as an attacker would, against a real
//! RabbitMQ, PostgreSQL and the SMTP test server, the jobs sent first so that their
//! rows carry their Message-IDs and recipients.
//!
//! - SES through SNS: SNS signs every topic's notifications with one certificate, so a
//!   notice from somebody else's topic verifies. With SES's endpoint on and no
//!   `feedback.sns.topic_arns`, start-up is refused; with the operator's topic named,
//!   another topic's bounce and subscription are refused (403, nothing suppressed,
//!   nothing fetched), as is a notice whose `Timestamp` is past `feedback.sns.max_age`;
//!   a genuine notice that names an address no job was sent to is recorded, not
//!   suppressed.
//! - Reports: a DSN for an address postie never sent to, or naming another address
//!   than the job's, suppresses no one (exit 3, saying why); `feedback.trust_unmatched`
//!   is the explicit way back; an address no job could have is not recorded; DSNs in
//!   base64 and quoted-printable are read.
//! - Mailgun signs only a timestamp and a token: the same signature with other
//!   event-data is refused (403) on the instance that saw it and on another one (the
//!   tokens are kept in PostgreSQL), and the very same request again is a duplicate.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine;
use postie::config::Settings;
use secrecy::SecretString;
use serde_json::json;
use support::feedback::*;
use support::{free_port, message_id};

/// The address an attacker wants suppressed.
const CEO: &str = "ceo@customer.example";
/// The attacker's own SNS topic.
const THEIRS: &str = "arn:aws:sns:us-east-1:666666666666:not-yours";

/// `Settings::load_from` with `vars` alone (every command loads its settings so).
fn load(vars: &[(&str, &str)]) -> Result<Settings, String> {
    let env: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Settings::load_from(None, Some(env)).map_err(|e| e.to_string())
}

/// SES's bounce of `address` for the email whose Message-ID is `message_id`.
fn bounce_of(address: &str, message_id: &str) -> String {
    json!({"notificationType": "Bounce",
        "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                   "bouncedRecipients": [{"emailAddress": address,
                                          "diagnosticCode": "smtp; 550 5.1.1 user unknown"}]},
        "mail": {"messageId": "0100-ses-id", "commonHeaders": {"messageId": message_id}}})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sns_notices_come_only_from_the_operators_topics_and_while_fresh() {
    let scratch = Scratch::new();
    let (key, cert) = sns_certificate(&scratch);
    let (port, hits) = subscribe_server().await;
    let (env, settings) = world("fb-trust-sns", None).await;
    let with_sns = |mut settings: Settings| {
        settings.feedback.sns.certificate_file = Some(cert.clone());
        settings.feedback.sns.allowed_hosts = vec![format!("http://127.0.0.1:{port}")];
        settings
    };
    let settings = with_sns(settings);
    let notice = |topic: &str, at: &str, message: &str, id: &str| {
        sns_message_from(
            &key,
            "2",
            "Notification",
            topic,
            at,
            &[("Message", message), ("MessageId", id)],
        )
    };
    let now = || sns_time(Duration::ZERO);
    let forged = notice(THEIRS, &now(), &bounce_of(CEO, "<x@evil.example>"), "n-0");

    // The default: SES's endpoint on, no topic named.
    let listen = ("POSTIE__FEEDBACK__LISTEN", "127.0.0.1:9");
    match load(&[listen]) {
        Err(line) => assert!(
            line.contains("feedback.sns.topic_arns") && !line.contains('\n'),
            "{line}"
        ),
        Ok(_) => {
            // What the attack does where such settings start.
            let mut open = with_sns(env.settings());
            open.feedback.listen = settings.feedback.listen;
            open.http.listen = settings.http.listen;
            open.feedback.sns.topic_arns.clear();
            let at = Addrs::of(&open);
            let serving = env.serve(open);
            let answer = post(&at, "ses", &[], &forged).await.0;
            let taken = suppressed(&env, CEO).await;
            serving.stop().await;
            panic!("feedback.listen without feedback.sns.topic_arns started; a bounce from the attacker's own topic: HTTP {answer}, {CEO} suppressed: {taken}");
        }
    }
    load(&[listen, ("POSTIE__FEEDBACK__SNS__ENABLED", "false")])
        .expect("SES's endpoint turned off explicitly needs no topic");

    let at = Addrs::of(&settings);
    let serving = env.serve(settings);
    sent(&env, "trust-ses", "ses@example.com").await;
    let theirs = post(&at, "ses", &[], &forged).await;
    assert_eq!(theirs.0, 403, "another topic's notice: {theirs:?}");
    let subscribe = |topic: &str, url: &str| {
        sns_message_from(
            &key,
            "1",
            "SubscriptionConfirmation",
            topic,
            &now(),
            &[
                ("Message", "You have chosen to subscribe"),
                ("MessageId", "sub-1"),
                ("Token", "tok"),
                ("SubscribeURL", url),
            ],
        )
    };
    let url = format!("http://127.0.0.1:{port}/confirm?Token=tok");
    assert_eq!(post(&at, "ses", &[], &subscribe(THEIRS, &url)).await.0, 403);
    assert!(hits.lock().unwrap().is_empty(), "another topic confirmed");
    assert_eq!(post(&at, "ses", &[], &subscribe(TOPIC, &url)).await.0, 200);
    assert_eq!(
        hits.lock().unwrap().len(),
        1,
        "the operator's topic confirmed"
    );

    // A captured genuine notice, replayed two hours later.
    let genuine = bounce_of("ses@example.com", &message_id("trust-ses"));
    let old = notice(TOPIC, &sns_time(Duration::from_secs(7200)), &genuine, "n-1");
    let stale = post(&at, "ses", &[], &old).await;
    assert_eq!(stale.0, 403, "a Timestamp two hours old: {stale:?}");
    assert!(!suppressed(&env, "ses@example.com").await);

    // Genuine notices from the operator's topic that name no job sent to the address.
    let unknown = notice(TOPIC, &now(), &bounce_of(CEO, "<nobody@x.example>"), "n-2");
    assert_eq!(post(&at, "ses", &[], &unknown).await.0, 200);
    let elsewhere = notice(
        TOPIC,
        &now(),
        &bounce_of(CEO, &message_id("trust-ses")),
        "n-3",
    );
    assert_eq!(post(&at, "ses", &[], &elsewhere).await.0, 200);
    assert!(
        !suppressed(&env, CEO).await,
        "an unmatched notice suppressed"
    );
    assert_eq!(counted(&at, "ses", "unmatched").await, 2.0);

    // The job's own recipient: suppressed.
    let real = notice(TOPIC, &now(), &genuine, "n-4");
    assert_eq!(post(&at, "ses", &[], &real).await.0, 200);
    let st = state(&env, "ses@example.com", "trust-ses").await;
    assert_eq!(st.2.as_deref(), Some("hard_bounce"));
    assert_eq!(st.3.as_deref(), Some("bounced"));
    serving.stop().await;
    eprintln!("FIGURES feedback trust sns: no topic_arns -> start-up refused; another topic's bounce 403 and its subscription 403 (0 fetches); a 2 h old Timestamp 403; unmatched notices 200, 2 counted unmatched, none suppressed; the job's recipient suppressed");
}

/// `text` in base64, in lines of 76.
fn base64_lines(text: &str) -> String {
    let encoded = B64.encode(text);
    let lines: Vec<&str> = encoded
        .as_bytes()
        .chunks(76)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    lines.join("\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_report_suppresses_no_one_and_encoded_reports_are_read() {
    let (env, settings) = world("fb-trust-report", None).await;
    let serving = env.serve(settings);
    sent(&env, "trust-dsn", "real@example.com").await;
    sent(&env, "trust-b64", "b64@example.com").await;
    sent(&env, "trust-qp", "qp@example.com").await;
    serving.stop().await;

    // Forged: an address postie never sent to, and another address than the job's.
    let never = dsn("<forged-1@evil.example>", CEO, "<whatever@evil.example>");
    let (code, out, err) = ingest(&env, &never);
    assert!(
        !suppressed(&env, CEO).await,
        "a forged DSN suppressed {CEO} (exit {code:?}: {out} {err})"
    );
    assert_eq!(code, Some(3), "{out} {err}");
    assert!(
        out.contains("not suppressed") && out.contains("no job"),
        "{out}"
    );
    let other = dsn("<forged-2@evil.example>", CEO, &message_id("trust-dsn"));
    let (code, out, _) = ingest(&env, &other);
    assert_eq!(code, Some(3), "{out}");
    assert!(!suppressed(&env, CEO).await, "{out}");

    // An address no job could have been sent to: not recorded at all.
    let garbage = dsn(
        "<garbage@evil.example>",
        "qp@exa=",
        &message_id("trust-dsn"),
    );
    let (code, out, err) = ingest(&env, &garbage);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("not recorded"), "{out}");
    assert_eq!(state(&env, "qp@exa=", "-").await.0, 0, "{out}");

    // A DSN whose report part is base64.
    let status = "Reporting-MTA: dns; mx.example\r\n\r\nFinal-Recipient: rfc822; b64@example.com\r\nAction: failed\r\nStatus: 5.1.1\r\n";
    let b64 = format!(
        "From: MAILER-DAEMON@mx.example\r\nMessage-ID: <dsn-b64@mx.example>\r\nMIME-Version: 1.0\r\n\
Content-Type: multipart/report; report-type=delivery-status; boundary=\"b\"\r\n\r\n\
--b\r\nContent-Type: text/plain\r\n\r\nUndelivered.\r\n\
--b\r\nContent-Type: message/delivery-status\r\nContent-Transfer-Encoding: base64\r\n\r\n{}\r\n\
--b\r\nContent-Type: text/rfc822-headers\r\nContent-Transfer-Encoding: base64\r\n\r\n{}\r\n\
--b--\r\n",
        base64_lines(status),
        base64_lines(&format!(
            "To: b64@example.com\r\nMessage-ID: {}\r\n\r\n",
            message_id("trust-b64")
        ))
    );
    let (code, out, err) = ingest(&env, &b64);
    assert_eq!(code, Some(0), "{out} {err}");
    let st = state(&env, "b64@example.com", "trust-b64").await;
    assert_eq!(st.2.as_deref(), Some("hard_bounce"), "{out}");

    // One in quoted-printable, soft line breaks in the address and the Message-ID.
    let id = message_id("trust-qp");
    let (head, tail) = id.split_at(12);
    let qp = format!(
        "From: MAILER-DAEMON@mx.example\r\nMessage-ID: <dsn-qp@mx.example>\r\nMIME-Version: 1.0\r\n\
Content-Type: multipart/report; report-type=delivery-status; boundary=\"q\"\r\n\r\n\
--q\r\nContent-Type: text/plain\r\n\r\nUndelivered.\r\n\
--q\r\nContent-Type: message/delivery-status\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n\
Reporting-MTA: dns; mx.example\r\n\r\nFinal-Recipient: rfc822; qp@exa=\r\nmple.com\r\nAction: failed\r\nStatus: 5.1.1\r\n\r\n\
--q\r\nContent-Type: text/rfc822-headers\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n\
To: qp@example.com\r\nMessage-ID: {head}=\r\n{tail}\r\n\r\n\
--q--\r\n"
    );
    let (code, out, err) = ingest(&env, &qp);
    assert_eq!(code, Some(0), "{out} {err}");
    let st = state(&env, "qp@example.com", "trust-qp").await;
    assert_eq!(st.2.as_deref(), Some("hard_bounce"), "{out}");
    assert_eq!(st.3.as_deref(), Some("bounced"), "{out}");

    // Trusting unmatched reports is a setting of its own.
    let trusted = dsn("<forged-3@evil.example>", CEO, "<whatever@evil.example>");
    let (code, out, err) = ingest_with(
        &env,
        &trusted,
        &[("POSTIE__FEEDBACK__TRUST_UNMATCHED", "dsn")],
    );
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(suppressed(&env, CEO).await, "{out}");
    eprintln!("FIGURES feedback trust reports: forged DSNs (never sent; another address than the job's) -> exit 3, not suppressed; base64 and quoted-printable DSNs -> matched, hard_bounce; feedback.trust_unmatched = dsn -> suppressed");
}

/// Mailgun's body: `event-data` for `recipient` of the email `message_id` (event
/// `id`), under the signature of (`ts`, `token`) by `key`.
fn mailgun(
    key: &[u8],
    ts: i64,
    token: &str,
    id: &str,
    recipient: &str,
    message_id: &str,
) -> String {
    let mac = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
        format!("{ts}{token}").as_bytes(),
    );
    json!({
        "signature": {"timestamp": ts.to_string(), "token": token,
                      "signature": hex::encode(mac.as_ref())},
        "event-data": {"event": "failed", "severity": "permanent", "id": id,
            "recipient": recipient,
            "message": {"headers": {"message-id": message_id.trim_matches(['<', '>'])}}}
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_mailgun_signature_is_refused_on_every_instance() {
    let key = b"mg-signing-key";
    let (env, mut settings) = world("fb-trust-mg", None).await;
    settings.feedback.mailgun.signing_key = Some(SecretString::from("mg-signing-key".to_string()));
    let mut second = env.settings();
    second.feedback.mailgun.signing_key = Some(SecretString::from("mg-signing-key".to_string()));
    second.feedback.sns.topic_arns = vec![TOPIC.to_string()];
    second.feedback.listen = Some(format!("127.0.0.1:{}", free_port()).parse().unwrap());
    second.http.listen = None;
    let (a, b) = (Addrs::of(&settings), second.feedback.listen.unwrap());
    let b = Addrs {
        feedback: b,
        metrics: a.metrics,
    };
    let one = env.serve(settings);
    let two = env.serve(second);
    sent(&env, "trust-mg", "mg@example.com").await;
    sent(&env, "trust-victim", "victim@example.com").await;

    let ts = chrono::Utc::now().timestamp();
    let genuine = mailgun(
        key,
        ts,
        "tok-1",
        "ev-1",
        "mg@example.com",
        &message_id("trust-mg"),
    );
    assert_eq!(post(&a, "mailgun", &[], &genuine).await.0, 200);
    assert_eq!(
        state(&env, "mg@example.com", "trust-mg").await.2.as_deref(),
        Some("hard_bounce")
    );
    // The captured signature with other event-data: a real job's real recipient.
    let replay = mailgun(
        key,
        ts,
        "tok-1",
        "ev-2",
        "victim@example.com",
        &message_id("trust-victim"),
    );
    let answer = post(&a, "mailgun", &[], &replay).await;
    assert!(
        !suppressed(&env, "victim@example.com").await,
        "a replayed signature suppressed the victim (HTTP {answer:?})"
    );
    assert_eq!(answer.0, 403, "{answer:?}");
    let elsewhere = post(&b, "mailgun", &[], &replay).await;
    assert_eq!(
        elsewhere.0, 403,
        "the replay to another instance: {elsewhere:?}"
    );
    assert!(!suppressed(&env, "victim@example.com").await);
    // Mailgun sending the very same request again (its retry): a duplicate.
    assert_eq!(post(&b, "mailgun", &[], &genuine).await.0, 200);
    assert_eq!(state(&env, "mg@example.com", "trust-mg").await.0, 1);
    one.stop().await;
    two.stop().await;
    eprintln!("FIGURES feedback trust mailgun: genuine 200 suppressed; the same signature with other event-data 403 on the same instance and on another, victim not suppressed; the very same request again 200, 1 feedback row");
}
