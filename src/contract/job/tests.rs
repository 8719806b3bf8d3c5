//! Unit tests of `job.rs`.

use super::*;
use proptest::prelude::*;

const RULES: ParseRules<'static> = ParseRules {
    max_body_bytes: 64 * 1024,
    default_from: Some("Shop <noreply@shop.example>"),
    key_namespace: crate::config::KeyNamespace::Off,
    user_id: None,
    attachments: crate::contract::AttachmentLimits::DEFAULT,
};

fn parse(json: serde_json::Value) -> Result<EmailJob, InvalidJob> {
    EmailJob::parse(json.to_string().as_bytes(), &RULES)
}

fn base() -> serde_json::Value {
    serde_json::json!({
        "order_id": "42", "type": "order_confirmation",
        "to": ["alice@example.com"], "subject": "Your order", "text": "hi"
    })
}

#[test]
fn key_comes_from_order_id_and_type_when_absent() {
    let job = parse(base()).unwrap();
    assert_eq!(job.key.as_str(), "42:order_confirmation");
    assert_eq!(job.from.email.to_string(), "noreply@shop.example");
}

#[test]
fn explicit_key_wins() {
    let mut v = base();
    v["key"] = "order-42:order_confirmation".into();
    assert_eq!(
        parse(v).unwrap().key.as_str(),
        "order-42:order_confirmation"
    );
}

#[test]
fn rejects_each_bad_input_with_a_reason() {
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (
            serde_json::json!({"to": ["a@b.example"], "subject": "s", "text": "t"}),
            "no idempotency key",
        ),
        (
            {
                let mut v = base();
                v["to"] = serde_json::json!([]);
                v
            },
            "no recipient",
        ),
        (
            {
                let mut v = base();
                v["to"] = serde_json::json!(["not an address"]);
                v
            },
            "not a valid address",
        ),
        (
            {
                let mut v = base();
                v["subject"] = "a\r\nBcc: x@evil.example".into();
                v
            },
            "CR/LF",
        ),
        (
            {
                let mut v = base();
                v["subject"] = "line\u{2028}sep".into();
                v
            },
            "U+2028",
        ),
        (
            {
                let mut v = base();
                v.as_object_mut().unwrap().remove("text");
                v
            },
            "neither",
        ),
        (
            {
                let mut v = base();
                v["headers"] = serde_json::json!({"Bcc": "x@evil.example"});
                v
            },
            "set by postie",
        ),
        (
            {
                let mut v = base();
                v["headers"] = serde_json::json!({"X-A": "1\n2"});
                v
            },
            "CR/LF",
        ),
        (
            {
                let mut v = base();
                v["htm"] = "<p>".into();
                v
            },
            "unknown field",
        ),
        (
            {
                let mut v = base();
                v["version"] = 2.into();
                v
            },
            "unsupported version",
        ),
    ];
    for (json, expected) in cases {
        let err = parse(json.clone()).expect_err(&json.to_string());
        assert!(err.0.contains(expected), "{json}: {err}");
    }
}

#[test]
fn rejects_oversized_empty_and_non_utf8_bodies() {
    let big = vec![b' '; RULES.max_body_bytes + 1];
    assert!(EmailJob::parse(&big, &RULES)
        .unwrap_err()
        .0
        .contains("over the limit"));
    assert!(EmailJob::parse(b"", &RULES)
        .unwrap_err()
        .0
        .contains("empty"));
    assert!(EmailJob::parse(b"\xff\xfe", &RULES)
        .unwrap_err()
        .0
        .contains("UTF-8"));
    assert!(EmailJob::parse(b"{not json", &RULES)
        .unwrap_err()
        .0
        .contains("not a valid job"));
}

#[test]
fn cancel_requests_are_told_apart_from_jobs() {
    let cancel = Request::parse(br#"{"cancel": "order-1:x", "revision": 2}"#, &RULES).unwrap();
    assert!(
        matches!(cancel, Request::Cancel { ref key, revision: Some(2) } if key.as_str() == "order-1:x")
    );
    assert!(Request::parse(br#"{"cancel": "k", "extra": 1}"#, &RULES).is_err());
    assert!(Request::parse(br#"{"cancel": "k", "revision": -1}"#, &RULES).is_err());
    let job = Request::parse(base().to_string().as_bytes(), &RULES).unwrap();
    assert!(matches!(job, Request::Job(ref j) if j.revision == 0));
}

#[test]
fn an_oversized_cancel_or_job_is_refused_by_its_size_before_any_parse() {
    // A cancel request padded past the limit: refused by size, not read as a cancel.
    let mut padded = br#"{"cancel": "k", "pad": ""#.to_vec();
    padded.resize(RULES.max_body_bytes + 1, b'x');
    let err = Request::parse(&padded, &RULES).unwrap_err();
    assert!(err.0.contains("over the limit"), "{err}");
}

#[test]
fn peek_key_reads_the_key_and_revision_and_skips_the_rest() {
    let mut job = base();
    job["html"] = serde_json::json!("<p>".repeat(1_000));
    job["revision"] = serde_json::json!(3);
    let (key, revision) = peek_key(job.to_string().as_bytes()).unwrap();
    assert_eq!((key.as_str(), revision), ("42:order_confirmation", 3));
    // An explicit key, with an escape in it, wins over order_id:type.
    let keyed = br#"{"order_id": "o", "type": "t", "key": "a\u0041", "revision": "x"}"#;
    let (key, revision) = peek_key(keyed).unwrap();
    assert_eq!((key.as_str(), revision), ("aA", 0));
    assert_eq!(peek_key(br#"{"cancel": "k"}"#), None);
    assert_eq!(peek_key(br#"{"order_id": "o"}"#), None);
    assert_eq!(peek_key(br#"{"key": 5}"#), None);
    assert_eq!(peek_key(b"not json"), None);
    // An array is no job, though serde would read the struct from it by position.
    assert_eq!(peek_key(br#"["k", "o", "t"]"#), None);
}

#[test]
fn the_relays_peek_reads_the_clock_time_and_the_job_in_one_pass() {
    use crate::contract::peek_relay;
    let body = br#"{"key": "k", "revision": 2, "lane": "bulk", "send_at": "2027-03-27T09:00:00Z", "html": "<p>"}"#;
    let (clock, job) = peek_relay(body);
    let job = job.unwrap();
    assert_eq!(clock.unwrap().unwrap(), 1_806_138_000_000);
    assert_eq!(
        (job.key.as_str(), job.revision, job.lane.as_deref()),
        ("k", 2, Some("bulk"))
    );
    // A body with no usable key still has its clock time read (the worker refuses it).
    let (clock, job) = peek_relay(
        br#"{"key": 5, "send_at_local": "2027-03-27T10:00", "time_zone": "Europe/Berlin"}"#,
    );
    assert_eq!(
        (clock.unwrap().unwrap(), job.is_none()),
        (1_806_138_000_000, true)
    );
    // No clock time; a clock time of the wrong type; a cancel; no object at all.
    assert!(peek_relay(br#"{"key": "k"}"#).0.is_none());
    let (clock, _) = peek_relay(br#"{"key": "k", "send_at": 5}"#);
    assert_eq!(clock.unwrap().unwrap_err().0, "send_at is not a string");
    assert!(peek_relay(br#"{"cancel": "k"}"#).1.is_none());
    assert!(matches!(peek_relay(b"[1]"), (None, None)));
}

#[test]
fn only_an_object_with_a_cancel_member_is_a_cancel_request() {
    let array = Request::parse(br#"[{"cancel": "k"}]"#, &RULES).unwrap_err();
    assert!(array.0.contains("not a JSON object"), "{array}");
    let null = Request::parse(br#"{"cancel": null}"#, &RULES).unwrap_err();
    assert!(null.0.contains("not a valid cancel request"), "{null}");
    assert!(matches!(
        Request::parse(br#"{"cancel": "k"}"#, &RULES),
        Ok(Request::Cancel { .. })
    ));
}

#[test]
fn throttle_recipient_is_the_user_else_the_first_address() {
    let mut v = base();
    v["to"] = serde_json::json!(["Alice <Alice@Example.com>"]);
    assert_eq!(
        parse(v.clone()).unwrap().throttle_recipient(),
        "addr:alice@example.com"
    );
    v["user_id"] = "u-7".into();
    assert_eq!(parse(v).unwrap().throttle_recipient(), "user:u-7");
}

#[test]
fn reasons_are_short_and_single_line() {
    assert_eq!(
        readable("a\r\nb\u{2028}", 100),
        "a\\u{000d}\\u{000a}b\\u{2028}"
    );
    let long = readable(&"z".repeat(10_000), 300);
    assert!(long.len() <= 300 && long.ends_with('…'));
    let mut v = base();
    v[format!("x\rBcc: {}", "z".repeat(300_000))] = 1.into();
    let reason = parse(v).unwrap_err().0;
    assert!(
        reason.len() < 400 && !reason.contains('\r'),
        "{}",
        reason.len()
    );
}

#[test]
fn content_and_resent_headers_are_reserved() {
    for name in ["Content-Length", "content-foo", "Resent-Anything"] {
        let mut v = base();
        v["headers"] = serde_json::json!({ name: "1" });
        assert!(parse(v).unwrap_err().0.contains("set by postie"), "{name}");
    }
}

#[test]
fn message_id_is_a_function_of_the_key() {
    let a = IdempotencyKey::parse("order-1:x").unwrap();
    let b = IdempotencyKey::parse("order-2:x").unwrap();
    assert_eq!(a.message_id("d.example"), a.message_id("d.example"));
    assert_ne!(a.message_id("d.example"), b.message_id("d.example"));
    assert!(a.message_id("d.example").ends_with("@d.example>"));
}

#[test]
fn keys_are_kept_as_published_unless_namespaced_by_user_id() {
    let body = serde_json::json!({
        "key": "order-1:x", "to": ["a@example.com"], "subject": "s", "text": "t"
    })
    .to_string();
    let key_of = |rules: &ParseRules<'_>| match Request::parse(body.as_bytes(), rules) {
        Ok(Request::Job(job)) => Ok(job.key),
        Ok(Request::Cancel { .. }) => panic!("a job"),
        Err(e) => Err(e.0),
    };
    // Off (the default): the key, and so its Message-ID, is what was published,
    // whatever user_id says.
    let published = IdempotencyKey::parse("order-1:x").unwrap();
    assert_eq!(
        key_of(&RULES.for_user(Some("svc-a"))),
        Ok(published.clone())
    );
    // The Message-ID of an existing key is pinned: it must not move.
    assert_eq!(
        published.message_id("d.example"),
        "<3c8ba6d7e21d615962563e8be808f05e@d.example>"
    );
    let on = ParseRules {
        key_namespace: crate::config::KeyNamespace::UserId,
        ..RULES
    };
    let a = key_of(&on.for_user(Some("svc-a"))).unwrap();
    let b = key_of(&on.for_user(Some("svc-b"))).unwrap();
    assert_eq!(a.as_str(), "svc-a:order-1:x");
    assert_ne!(a, b);
    assert_ne!(a.message_id("d.example"), b.message_id("d.example"));
    // No two (user, key) pairs meet: `:` and `%` in the user are escaped.
    assert_ne!(
        published.in_namespace("u:order-1").as_str(),
        IdempotencyKey::parse("order-1:order-1:x")
            .unwrap()
            .in_namespace("u")
            .as_str()
    );
    assert_eq!(
        published.in_namespace("a:b%").as_str(),
        "a%3Ab%25:order-1:x"
    );
    // The owner reads back from the stored key (the reconciler re-publishes with it).
    for user in ["svc-a", "a:b%", "100%:x"] {
        let stored = published.in_namespace(user);
        assert_eq!(
            crate::contract::key_owner(stored.as_str()).as_deref(),
            Some(user)
        );
    }
    // Without user_id (or an empty one) the job is refused with the reason.
    for user in [None, Some("")] {
        let reason = key_of(&on.for_user(user)).unwrap_err();
        assert!(reason.contains("no AMQP user_id property"), "{reason}");
    }
    // Cancels live in the same key space.
    let cancel = br#"{"cancel": "order-1:x"}"#;
    match Request::parse(cancel, &on.for_user(Some("svc-b"))) {
        Ok(Request::Cancel { key, .. }) => assert_eq!(key, b),
        other => panic!("{other:?}"),
    }
    assert!(Request::parse(cancel, &on).is_err());
}

proptest! {
    #[test]
    fn no_accepted_header_value_can_break_a_line(subject in "\\PC{0,40}[\\r\\n\\u{0}\\u{2028}\\u{85}]\\PC{0,40}") {
        let mut v = base();
        v["subject"] = subject.into();
        prop_assert!(parse(v).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = EmailJob::parse(&body, &RULES);
    }
}

#[test]
fn pc_one_key_rule_for_the_job_the_peek_and_the_dead_letter() {
    use crate::contract::key::key_text;
    // `key` wins; else `order_id:type`; else none.
    assert_eq!(
        key_text(Some("k".into()), Some("o"), Some("t")).as_deref(),
        Some("k")
    );
    assert_eq!(key_text(None, Some("o"), Some("t")).as_deref(), Some("o:t"));
    assert_eq!(key_text(None, Some("o"), None), None);
    // A blank key is there: it is the key (and refused), never passed over.
    assert_eq!(
        key_text(Some(" ".into()), Some("o"), Some("t")).as_deref(),
        Some(" ")
    );
    let mut blank = base();
    blank["key"] = " ".into();
    let reason = parse(blank.clone()).unwrap_err().0;
    assert!(reason.contains("\"key\" is empty"), "{reason}");
    assert_eq!(peek_key(blank.to_string().as_bytes()), None);
    assert_eq!(
        peek_key_text(blank.to_string().as_bytes()).as_deref(),
        Some(" ")
    );
    // `null` is absent, as the schema says: order_id:type then.
    let mut null = base();
    null["key"] = serde_json::Value::Null;
    assert_eq!(
        parse(null.clone()).unwrap().key.as_str(),
        "42:order_confirmation"
    );
    let (key, _) = peek_key(null.to_string().as_bytes()).unwrap();
    assert_eq!(key.as_str(), "42:order_confirmation");
    // A key that is no string is there too: no fallback to order_id:type.
    let mut number = base();
    number["key"] = 7.into();
    assert!(parse(number.clone()).is_err());
    assert_eq!(peek_key_text(number.to_string().as_bytes()), None);
    // The peek reads only the key members: a bad other member does not hide the key.
    let odd = br#"{"key": "k", "order_id": 5, "to": {}}"#;
    assert_eq!(peek_key_text(odd).as_deref(), Some("k"));
}

#[test]
fn pc_a_body_read_in_one_pass_keeps_its_reasons() {
    let reason = |body: &str| Request::parse(body.as_bytes(), &RULES).unwrap_err().0;
    // A cancel request's reasons are a cancel request's, whatever member comes first.
    for body in [
        r#"{"cancel": "k", "to": []}"#,
        r#"{"subject": 5, "cancel": "k"}"#,
        r#"{"cancel": "k", "subject": "s", "to": ["a@b.example"], "text": "t"}"#,
    ] {
        assert!(
            reason(body).starts_with("not a valid cancel request: "),
            "{body}"
        );
    }
    assert!(reason(r#"{"cancel": null}"#).contains("invalid type: null"));
    // A job's: a null subject is a wrong type, a missing one a missing field.
    let mut null_subject = base();
    null_subject["subject"] = serde_json::Value::Null;
    let null_subject = parse(null_subject).unwrap_err().0;
    assert!(
        null_subject.contains("invalid type: null, expected a string"),
        "{null_subject}"
    );
    let mut no_subject = base();
    no_subject.as_object_mut().unwrap().remove("subject");
    let no_subject = parse(no_subject).unwrap_err().0;
    assert_eq!(
        no_subject,
        "body is not a valid job: missing field `subject`"
    );
    // A duplicate member is refused, as before.
    let twice = br#"{"key": "k", "key": "k", "to": ["a@b.example"], "subject": "s", "text": "t"}"#;
    assert!(reason(std::str::from_utf8(twice).unwrap()).contains("duplicate field `key`"));
    // A cancel request is no job for EmailJob::parse.
    let as_job = EmailJob::parse(br#"{"cancel": "k"}"#, &RULES)
        .unwrap_err()
        .0;
    assert!(
        as_job.starts_with("body is not a valid job: unknown field `cancel`"),
        "{as_job}"
    );
    // And a cancel member, even null, keeps a body from the relay's peek.
    assert_eq!(peek_key(br#"{"cancel": null, "key": "k"}"#), None);
}

#[test]
fn pc_the_message_id_digest_is_computed_once_and_cloned_with_the_key() {
    let key = IdempotencyKey::parse("order-1:x").unwrap();
    let first = key.message_id("d.example");
    let clone = key.clone();
    assert_eq!(clone.message_id("d.example"), first);
    assert_eq!(key.message_id("d.example"), first);
    // Equality and hashing are the text's, not the cache's.
    assert_eq!(IdempotencyKey::parse("order-1:x").unwrap(), key);
    assert_eq!(format!("{key:?}"), "IdempotencyKey(\"order-1:x\")");
}
