//! The attachment rules, one by one.

use super::*;

fn raw(json: serde_json::Value) -> Result<Vec<Attachment>, InvalidJob> {
    let raw: Vec<RawAttachment> =
        serde_json::from_value(json).map_err(|e| InvalidJob(e.to_string()))?;
    read_all(raw, &AttachmentLimits::DEFAULT)
}

fn inline(bytes: &[u8]) -> serde_json::Value {
    serde_json::json!({
        "filename": "a.txt", "content_type": "text/plain", "size": bytes.len(),
        "sha256": hex::encode(Sha256::digest(bytes)),
        "source": {"inline": base64::engine::general_purpose::STANDARD.encode(bytes)}
    })
}

#[test]
fn inline_bytes_are_decoded_and_checked() {
    let read = raw(serde_json::json!([inline(b"hello")])).unwrap();
    assert_eq!(read[0].source, Source::Inline(Arc::from(&b"hello"[..])));
    assert_eq!(read[0].size, 5);
    let mut wrong = inline(b"hello");
    wrong["size"] = 6.into();
    assert!(raw(serde_json::json!([wrong]))
        .unwrap_err()
        .0
        .contains("5 inline bytes where size says 6"));
    let mut wrong = inline(b"hello");
    wrong["sha256"] = hex::encode(Sha256::digest(b"hellO")).into();
    let why = raw(serde_json::json!([wrong])).unwrap_err().0;
    assert!(
        why.starts_with("attachments[0] (\"a.txt\") has") && why.contains("SHA-256"),
        "{why}"
    );
}

#[test]
fn names_types_and_dispositions_are_checked() {
    let cases = [
        ("filename", serde_json::json!("../etc/passwd"), "not a path"),
        (
            "filename",
            serde_json::json!("a\r\nb.txt"),
            "control character",
        ),
        ("filename", serde_json::json!(""), "1-255 bytes"),
        ("content_type", serde_json::json!("pdf"), "not a MIME type"),
        (
            "content_type",
            serde_json::json!("multipart/mixed; boundary=x"),
            "not a multipart",
        ),
        (
            "content_type",
            serde_json::json!("text/calendar"),
            "names its method",
        ),
        ("sha256", serde_json::json!("abc"), "64 hex digits"),
        (
            "disposition",
            serde_json::json!("inline"),
            "without a content_id",
        ),
        (
            "content_id",
            serde_json::json!("logo@x"),
            "give it \"disposition\"",
        ),
        (
            "disposition",
            serde_json::json!("form-data"),
            "\"attachment\" or \"inline\"",
        ),
        (
            "source",
            serde_json::json!({"url": "ftp://files.example/a"}),
            "https only",
        ),
        (
            "source",
            serde_json::json!({"url": "http://files.example/a"}),
            "https only",
        ),
        (
            "source",
            serde_json::json!({"url": "https://u:p@files.example/a"}),
            "credentials",
        ),
        (
            "source",
            serde_json::json!({"s3": {"bucket": "Invoices", "key": "a"}}),
            "s3 bucket",
        ),
        (
            "source",
            serde_json::json!({"s3": {"bucket": "invoices", "key": ""}}),
            "s3 key",
        ),
        (
            "size",
            serde_json::json!(20 * 1024 * 1024 + 1),
            "over the limit of 20971520 per file",
        ),
    ];
    for (member, value, why) in cases {
        let mut one = inline(b"x");
        one[member] = value;
        let got = raw(serde_json::json!([one])).unwrap_err().0;
        assert!(got.contains(why), "{member}: {got}");
    }
    let mut calendar = inline(b"BEGIN:VCALENDAR");
    calendar["content_type"] = "text/calendar; method=REQUEST; charset=UTF-8".into();
    assert!(raw(serde_json::json!([calendar])).is_ok());
    let mut url = inline(b"x");
    url["source"] = serde_json::json!({"url": "http://127.0.0.1:9/a.pdf"});
    assert!(matches!(
        raw(serde_json::json!([url])).unwrap()[0].source,
        Source::Url(_)
    ));
}

#[test]
fn the_count_and_the_total_are_limited_and_content_ids_unique() {
    let eleven: Vec<_> = (0..11).map(|_| inline(b"x")).collect();
    assert!(raw(serde_json::json!(eleven))
        .unwrap_err()
        .0
        .contains("11 attachments"));
    let big = |n| {
        let mut one = inline(b"x");
        one["size"] = serde_json::json!(n);
        one["source"] = serde_json::json!({"url": "https://files.example/a"});
        one
    };
    let why = raw(serde_json::json!([big(15 << 20), big(15 << 20)]))
        .unwrap_err()
        .0;
    assert!(why.contains("come to 31457280 bytes"), "{why}");
    let logo = |name: &str| {
        let mut one = inline(b"x");
        one["filename"] = name.into();
        one["disposition"] = "inline".into();
        one["content_id"] = "logo@shop".into();
        one
    };
    let why = raw(serde_json::json!([logo("a.png"), logo("b.png")]))
        .unwrap_err()
        .0;
    assert!(
        why.contains("two attachments have content_id \"logo@shop\""),
        "{why}"
    );
}
