//! The SendGrid, Postmark and Mailgun readers: their events as documented, and any
//! body at all, signed or not (issue 45, item 7).

use axum::http::HeaderValue;
use proptest::prelude::*;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};

use super::*;
use crate::feedback::fuzz;

#[test]
fn sendgrid_events_read_as_documented() {
    let e = serde_json::json!({"event": "bounce", "type": "blocked", "email": "a@x",
        "sg_event_id": "ev1", "sg_message_id": "abc.filter0001", "smtp-id": "<m@x>"});
    let f = sendgrid_event(&e).unwrap();
    assert_eq!(f.kind, FeedbackKind::Bounce { hard: false });
    assert_eq!(f.provider_message_id.as_deref(), Some("abc"));
    let e = serde_json::json!({"event": "delivered", "email": "a@x", "sg_event_id": "e"});
    assert!(sendgrid_event(&e).is_none());
    assert_eq!(evidence("é".repeat(600)).chars().count(), EVIDENCE_CHARS);
    assert!(fresh("100", 160, std::time::Duration::from_secs(60)));
    assert!(!fresh("100", 161, std::time::Duration::from_secs(60)));
}

/// The names the three providers' bodies carry.
const NAMES: &[&str] = &[
    "event",
    "bounce",
    "dropped",
    "spamreport",
    "type",
    "blocked",
    "status",
    "reason",
    "sg_event_id",
    "email",
    "smtp-id",
    "sg_message_id",
    "RecordType",
    "Bounce",
    "SpamComplaint",
    "Type",
    "HardBounce",
    "ID",
    "Email",
    "MessageID",
    "Description",
    "Details",
    "signature",
    "timestamp",
    "token",
    "event-data",
    "failed",
    "complained",
    "severity",
    "permanent",
    "id",
    "recipient",
    "delivery-status",
    "code",
    "message",
    "headers",
    "message-id",
];

/// SendGrid's settings with a fresh P-256 key, and the key to sign with.
fn sendgrid_key() -> (SendgridSettings, EcdsaKeyPair) {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
    let pair =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    // SubjectPublicKeyInfo of a P-256 key: the fixed header, then the point.
    let mut spki = hex::decode("3059301306072a8648ce3d020106082a8648ce3d030107034200").unwrap();
    spki.extend_from_slice(pair.public_key().as_ref());
    let b64 = base64::engine::general_purpose::STANDARD.encode(spki);
    let settings = SendgridSettings {
        public_key: Some(b64.into()),
        ..SendgridSettings::default()
    };
    (settings, pair)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn arbitrary_bodies_are_refused_or_read_without_panic(body in fuzz::bytes(4096)) {
        let (sendgrid_cfg, _) = sendgrid_key();
        let postmark_cfg = PostmarkSettings { user: Some("u".into()), password: Some("p".to_string().into()) };
        let mailgun_cfg = MailgunSettings { signing_key: Some("k".to_string().into()), ..MailgunSettings::default() };
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Basic dTpw"));
        fuzz::bounded(|| {
            let _ = sendgrid(&sendgrid_cfg, &headers, &body, 0);
            let _ = postmark(&postmark_cfg, &headers, &body);
            let _ = mailgun(&mailgun_cfg, &body, 0);
        });
    }

    #[test]
    fn arbitrary_signed_events_are_read_without_panic(events in fuzz::json(NAMES), event in fuzz::json(NAMES)) {
        let now = 1_700_000_000;
        // SendGrid: the JSON signed as SendGrid signs it.
        let (cfg, pair) = sendgrid_key();
        let body = events.to_string();
        let rng = ring::rand::SystemRandom::new();
        let sig = pair.sign(&rng, format!("{now}{body}").as_bytes()).unwrap();
        let mut headers = HeaderMap::new();
        let b64 = base64::engine::general_purpose::STANDARD;
        headers.insert("x-twilio-email-event-webhook-signature", HeaderValue::from_str(&b64.encode(sig.as_ref())).unwrap());
        headers.insert("x-twilio-email-event-webhook-timestamp", HeaderValue::from_str(&now.to_string()).unwrap());
        let read = fuzz::bounded(|| sendgrid(&cfg, &headers, body.as_bytes(), now));
        if let Ok(notes) = &read {
            prop_assert!(notes.len() <= body.len());
        }
        // Postmark: with its basic auth.
        let pm = PostmarkSettings { user: Some("u".into()), password: Some("p".to_string().into()) };
        headers.insert("authorization", HeaderValue::from_static("Basic dTpw"));
        let _ = fuzz::bounded(|| postmark(&pm, &headers, event.to_string().as_bytes()));
        // Mailgun: the event under a valid signature of its timestamp and token.
        let mg = MailgunSettings { signing_key: Some("k".to_string().into()), ..MailgunSettings::default() };
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"k");
        let mac = ring::hmac::sign(&key, format!("{now}tok").as_bytes());
        let signed = serde_json::json!({"signature": {"timestamp": now.to_string(), "token": "tok",
            "signature": hex::encode(mac.as_ref())}, "event-data": event});
        let read = fuzz::bounded(|| mailgun(&mg, signed.to_string().as_bytes(), now));
        if let Ok(signed) = &read {
            prop_assert!(signed.notes.len() <= 1);
            prop_assert_eq!(signed.token.as_str(), "tok");
        }
    }
}
