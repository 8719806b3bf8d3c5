//! Mailgun `POST /v3/DOMAIN/messages.mime` (HTTP Basic `api:KEY`): a multipart form
//! with one `to` field per envelope recipient (Bcc too) and the MIME postie built as
//! the `message` file, so the Message-ID and every header stay postie's. It answers
//! 200 with `{"id": "<…>", "message": "Queued. Thank you."}`; errors carry
//! `{"message": …}` (or plain text): 429 throttled, 401 the key refused, 400 an email
//! it cannot take, 403 a domain or account that may not send, 5xx its own trouble.
//! An email with attachments is streamed into the form (`payload.rs`); Mailgun takes
//! at most 25 MB a message: refused before sending when larger.

use secrecy::{ExposeSecret, SecretString};

use super::payload::Payload;
use super::{failure, HttpRequest, Reply};
use crate::mail::{Email, SendError};

/// Mailgun's largest message: 25 MB.
const MAX_REQUEST: u64 = 25_000_000;

/// The endpoint and the key.
pub(super) struct Mailgun {
    url: String,
    /// `GET /v3/domains/DOMAIN`: the breaker's probe.
    account: String,
    key: SecretString,
}

impl Mailgun {
    pub(super) fn new(domain: &str, key: &SecretString, base: &str) -> Self {
        Self {
            url: format!("{base}/v3/{domain}/messages.mime"),
            account: format!("{base}/v3/domains/{domain}"),
            key: key.clone(),
        }
    }

    /// The sending domain: the breaker's probe (it also proves the key).
    pub(super) fn account_request(&self) -> HttpRequest {
        HttpRequest::get(&self.account).basic_auth("api", self.key.expose_secret())
    }

    pub(super) fn request(&self, email: &Email) -> Result<HttpRequest, SendError> {
        let boundary = format!("postie-{}", uuid::Uuid::new_v4().simple());
        let mut body = Vec::with_capacity(email.formatted().len() + 512);
        for to in email.envelope().to() {
            body.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"to\"\r\n\r\n{to}\r\n"
                )
                .as_bytes(),
            );
        }
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"message\"; \
                 filename=\"message.mime\"\r\nContent-Type: message/rfc822\r\n\r\n"
            )
            .as_bytes(),
        );
        let end = format!("\r\n--{boundary}--\r\n");
        let request = HttpRequest::post(&self.url)
            .basic_auth("api", self.key.expose_secret())
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            );
        if email.is_streamed() {
            let payload = Payload::default()
                .text(body)
                .email(email, false)
                .text(end)
                .within(MAX_REQUEST, "Mailgun's 25 MB message limit")?;
            return Ok(request.streamed(payload));
        }
        body.extend_from_slice(email.formatted());
        body.extend_from_slice(end.as_bytes());
        Ok(request.body(body))
    }
}

/// `id`, or the class of Mailgun's error.
pub(super) fn read(reply: &Reply) -> Result<Option<String>, SendError> {
    let body = reply.json();
    if reply.status.is_success() {
        return Ok(body["id"].as_str().map(str::to_string));
    }
    let detail = body["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| reply.text());
    Err(failure("mailgun", reply, false, &detail))
}

#[cfg(test)]
mod tests {
    use super::super::reply;
    use super::*;

    #[test]
    fn mailgun_replies_are_classed() {
        let ok = reply(
            200,
            &[],
            r#"{"id":"<1.2@mg.example>","message":"Queued. Thank you."}"#,
        );
        assert_eq!(read(&ok).unwrap().as_deref(), Some("<1.2@mg.example>"));
        let e = |status, body: &str| read(&reply(status, &[], body)).unwrap_err();
        assert!(matches!(
            e(429, r#"{"message":"Too many requests"}"#),
            SendError::Throttled(_)
        ));
        assert!(matches!(
            e(500, r#"{"message":"Internal Server Error"}"#),
            SendError::Transient(_)
        ));
        assert!(
            matches!(e(401, "Forbidden"), SendError::Unreachable(t) if t.contains("Forbidden"))
        );
        assert!(matches!(
            e(400, r#"{"message":"to parameter is not a valid address"}"#),
            SendError::Permanent(t) if t.contains("to parameter is not a valid address")
        ));
        assert!(matches!(
            e(403, r#"{"message":"Domain is not allowed to send: the account is disabled"}"#),
            SendError::Permanent(t) if t.contains("account is disabled")
        ));
    }
}
