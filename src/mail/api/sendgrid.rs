//! SendGrid v3 `POST /v3/mail/send` (`Authorization: Bearer KEY`). The API takes JSON
//! fields, not MIME, so what postie carries over is: from, to, cc, bcc (one
//! personalization: one email, as with SMTP), reply-to, subject, the text and HTML
//! bodies (`content`, text first as SendGrid requires), the job's headers and postie's
//! Message-ID (`headers`). SendGrid builds the MIME (its own Date, boundaries and
//! encodings). It answers 202 with the id in `X-Message-Id`; errors are
//! `{"errors": [{"message", "field", "help"}]}`: 429 throttled (with `X-RateLimit-*`),
//! 401 the key refused, 400/403/413 the email or the account refused.
//!
//! Attachments go in `attachments` (`content` base64, `filename`, `type`,
//! `disposition`, and `content_id` for inline images), streamed (`payload.rs`);
//! SendGrid takes at most 30 MB a request: refused before sending when larger.

use secrecy::{ExposeSecret, SecretString};
use serde_json::{json, Value};

use super::payload::json_with_files;
use super::{failure, fields, HttpRequest, Reply};
use crate::contract::Address;
use crate::mail::message::FileField;
use crate::mail::{Email, SendError};

/// SendGrid's largest request: 30 MB.
const MAX_REQUEST: u64 = 30_000_000;

/// The endpoint and the key.
pub(super) struct SendGrid {
    url: String,
    /// `GET /v3/scopes`: the breaker's probe.
    account: String,
    key: SecretString,
}

fn person(address: &Address) -> Value {
    match &address.name {
        Some(name) => json!({ "email": address.email, "name": name }),
        None => json!({ "email": address.email }),
    }
}

impl SendGrid {
    pub(super) fn new(key: &SecretString, base: &str) -> Self {
        Self {
            url: format!("{base}/v3/mail/send"),
            account: format!("{base}/v3/scopes"),
            key: key.clone(),
        }
    }

    /// The key's scopes: the breaker's probe (it also proves the key).
    pub(super) fn account_request(&self) -> HttpRequest {
        HttpRequest::get(&self.account).bearer_auth(self.key.expose_secret())
    }

    pub(super) fn request(&self, email: &Email) -> Result<HttpRequest, SendError> {
        let f = fields(email)?;
        let mut personalization = json!({ "to": f.to.iter().map(person).collect::<Vec<_>>() });
        for (key, list) in [("cc", &f.cc), ("bcc", &f.bcc)] {
            if !list.is_empty() {
                personalization[key] = list.iter().map(person).collect::<Vec<_>>().into();
            }
        }
        let mut content = Vec::new();
        if let Some(text) = &f.text {
            content.push(json!({ "type": "text/plain", "value": text }));
        }
        if let Some(html) = &f.html {
            content.push(json!({ "type": "text/html", "value": html }));
        }
        let headers: serde_json::Map<String, Value> = f
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), Value::from(value.as_str())))
            .collect();
        let mut body = json!({
            "personalizations": [personalization],
            "from": person(&f.from),
            "subject": f.subject,
            "content": content,
            "headers": headers,
        });
        if let Some(reply_to) = &f.reply_to {
            body["reply_to"] = person(reply_to);
        }
        let request = HttpRequest::post(&self.url).bearer_auth(self.key.expose_secret());
        let describe = |file: &FileField, mark: &str| {
            let mut one = json!({
                "content": mark, "filename": file.filename, "type": file.content_type,
                "disposition": if file.content_id.is_some() { "inline" } else { "attachment" },
            });
            if let Some(id) = &file.content_id {
                one["content_id"] = id.clone().into();
            }
            one
        };
        let limit = (MAX_REQUEST, "SendGrid's 30 MB request limit");
        json_with_files(request, body, "attachments", email, describe, limit)
    }
}

/// `X-Message-Id`, or the class of SendGrid's error.
pub(super) fn read(reply: &Reply) -> Result<Option<String>, SendError> {
    if reply.status.is_success() {
        let id = reply.header("x-message-id");
        return Ok((!id.is_empty()).then(|| id.to_string()));
    }
    let body = reply.json();
    let messages: Vec<String> = body["errors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let message = e["message"].as_str()?;
            Some(match e["field"].as_str() {
                Some(field) => format!("{message} ({field})"),
                None => message.to_string(),
            })
        })
        .collect();
    let detail = if messages.is_empty() {
        reply.text()
    } else {
        messages.join("; ")
    };
    Err(failure("sendgrid", reply, false, &detail))
}

#[cfg(test)]
mod tests {
    use super::super::reply;
    use super::*;

    fn error(status: u16, message: &str) -> SendError {
        let body = json!({ "errors": [{ "message": message, "field": null, "help": null }] });
        read(&reply(status, &[], &body.to_string())).unwrap_err()
    }

    #[test]
    fn sendgrid_replies_are_classed() {
        let ok = reply(202, &[("X-Message-Id", "sg-1")], "");
        assert_eq!(read(&ok).unwrap().as_deref(), Some("sg-1"));
        assert!(
            matches!(error(429, "too many requests"), SendError::Throttled(t) if t.contains("too many requests"))
        );
        assert!(matches!(
            error(500, "internal error"),
            SendError::Transient(_)
        ));
        assert!(matches!(
            error(401, "The provided authorization grant is invalid"),
            SendError::Unreachable(_)
        ));
        assert!(matches!(
            error(403, "Your account has been suspended."),
            SendError::Permanent(t) if t.contains("Your account has been suspended.")
        ));
        let invalid = json!({ "errors": [{ "message": "Does not contain a valid address.", "field": "personalizations.0.to.0.email" }] });
        let e = read(&reply(400, &[], &invalid.to_string())).unwrap_err();
        assert!(
            matches!(&e, SendError::Permanent(t) if t.contains("Does not contain a valid address. (personalizations.0.to.0.email)")),
            "{e:?}"
        );
        assert!(
            matches!(read(&reply(502, &[], "<html>bad gateway</html>")), Err(SendError::Transient(t)) if t.contains("bad gateway"))
        );
    }
}
