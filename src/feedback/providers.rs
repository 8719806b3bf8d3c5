//! SendGrid's, Postmark's and Mailgun's webhooks: each request authenticated as its
//! provider documents, then read into [`Feedback`]s (events of other kinds skipped):
//! SendGrid's ECDSA-signed events, Postmark's basic auth, Mailgun's HMAC and its
//! token, which `Hooks::once` remembers through `Inbox::remember_token`.

use axum::http::HeaderMap;
use base64::Engine;
use secrecy::ExposeSecret;
use serde_json::Value;

use super::verify::{hmac_valid, p256_valid, same_secret};
use super::Refused;
use crate::config::{MailgunSettings, PostmarkSettings, SendgridSettings};
use crate::inbox::{Feedback, FeedbackKind};

/// The longest evidence kept from a notification.
const EVIDENCE_CHARS: usize = 500;

/// `text`, cut to [`EVIDENCE_CHARS`].
pub(super) fn evidence(text: String) -> String {
    match text.char_indices().nth(EVIDENCE_CHARS) {
        Some((at, _)) => text[..at].to_string(),
        None => text,
    }
}

/// A string member (or a number, as text).
fn text<'a>(v: &'a Value, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match v.get(name)? {
        Value::String(s) if !s.trim().is_empty() => Some(s.as_str().into()),
        Value::Number(n) => Some(n.to_string().into()),
        _ => None,
    }
}

/// A header's value, as text.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Whether a signed `timestamp` (Unix seconds) is within `max_age` of `now`.
fn fresh(timestamp: &str, now: i64, max_age: std::time::Duration) -> bool {
    timestamp
        .trim()
        .parse::<i64>()
        .is_ok_and(|t| (now - t).unsigned_abs() <= max_age.as_secs())
}

/// SendGrid's Signed Event Webhook: ECDSA P-256 over the timestamp and the raw body.
pub(super) fn sendgrid(
    cfg: &SendgridSettings,
    headers: &HeaderMap,
    body: &[u8],
    now: i64,
) -> Result<Vec<Feedback>, Refused> {
    let key = cfg.public_key.as_ref().ok_or(Refused::Forbidden(
        "feedback.sendgrid.public_key is not set",
    ))?;
    let (Some(sig), Some(ts)) = (
        header(headers, "x-twilio-email-event-webhook-signature"),
        header(headers, "x-twilio-email-event-webhook-timestamp"),
    ) else {
        return Err(Refused::Unauthenticated("no signature"));
    };
    if !fresh(ts, now, cfg.max_age) {
        return Err(Refused::Forbidden("stale timestamp"));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let (Ok(spki), Ok(sig)) = (
        b64.decode(key.expose_secret().trim()),
        b64.decode(sig.trim()),
    ) else {
        return Err(Refused::Forbidden("bad signature"));
    };
    let signed = [ts.as_bytes(), body].concat();
    if !p256_valid(&spki, &signed, &sig) {
        return Err(Refused::Forbidden("bad signature"));
    }
    let events: Vec<Value> = serde_json::from_slice(body)
        .map_err(|e| Refused::Malformed(format!("not a JSON array of events: {e}")))?;
    Ok(events.iter().filter_map(sendgrid_event).collect())
}

/// One SendGrid event, if it is a bounce, a drop or a spam report.
fn sendgrid_event(e: &Value) -> Option<Feedback> {
    let event = text(e, "event")?;
    let kind = match &*event {
        // `type`: bounce (the address does not exist) or blocked (the receiver refused
        // this email: not the address's fault).
        "bounce" => FeedbackKind::Bounce {
            hard: text(e, "type").as_deref() != Some("blocked"),
        },
        "dropped" => FeedbackKind::Bounce { hard: false },
        "spamreport" => FeedbackKind::Complaint,
        _ => return None,
    };
    let detail = [text(e, "type"), text(e, "status"), text(e, "reason")]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" ");
    Some(Feedback {
        source: "sendgrid".into(),
        notification_id: text(e, "sg_event_id")?.into_owned(),
        kind,
        address: text(e, "email")?.into_owned(),
        message_id: text(e, "smtp-id").map(|s| s.into_owned()),
        provider_message_id: text(e, "sg_message_id")
            .and_then(|id| id.split('.').next().map(str::to_string)),
        evidence: evidence(format!("sendgrid {event}: {detail}")),
    })
}

/// Postmark's bounce and spam-complaint webhooks, behind HTTP basic auth.
pub(super) fn postmark(
    cfg: &PostmarkSettings,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Vec<Feedback>, Refused> {
    let (Some(user), Some(password)) = (&cfg.user, &cfg.password) else {
        return Err(Refused::Forbidden(
            "feedback.postmark.user and password are not set",
        ));
    };
    let given = header(headers, "authorization")
        .and_then(|h| h.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or(Refused::Unauthenticated("no basic auth"))?;
    let expected = format!("{user}:{}", password.expose_secret());
    if !same_secret(&given, &expected) {
        return Err(Refused::Forbidden("wrong user or password"));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::Malformed(format!("not a JSON object: {e}")))?;
    let kind = match text(&v, "RecordType").as_deref() {
        Some("Bounce") => FeedbackKind::Bounce {
            hard: text(&v, "Type").as_deref() == Some("HardBounce"),
        },
        Some("SpamComplaint") => FeedbackKind::Complaint,
        Some(_) => return Ok(Vec::new()),
        None => return Err(Refused::Malformed("no RecordType".into())),
    };
    let (Some(id), Some(email)) = (text(&v, "ID"), text(&v, "Email")) else {
        return Err(Refused::Malformed("no ID or Email".into()));
    };
    let detail = [
        text(&v, "Type"),
        text(&v, "Description"),
        text(&v, "Details"),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(": ");
    Ok(vec![Feedback {
        source: "postmark".into(),
        notification_id: id.into_owned(),
        kind,
        address: email.into_owned(),
        message_id: None,
        provider_message_id: text(&v, "MessageID").map(|s| s.into_owned()),
        evidence: evidence(format!("postmark {detail}")),
    }])
}

/// A Mailgun request whose signature holds: its notes, and the token to remember
/// until `remember_until` (Unix seconds), past which its timestamp is refused anyway.
pub(super) struct Signed {
    pub(super) notes: Vec<Feedback>,
    pub(super) token: String,
    pub(super) remember_until: i64,
}

/// Mailgun's webhooks: HMAC-SHA256 of timestamp and token under the signing key. The
/// event itself is not signed: the caller remembers the token (`Hooks::once`).
pub(super) fn mailgun(cfg: &MailgunSettings, body: &[u8], now: i64) -> Result<Signed, Refused> {
    let key = cfg.signing_key.as_ref().ok_or(Refused::Forbidden(
        "feedback.mailgun.signing_key is not set",
    ))?;
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::Malformed(format!("not a JSON object: {e}")))?;
    let sig = v.get("signature").unwrap_or(&Value::Null);
    let (Some(ts), Some(token), Some(signature)) = (
        text(sig, "timestamp"),
        text(sig, "token"),
        text(sig, "signature"),
    ) else {
        return Err(Refused::Unauthenticated("no signature"));
    };
    if !fresh(&ts, now, cfg.max_age) {
        return Err(Refused::Forbidden("stale timestamp"));
    }
    let signed = format!("{ts}{token}");
    if !hmac_valid(
        key.expose_secret().as_bytes(),
        signed.as_bytes(),
        &signature,
    ) {
        return Err(Refused::Forbidden("bad signature"));
    }
    let e = v
        .get("event-data")
        .ok_or_else(|| Refused::Malformed("no event-data".into()))?;
    // Twice the window: a timestamp ahead of this clock is accepted as long after.
    let window = i64::try_from(cfg.max_age.as_secs()).unwrap_or(i64::MAX / 4);
    Ok(Signed {
        notes: mailgun_event(e)?,
        token: token.into_owned(),
        remember_until: ts
            .trim()
            .parse::<i64>()
            .unwrap_or(now)
            .saturating_add(2 * window),
    })
}

/// One Mailgun event, if it is a failure or a complaint.
fn mailgun_event(e: &Value) -> Result<Vec<Feedback>, Refused> {
    let kind = match text(e, "event").as_deref() {
        Some("failed") => FeedbackKind::Bounce {
            hard: text(e, "severity").as_deref() == Some("permanent"),
        },
        Some("complained") => FeedbackKind::Complaint,
        _ => return Ok(Vec::new()),
    };
    let (Some(id), Some(recipient)) = (text(e, "id"), text(e, "recipient")) else {
        return Err(Refused::Malformed("no id or recipient".into()));
    };
    let status = e.get("delivery-status").unwrap_or(&Value::Null);
    let detail = [
        text(e, "severity"),
        text(e, "reason"),
        text(status, "code"),
        text(status, "description"),
        text(status, "message"),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(" ");
    let message_id = e
        .pointer("/message/headers/message-id")
        .and_then(Value::as_str)
        .map(str::to_string);
    Ok(vec![Feedback {
        source: "mailgun".into(),
        notification_id: id.into_owned(),
        kind,
        address: recipient.into_owned(),
        message_id,
        provider_message_id: None,
        evidence: evidence(format!("mailgun {detail}")),
    }])
}

#[cfg(test)]
mod tests;
