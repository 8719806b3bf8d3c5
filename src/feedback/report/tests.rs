//! The report reader: the shapes of real DSNs and ARF reports, their transfer
//! encodings, and arbitrary bytes.

use base64::Engine;
use proptest::prelude::*;

use super::*;
use crate::feedback::fuzz;

const DSN: &str = "From: MAILER-DAEMON@mx.example\r\nMessage-ID: <dsn-1@mx.example>\r\n\
Content-Type: multipart/report; report-type=delivery-status;\r\n\tboundary=\"B1\"\r\n\r\n\
--B1\r\nContent-Type: text/plain\r\n\r\nYour message could not be delivered.\r\n\
--B1\r\nContent-Type: message/delivery-status\r\n\r\nReporting-MTA: dns; mx.example\r\n\r\n\
Final-Recipient: rfc822; gone@example.com\r\nAction: failed\r\nStatus: 5.1.1\r\n\
Diagnostic-Code: smtp; 550 5.1.1 no such\r\n  user\r\n\r\n\
Final-Recipient: rfc822; full@example.com\r\nAction: failed\r\nStatus: 5.2.2\r\n\r\n\
Final-Recipient: rfc822; later@example.com\r\nAction: delayed\r\nStatus: 4.4.7\r\n\r\n\
--B1\r\nContent-Type: text/rfc822-headers\r\n\r\nMessage-ID: <abc@postie.local>\r\nTo: gone@example.com\r\n\r\n\
--B1--\r\n";

fn codes() -> Vec<String> {
    crate::config::SuppressionSettings::default().hard_bounce_codes
}

#[test]
fn a_dsn_reads_its_failed_recipients_hard_by_status() {
    let notes = read(DSN.as_bytes(), &codes()).unwrap();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert_eq!(notes[0].address, "gone@example.com");
    assert_eq!(notes[0].kind, FeedbackKind::Bounce { hard: true });
    assert_eq!(notes[0].message_id.as_deref(), Some("abc@postie.local"));
    assert_eq!(notes[0].notification_id, "<dsn-1@mx.example>");
    assert!(
        notes[0].evidence.contains("550 5.1.1 no such user"),
        "{}",
        notes[0].evidence
    );
    assert_eq!(notes[1].kind, FeedbackKind::Bounce { hard: false });
    assert!(read(b"Content-Type: text/plain\r\n\r\nhi", &codes()).is_err());
    assert_eq!(address("Ann <ann@x>"), "ann@x");
    assert_eq!(address("rfc822; <ann@x>"), "ann@x");
}

/// [`DSN`] with its report part and its headers part in `encoding`, written by `encode`.
fn encoded(encoding: &str, encode: impl Fn(&str) -> String) -> String {
    let status = "Reporting-MTA: dns; mx.example\r\n\r\nFinal-Recipient: rfc822; gone@example.com\r\nAction: failed\r\nStatus: 5.1.1\r\nDiagnostic-Code: smtp; 550 5.1.1 no such user\r\n";
    let headers = "Message-ID: <abc@postie.local>\r\nTo: gone@example.com\r\n";
    format!(
        "From: MAILER-DAEMON@mx.example\r\nMessage-ID: <dsn-2@mx.example>\r\n\
Content-Type: multipart/report; report-type=delivery-status; boundary=\"B2\"\r\n\r\n\
--B2\r\nContent-Type: text/plain\r\n\r\nUndelivered.\r\n\
--B2\r\nContent-Type: message/delivery-status\r\nContent-Transfer-Encoding: {encoding}\r\n\r\n{}\r\n\
--B2\r\nContent-Type: text/rfc822-headers\r\nContent-Transfer-Encoding: {encoding}\r\n\r\n{}\r\n\
--B2--\r\n",
        encode(status),
        encode(headers)
    )
}

#[test]
fn base64_and_quoted_printable_parts_are_decoded() {
    let b64 = encoded("base64", |t| {
        let e = base64::engine::general_purpose::STANDARD.encode(t);
        let lines: Vec<_> = e
            .as_bytes()
            .chunks(60)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect();
        lines.join("\r\n")
    });
    // Soft line breaks inside the address and the id, '=' written as =3D.
    let qp = encoded("quoted-printable", |t| {
        t.replace("gone@", "go=\r\nne=40")
            .replace("<abc@", "<a=\r\nbc@")
            .replace("5.1.1 no", "5.1.1=20no")
    });
    for report in [b64, qp] {
        let notes = read(report.as_bytes(), &codes()).unwrap();
        assert_eq!(notes.len(), 1, "{report}\n{notes:?}");
        assert_eq!(notes[0].address, "gone@example.com");
        assert_eq!(notes[0].kind, FeedbackKind::Bounce { hard: true });
        assert_eq!(notes[0].message_id.as_deref(), Some("abc@postie.local"));
    }
}

#[test]
fn an_arf_report_names_its_complaint() {
    let arf = "From: fbl@isp.example\r\nMessage-ID: <arf-9@isp.example>\r\nMIME-Version: 1.0\r\n\
Content-Type: multipart/report; report-type=feedback-report; boundary=\"part\"\r\n\r\n\
--part\r\nContent-Type: text/plain\r\n\r\nThis is an email abuse report.\r\n\
--part\r\nContent-Type: message/feedback-report\r\n\r\nFeedback-Type: abuse\r\nUser-Agent: SomeISP/1.0\r\nVersion: 1\r\n\r\n\
--part\r\nContent-Type: message/rfc822\r\n\r\nFrom: noreply@shop.example\r\nTo: Angry <angry@example.com>\r\nMessage-ID: <m1@postie.local>\r\nSubject: Hi\r\n\r\nHello\r\n\
--part--\r\n";
    let notes = read(arf.as_bytes(), &codes()).unwrap();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(notes[0].source, "arf");
    assert_eq!(notes[0].kind, FeedbackKind::Complaint);
    assert_eq!(notes[0].address, "angry@example.com");
    assert_eq!(notes[0].message_id.as_deref(), Some("m1@postie.local"));
    assert_eq!(notes[0].notification_id, "<arf-9@isp.example>");
}

proptest! {
    #[test]
    fn arbitrary_bytes_are_refused_or_read_without_panic(body in fuzz::bytes(8192)) {
        let notes = fuzz::bounded(|| read(&body, &codes()));
        if let Ok(notes) = notes {
            prop_assert!(notes.len() <= GROUPS);
        }
    }

    #[test]
    fn arbitrary_parts_of_a_report_are_read_without_panic(
        status in "(\\PC{0,30}(: |\r\n|\r\n\r\n)){0,20}",
        head in "(\\PC{0,30}(: |\r\n)){0,8}",
        encoding in proptest::sample::select(&["7bit", "base64", "quoted-printable", "x"][..]),
        kind in proptest::sample::select(&["delivery-status", "feedback-report", "other"][..]),
    ) {
        let report = format!(
            "Content-Type: multipart/report; report-type={kind}; boundary=\"b\"\r\n\r\n\
--b\r\n\r\nhuman\r\n--b\r\nContent-Transfer-Encoding: {encoding}\r\n\r\n{status}\r\n\
--b\r\nContent-Type: text/rfc822-headers\r\nContent-Transfer-Encoding: {encoding}\r\n\r\n{head}\r\n--b--\r\n"
        );
        let notes = fuzz::bounded(|| read(report.as_bytes(), &codes()));
        if let Ok(notes) = notes {
            prop_assert!(notes.iter().all(|n| n.evidence.chars().count() <= 500));
        }
    }
}
