//! Reports on stdin (`postie feedback ingest`): an RFC 3464 delivery status
//! notification or an RFC 5965 abuse report, its MIME read by `mail-parser` (RFC 6522
//! `multipart/report`: a human part, the machine-readable part, the original message
//! or its headers), every part's transfer encoding (base64, quoted-printable) decoded
//! and every header unfolded, as real reports need.
//!
//! - DSN (`report-type=delivery-status`): each per-recipient group with `Action:
//!   failed` is a bounce of its `Final-Recipient` (else `Original-Recipient`), hard
//!   when its `Status` is a hard bounce code (`mail::bounce`, as at send time).
//! - ARF (`report-type=feedback-report`): `Feedback-Type: abuse` is a complaint about
//!   `Original-Rcpt-To`, else the original's `To`.
//!
//! Both name the email by the original's Message-ID (the third part's headers); the
//! notification id is the report's own Message-ID, so feeding a report twice records
//! it once. Nothing here trusts the report: anyone can mail a bounce mailbox, so
//! `Inbox::record_feedback` suppresses an address only if postie sent that email to
//! it (issue 45).

use std::borrow::Cow;

use mail_parser::{Message, MessageParser, MessagePart, MimeHeaders, PartType};
use sha2::{Digest, Sha256};

use super::providers::evidence;
use crate::inbox::{Feedback, FeedbackKind};
use crate::mail::bounce::is_hard_status;

/// The most per-recipient groups read from one report (a DSN lists one per recipient
/// of the email, and postie's emails have a few).
const GROUPS: usize = 1000;

/// A group of `Name: value` fields (a DSN's per-message or per-recipient fields, an
/// ARF report's), or a part's headers, unfolded.
struct Fields<'a>(Option<Message<'a>>);

impl Fields<'_> {
    /// The first field `name`'s value (case-insensitive), each run of white space
    /// (a fold's line break among them) one space.
    fn get(&self, name: &str) -> Option<String> {
        let headers = self.0.as_ref()?.headers();
        let found = headers
            .iter()
            .find(|h| h.name().eq_ignore_ascii_case(name))?;
        let text = found.value().as_text()?;
        Some(text.split_whitespace().collect::<Vec<_>>().join(" "))
    }

    /// The first address of the field `name` (an address header: `To`).
    fn address(&self, name: &str) -> Option<String> {
        let headers = self.0.as_ref()?.headers();
        let found = headers
            .iter()
            .find(|h| h.name().eq_ignore_ascii_case(name))?;
        match found.value().as_address() {
            Some(list) => list.first()?.address().map(str::to_string),
            None => found.value().as_text().map(address),
        }
    }
}

/// Reads `text` as header fields (unknown fields as text).
fn fields(text: &[u8]) -> Fields<'_> {
    Fields(
        MessageParser::new()
            .default_header_text()
            .parse_headers(text),
    )
}

/// The field groups of a `message/delivery-status` or `message/feedback-report`
/// body: blocks of fields separated by blank lines.
fn groups(body: &str) -> Vec<String> {
    let text = body.replace("\r\n", "\n");
    let mut out = Vec::new();
    let mut block = String::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !block.is_empty() {
                out.push(std::mem::take(&mut block));
            }
        } else {
            block.push_str(line);
            block.push_str("\r\n");
        }
        if out.len() >= GROUPS {
            return out;
        }
    }
    if !block.is_empty() {
        out.push(block);
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

/// What the third part says of the original email: its Message-ID and `To`.
fn original(part: Option<&MessagePart<'_>>) -> (Option<String>, Option<String>) {
    let Some(part) = part else {
        return (None, None);
    };
    let headers = match &part.body {
        PartType::Message(m) => fields(m.raw_message()),
        _ => fields(part.contents()),
    };
    (headers.get("Message-ID"), headers.address("To"))
}

/// The report's notifications (none if it reports no failure or abuse), or why it
/// is not a report postie reads.
pub(crate) fn read(message: &[u8], hard_codes: &[String]) -> Result<Vec<Feedback>, String> {
    let report = MessageParser::new()
        .parse(message)
        .ok_or("not a message: no header")?;
    let ctype = report.content_type();
    let kind = ctype.map_or(String::new(), |c| {
        format!("{}/{}", c.ctype(), c.subtype().unwrap_or("")).to_ascii_lowercase()
    });
    if kind != "multipart/report" {
        return Err(format!("not a multipart/report but {kind:?}"));
    }
    let parts: Vec<&MessagePart<'_>> = match &report.root_part().body {
        PartType::Multipart(ids) => ids.iter().filter_map(|id| report.part(*id)).collect(),
        _ => Vec::new(),
    };
    let machine = parts
        .get(1)
        .ok_or("a report needs a second, machine-readable part")?;
    let machine: Cow<'_, str> = String::from_utf8_lossy(machine.contents());
    let (message_id, original_to) = original(parts.get(2).copied());
    let notification_id = match report.message_id() {
        Some(id) => format!("<{id}>"),
        None => format!("sha256:{}", hex::encode(Sha256::digest(message))),
    };
    let report_type = ctype.and_then(|c| c.attribute("report-type"));
    let (source, found) = match report_type.map(str::to_ascii_lowercase).as_deref() {
        Some("delivery-status") => ("dsn", dsn_failures(&machine, hard_codes)),
        Some("feedback-report") => ("arf", arf_complaint(&machine, original_to)?),
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
        .filter_map(|group| {
            let g = fields(group.as_bytes());
            if !g
                .get("Action")
                .is_some_and(|a| a.eq_ignore_ascii_case("failed"))
            {
                return None;
            }
            let to = g
                .get("Final-Recipient")
                .or_else(|| g.get("Original-Recipient"))?;
            let status = g.get("Status").unwrap_or_default();
            let diagnostic = g.get("Diagnostic-Code").unwrap_or_default();
            let hard = is_hard_status(&status, hard_codes);
            let said = format!("dsn Status: {status}; Diagnostic-Code: {diagnostic}");
            Some((FeedbackKind::Bounce { hard }, address(&to), said))
        })
        .collect()
}

/// An ARF report's complaint (`Feedback-Type: abuse`; other types name none).
fn arf_complaint(machine: &str, original_to: Option<String>) -> Result<Vec<Finding>, String> {
    let first = groups(machine).into_iter().next().unwrap_or_default();
    let report = fields(first.as_bytes());
    let feedback_type = report.get("Feedback-Type").unwrap_or_default();
    if !feedback_type.eq_ignore_ascii_case("abuse") {
        return Ok(Vec::new());
    }
    let to = report
        .get("Original-Rcpt-To")
        .map(|to| address(&to))
        .or(original_to)
        .ok_or("an abuse report without Original-Rcpt-To or the original's To")?;
    let said = format!(
        "arf Feedback-Type: {feedback_type}; User-Agent: {}",
        report.get("User-Agent").unwrap_or_default()
    );
    Ok(vec![(FeedbackKind::Complaint, to, said)])
}

#[cfg(test)]
mod tests;
