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
//!
//! What each refuses to an attacker (other topics, old timestamps, replayed tokens,
//! forged reports) is `tests/feedback_trust.rs`.

mod support;

use std::path::Path;

use base64::Engine;
use secrecy::SecretString;
use serde_json::json;
use support::feedback::*;
use support::providers::ProviderServer;
use support::{job, message_id};

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
        state(&env, "someone@example.com", "none").await,
        (1, 0, None, None),
        "an unmatched complaint is recorded and suppresses no one (issue 45)"
    );
    assert_eq!(counted(&at, "postmark", "refused").await, 2.0);
    assert_eq!(counted(&at, "postmark", "recorded").await, 2.0);
    assert_eq!(counted(&at, "postmark", "duplicate").await, 1.0);
    assert_eq!(counted(&at, "postmark", "unmatched").await, 1.0);
    serving.stop().await;
    eprintln!("FIGURES feedback postmark: hard bounce by provider id -> 1 suppression; soft -> row only; unmatched complaint -> recorded, not suppressed; wrong password 403, none 401 (counted 2)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_ses_through_sns_verifies_signatures_and_confirms_subscriptions() {
    let scratch = Scratch::new();
    let (key, cert) = sns_certificate(&scratch);
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
    let ses = ses_bounce("ses@example.com", Some(&provider_id(&env, "fb-ses").await));
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
