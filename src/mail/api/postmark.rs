//! Postmark `POST /email` (`X-Postmark-Server-Token`). Like SendGrid it takes JSON
//! fields: postie carries over From, To, Cc, Bcc (comma-separated mailboxes), ReplyTo,
//! Subject, TextBody, HtmlBody, the job's headers and postie's Message-ID (`Headers`),
//! and the configured `MessageStream`. Postmark builds the MIME. It answers 200 with
//! `{"MessageID", "ErrorCode": 0}`; request errors are 422 with `{"ErrorCode", "Message"}`
//! (300 invalid request, 406 inactive recipient, 405/412 the account may not send…),
//! 401 a refused token, 429 throttled, 5xx its own trouble.
//!
//! Attachments go in `Attachments` (`Name`, `Content` base64, `ContentType`, and
//! `ContentID` `cid:…` for inline images), streamed (`payload.rs`); Postmark takes at
//! most 10 MB a message: refused before sending when larger.

use secrecy::{ExposeSecret, SecretString};
use serde_json::{json, Value};

use super::payload::json_with_files;
use super::{failure, fields, HttpRequest, Reply};
use crate::contract::Address;
use crate::mail::message::{mailbox_text, FileField};
use crate::mail::{Email, SendError};

/// Postmark's largest message: 10 MB.
const MAX_REQUEST: u64 = 10_000_000;

/// The endpoint, the token and the stream.
pub(super) struct Postmark {
    url: String,
    /// `GET /server`: the breaker's probe.
    account: String,
    token: SecretString,
    stream: String,
}

fn list(addresses: &[Address]) -> String {
    addresses
        .iter()
        .map(mailbox_text)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Postmark {
    pub(super) fn new(token: &SecretString, stream: &str, base: &str) -> Self {
        Self {
            url: format!("{base}/email"),
            account: format!("{base}/server"),
            token: token.clone(),
            stream: stream.to_string(),
        }
    }

    /// The server the token belongs to: the breaker's probe (it also proves the token).
    pub(super) fn account_request(&self) -> HttpRequest {
        HttpRequest::get(&self.account)
            .header("accept", "application/json")
            .secret_header("x-postmark-server-token", self.token.expose_secret())
    }

    pub(super) fn request(&self, email: &Email) -> Result<HttpRequest, SendError> {
        let f = fields(email)?;
        let headers: Vec<Value> = f
            .headers
            .iter()
            .map(|(name, value)| json!({ "Name": name, "Value": value }))
            .collect();
        let mut body = json!({
            "From": mailbox_text(&f.from),
            "To": list(&f.to),
            "Subject": f.subject,
            "Headers": headers,
            "MessageStream": self.stream,
        });
        for (key, addresses) in [("Cc", &f.cc), ("Bcc", &f.bcc)] {
            if !addresses.is_empty() {
                body[key] = list(addresses).into();
            }
        }
        if let Some(reply_to) = &f.reply_to {
            body["ReplyTo"] = mailbox_text(reply_to).into();
        }
        if let Some(text) = &f.text {
            body["TextBody"] = text.clone().into();
        }
        if let Some(html) = &f.html {
            body["HtmlBody"] = html.clone().into();
        }
        let request = HttpRequest::post(&self.url)
            .secret_header("x-postmark-server-token", self.token.expose_secret())
            .header("accept", "application/json");
        let describe = |file: &FileField, mark: &str| {
            let mut one = json!({
                "Name": file.filename, "Content": mark, "ContentType": file.content_type,
            });
            if let Some(id) = &file.content_id {
                one["ContentID"] = format!("cid:{id}").into();
            }
            one
        };
        let limit = (MAX_REQUEST, "Postmark's 10 MB message limit");
        json_with_files(request, body, "Attachments", email, describe, limit)
    }
}

/// `MessageID`, or the class of Postmark's error.
pub(super) fn read(reply: &Reply) -> Result<Option<String>, SendError> {
    let body = reply.json();
    let code = body["ErrorCode"].as_i64().unwrap_or(0);
    if reply.status.is_success() && code == 0 {
        return Ok(body["MessageID"].as_str().map(str::to_string));
    }
    let detail = match body["Message"].as_str() {
        Some(message) => format!("ErrorCode {code}: {message}"),
        None => reply.text(),
    };
    if reply.status.is_success() {
        // 200 with an error code: refused all the same.
        return Err(SendError::Permanent(crate::contract::readable(
            &format!("postmark answered 200: {detail}"),
            1_000,
        )));
    }
    Err(failure("postmark", reply, false, &detail))
}

#[cfg(test)]
mod tests {
    use super::super::reply;
    use super::*;

    fn error(status: u16, code: u32, message: &str) -> SendError {
        let body = json!({ "ErrorCode": code, "Message": message }).to_string();
        read(&reply(status, &[], &body)).unwrap_err()
    }

    #[test]
    fn postmark_replies_are_classed() {
        let ok = json!({ "To": "a@b.c", "MessageID": "pm-1", "ErrorCode": 0, "Message": "OK" });
        assert_eq!(
            read(&reply(200, &[], &ok.to_string())).unwrap().as_deref(),
            Some("pm-1")
        );
        assert!(matches!(
            error(429, 429, "Rate limit exceeded"),
            SendError::Throttled(_)
        ));
        assert!(matches!(
            error(500, 0, "Internal server error."),
            SendError::Transient(_)
        ));
        assert!(matches!(
            error(503, 0, "Unavailable"),
            SendError::Transient(_)
        ));
        assert!(matches!(
            error(401, 10, "bad token"),
            SendError::Unreachable(_)
        ));
        assert!(matches!(
            error(422, 406, "You tried to send to recipient(s) that have been marked as inactive."),
            SendError::Permanent(t) if t.contains("ErrorCode 406: You tried to send")
        ));
        assert!(matches!(
            error(422, 300, "Invalid email request"),
            SendError::Permanent(t) if t.contains("ErrorCode 300")
        ));
        assert!(matches!(
            error(200, 412, "pending approval"),
            SendError::Permanent(_)
        ));
    }
}
