//! Reports on stdin (`postie feedback ingest`): an RFC 3464 delivery status
//! notification or an RFC 5965 abuse report, read by a minimal MIME reader written for
//! these shapes (RFC 6522 `multipart/report`: a human part, the machine-readable
//! part, the original message or its headers). Headers are unfolded; the report
//! parts are plain text by their RFCs, so no transfer decoding is done.
//!
//! - DSN (`report-type=delivery-status`): each per-recipient group with `Action:
//!   failed` is a bounce of its `Final-Recipient` (else `Original-Recipient`), hard
//!   when its `Status` is a hard bounce code (`mail::bounce`, as at send time).
//! - ARF (`report-type=feedback-report`): `Feedback-Type: abuse` is a complaint about
//!   `Original-Rcpt-To`, else the original's `To`.
//!
//! Both are matched by the original's Message-ID (the third part's headers); the
//! notification id is the report's own Message-ID, so feeding a report twice
//! records it once.

use sha2::{Digest, Sha256};

use super::providers::evidence;
use crate::inbox::{Feedback, FeedbackKind};
use crate::mail::bounce::is_hard_status;

/// Header fields, unfolded, in order.
type Fields = Vec<(String, String)>;

/// The value of the first field `name` (case-insensitive).
fn field<'a>(fields: &'a Fields, name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Reads a header block (folded lines joined) and returns it with the rest.
fn headers(text: &str) -> (Fields, &str) {
    let mut fields: Fields = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (line, after) = rest.split_once('\n').unwrap_or((rest, ""));
        if line.trim().is_empty() {
            return (fields, after);
        }
        rest = after;
        if line.starts_with([' ', '\t']) {
            if let Some((_, value)) = fields.last_mut() {
                value.push(' ');
                value.push_str(line.trim());
            }
        } else if let Some((name, value)) = line.split_once(':') {
            fields.push((name.trim().to_string(), value.trim().to_string()));
        }
    }
    (fields, rest)
}

/// A media type's value (lower-cased) and its parameters (names lower-cased).
fn media_type(value: &str) -> (String, Vec<(String, String)>) {
    let mut parts = value.split(';');
    let kind = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    let params = parts
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_ascii_lowercase(),
                v.trim().trim_matches('"').to_string(),
            )
        })
        .collect();
    (kind, params)
}

/// The parts of a multipart body (each its headers and body).
fn parts<'a>(body: &'a str, boundary: &str) -> Vec<(Fields, &'a str)> {
    let delimiter = format!("--{boundary}");
    let mut out = Vec::new();
    let mut chunks = body.split(&delimiter).skip(1);
    for chunk in chunks.by_ref() {
        if chunk.starts_with("--") {
            break;
        }
        // The delimiter line's end, then the part; the CRLF before the next
        // delimiter belongs to it.
        let part = chunk.split_once('\n').map_or("", |(_, p)| p);
        let part = part.strip_suffix('\n').unwrap_or(part);
        let (fields, content) = headers(part);
        out.push((fields, content));
    }
    out
}

/// The field groups of a `message/delivery-status` or `message/feedback-report` body.
fn groups(text: &str) -> Vec<Fields> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.trim().is_empty() {
        let trimmed = rest.trim_start_matches('\n');
        let (fields, after) = headers(trimmed);
        if !fields.is_empty() {
            out.push(fields);
        }
        if after.len() == rest.len() {
            break;
        }
        rest = after;
    }
    out
}

/// `rfc822; a@x` or `Name <a@x>` → `a@x`.
fn address(value: &str) -> String {
    let bare = value.split_once(';').map_or(value, |(_, a)| a);
    match bare.split_once('<').and_then(|(_, a)| a.split_once('>')) {
        Some((inner, _)) => inner.trim().to_string(),
        None => bare.trim().to_string(),
    }
}

/// The report's notifications (none if it reports no failure or abuse), or why it
/// is not a report postie reads.
pub(crate) fn read(message: &[u8], hard_codes: &[String]) -> Result<Vec<Feedback>, String> {
    let text = String::from_utf8_lossy(message).replace("\r\n", "\n");
    let (top, body) = headers(&text);
    let (kind, params) = media_type(field(&top, "Content-Type").unwrap_or(""));
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if kind != "multipart/report" {
        return Err(format!("not a multipart/report but {kind:?}"));
    }
    let boundary = param("boundary").ok_or("multipart/report without a boundary")?;
    let parts = parts(body, boundary);
    let machine = parts
        .get(1)
        .ok_or("a report needs a second, machine-readable part")?;
    let original = parts
        .get(2)
        .map(|(_, content)| headers(content).0)
        .unwrap_or_default();
    let message_id = field(&original, "Message-ID").map(str::to_string);
    let notification_id = match field(&top, "Message-ID") {
        Some(id) => id.to_string(),
        None => format!("sha256:{}", hex::encode(Sha256::digest(message))),
    };
    let (source, found) = match param("report-type").map(str::to_ascii_lowercase).as_deref() {
        Some("delivery-status") => ("dsn", dsn_failures(machine.1, hard_codes)),
        Some("feedback-report") => ("arf", arf_complaint(machine.1, &original)?),
        other => {
            return Err(format!(
                "a report of type {other:?}, not delivery-status or feedback-report"
            ))
        }
    };
    Ok(found
        .into_iter()
        .map(|(kind, address, said)| Feedback {
            source: source.into(),
            notification_id: notification_id.clone(),
            kind,
            address,
            message_id: message_id.clone(),
            provider_message_id: None,
            evidence: evidence(said),
        })
        .collect())
}

/// What a report says of one recipient: kind, address, evidence.
type Finding = (FeedbackKind, String, String);

/// A DSN's per-recipient groups with `Action: failed`: bounces, hard by `Status`.
fn dsn_failures(machine: &str, hard_codes: &[String]) -> Vec<Finding> {
    groups(machine)
        .iter()
        .skip(1)
        .filter(|g| field(g, "Action").is_some_and(|a| a.eq_ignore_ascii_case("failed")))
        .filter_map(|g| {
            let to = field(g, "Final-Recipient").or_else(|| field(g, "Original-Recipient"))?;
            let status = field(g, "Status").unwrap_or("");
            let diagnostic = field(g, "Diagnostic-Code").unwrap_or("");
            let hard = is_hard_status(status, hard_codes);
            let said = format!("dsn Status: {status}; Diagnostic-Code: {diagnostic}");
            Some((FeedbackKind::Bounce { hard }, address(to), said))
        })
        .collect()
}

/// An ARF report's complaint (`Feedback-Type: abuse`; other types name none).
fn arf_complaint(machine: &str, original: &Fields) -> Result<Vec<Finding>, String> {
    let report = groups(machine).into_iter().next().unwrap_or_default();
    let feedback_type = field(&report, "Feedback-Type").unwrap_or("");
    if !feedback_type.eq_ignore_ascii_case("abuse") {
        return Ok(Vec::new());
    }
    let to = field(&report, "Original-Rcpt-To")
        .or_else(|| field(original, "To"))
        .ok_or("an abuse report without Original-Rcpt-To or the original's To")?;
    let said = format!(
        "arf Feedback-Type: {feedback_type}; User-Agent: {}",
        field(&report, "User-Agent").unwrap_or("")
    );
    Ok(vec![(FeedbackKind::Complaint, address(to), said)])
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_dsn_reads_its_failed_recipients_hard_by_status() {
        let codes = crate::config::SuppressionSettings::default().hard_bounce_codes;
        let notes = read(DSN.as_bytes(), &codes).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(notes[0].address, "gone@example.com");
        assert_eq!(notes[0].kind, FeedbackKind::Bounce { hard: true });
        assert_eq!(notes[0].message_id.as_deref(), Some("<abc@postie.local>"));
        assert_eq!(notes[0].notification_id, "<dsn-1@mx.example>");
        assert!(
            notes[0].evidence.contains("550 5.1.1 no such user"),
            "{}",
            notes[0].evidence
        );
        assert_eq!(notes[1].kind, FeedbackKind::Bounce { hard: false });
        assert!(read(b"Content-Type: text/plain\r\n\r\nhi", &codes).is_err());
        assert_eq!(address("Ann <ann@x>"), "ann@x");
        assert_eq!(address("rfc822; <ann@x>"), "ann@x");
    }
}
