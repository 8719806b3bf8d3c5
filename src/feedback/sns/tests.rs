//! SNS's reading: the canonical string, SES's notes, the checks made before any
//! certificate (topic, Timestamp), and arbitrary input to all of it.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::feedback::fuzz;

const TOPIC: &str = "arn:aws:sns:eu-west-1:123456789012:ses";

fn settings() -> SnsSettings {
    SnsSettings {
        topic_arns: vec![TOPIC.into()],
        ..SnsSettings::default()
    }
}

fn message(topic: &str, at: &str) -> Vec<u8> {
    serde_json::json!({"Type": "Notification", "Message": "{}", "MessageId": "m",
        "Timestamp": at, "TopicArn": topic, "SignatureVersion": "2", "Signature": "AAAA"})
    .to_string()
    .into_bytes()
}

#[test]
fn the_canonical_string_skips_no_subject_and_ses_notes_read_as_documented() {
    let m = serde_json::json!({"Message": "m", "MessageId": "i", "Timestamp": "t",
        "TopicArn": "a", "Type": "Notification"});
    assert_eq!(
        canonical(&m, "Notification").unwrap(),
        "Message\nm\nMessageId\ni\nTimestamp\nt\nTopicArn\na\nType\nNotification\n"
    );
    let ses = serde_json::json!({"notificationType": "Bounce",
        "bounce": {"bounceType": "Transient", "bouncedRecipients": [{"emailAddress": "a@x"}]},
        "mail": {"messageId": "ses-1", "headers": [{"name": "Message-ID", "value": "<m@x>"}]}});
    let notes = ses_notes("n1", &ses);
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].kind, FeedbackKind::Bounce { hard: false });
    assert_eq!(notes[0].message_id.as_deref(), Some("<m@x>"));
    assert_eq!(notes[0].provider_message_id.as_deref(), Some("ses-1"));
}

#[test]
fn only_the_operators_topics_and_a_fresh_timestamp_get_as_far_as_the_certificate() {
    let now = DateTime::parse_from_rfc3339("2026-12-03T12:00:00Z")
        .unwrap()
        .with_timezone(&Utc);
    let s = settings();
    assert!(check(&message(TOPIC, "2026-12-03T11:30:00.000Z"), &s, now).is_ok());
    assert!(
        check(&message(TOPIC, "2026-12-03T12:30:00Z"), &s, now).is_ok(),
        "skew ahead"
    );
    let refused = |body: Vec<u8>| match check(&body, &s, now) {
        Err(Refused::Forbidden(why)) => why,
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("accepted"),
    };
    assert_eq!(
        refused(message(
            "arn:aws:sns:us-east-1:666:theirs",
            "2026-12-03T12:00:00Z"
        )),
        "topic not in feedback.sns.topic_arns"
    );
    assert_eq!(
        refused(message(TOPIC, "2026-12-03T10:59:00Z")),
        "Timestamp outside feedback.sns.max_age"
    );
    assert_eq!(
        refused(message(TOPIC, "yesterday")),
        "no readable Timestamp"
    );
    // With no topic named (served only when disabled), nothing is heard.
    let none = SnsSettings::default();
    assert!(check(&message(TOPIC, "2026-12-03T12:00:00Z"), &none, now).is_err());
}

/// The names an SNS message and SES's notification carry.
const NAMES: &[&str] = &[
    "Type",
    "Notification",
    "SubscriptionConfirmation",
    "Message",
    "MessageId",
    "Subject",
    "Timestamp",
    "TopicArn",
    TOPIC,
    "SignatureVersion",
    "1",
    "2",
    "Signature",
    "SigningCertURL",
    "SubscribeURL",
    "Token",
    "notificationType",
    "eventType",
    "Bounce",
    "Complaint",
    "bounce",
    "complaint",
    "bounceType",
    "Permanent",
    "bouncedRecipients",
    "complainedRecipients",
    "emailAddress",
    "diagnosticCode",
    "mail",
    "messageId",
    "commonHeaders",
    "headers",
    "name",
    "value",
    "Message-ID",
];

proptest! {
    #[test]
    fn arbitrary_bytes_are_refused_or_read_without_panic(body in fuzz::bytes(4096)) {
        let cert = pem_certificate(include_str!("testdata/sns-subject.pem")).unwrap();
        fuzz::bounded(|| {
            if let Ok(m) = check(&body, &settings(), Utc::now()) {
                let _ = m.signed_by(&cert);
            }
        });
    }

    #[test]
    fn arbitrary_sns_shaped_messages_never_panic(mut m in fuzz::json(NAMES), ses in fuzz::json(NAMES)) {
        let cert = pem_certificate(include_str!("testdata/sns-subject.pem")).unwrap();
        if let Some(o) = m.as_object_mut() {
            o.insert("TopicArn".into(), TOPIC.into());
            o.insert("Timestamp".into(), Utc::now().to_rfc3339().into());
            o.insert("Message".into(), ses.to_string().into());
        }
        let body = m.to_string().into_bytes();
        let notes = fuzz::bounded(|| {
            if let Ok(checked) = check(&body, &settings(), Utc::now()) {
                prop_assert!(!checked.signed_by(&cert), "a signature out of nothing");
            }
            Ok(ses_notes("id", &ses))
        })?;
        // One note per recipient listed, each with its evidence cut short.
        prop_assert!(notes.len() <= body.len());
        prop_assert!(notes.iter().all(|n| n.evidence.chars().count() <= 500));
    }
}

#[tokio::test]
async fn nothing_is_heard_when_disabled() {
    let off = SnsSettings {
        enabled: false,
        ..settings()
    };
    let sns = Sns::new(&off, Duration::from_secs(1), 1024).unwrap();
    let body = message(TOPIC, &Utc::now().to_rfc3339());
    let refused = sns.read(&body).await;
    assert!(matches!(refused, Err(Refused::Forbidden(_))));
}
