//! Each provider's answers, in its own shapes: the success body and id, the account
//! endpoint's body, and its documented error bodies and headers for throttling, server errors, permanent
//! rejections and refused credentials. The texts follow the providers' documentation
//! where it gives them (SES's exception names and messages, SendGrid's `errors` list
//! and rate-limit headers, Postmark's `ErrorCode`/`Message`, Mailgun's `message`).

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::state::Provider;

/// What to answer.
pub(crate) enum Reply<'a> {
    /// Accepted, with this provider id.
    Accepted { id: &'a str, to: &'a [String] },
    /// Over the quota, or a throttle rule.
    Throttled,
    /// A server error with this status.
    ServerError(u16),
    /// The account may not send.
    Suspended,
    /// A recipient the provider refuses.
    Rejected(&'a str),
    /// A request the provider cannot read.
    BadRequest(&'a str),
    /// Credentials refused: (SES's error type, message).
    Unauthorized(&'a str, &'a str),
    /// The account endpoint's answer: the account (Mailgun: the `domain`) may send;
    /// `sent` emails in the last 24 hours (SES).
    Account { domain: &'a str, sent: u64 },
}

fn respond(status: u16, headers: &[(&str, String)], body: Option<Value>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = match body {
        Some(body) => (status, axum::Json(body)).into_response(),
        None => status.into_response(),
    };
    for (name, value) in headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// The reply of `provider` to `reply`.
pub(crate) fn reply(provider: Provider, reply: Reply<'_>) -> Response {
    match provider {
        Provider::Ses => ses(reply),
        Provider::Sendgrid => sendgrid(reply),
        Provider::Postmark => postmark(reply),
        Provider::Mailgun => mailgun(reply),
    }
}

/// SES v2 (REST-JSON): the error type in `x-amzn-ErrorType`, `{"message": …}`.
fn ses(reply: Reply<'_>) -> Response {
    let error = |status: u16, kind: &str, message: &str| {
        respond(
            status,
            &[
                ("x-amzn-ErrorType", kind.to_string()),
                (
                    "x-amzn-RequestId",
                    "00000000-0000-4000-8000-000000000000".into(),
                ),
            ],
            Some(json!({ "message": message })),
        )
    };
    match reply {
        Reply::Accepted { id, .. } => respond(200, &[], Some(json!({ "MessageId": id }))),
        Reply::Throttled => error(429, "TooManyRequestsException", "Maximum sending rate exceeded."),
        Reply::ServerError(status) => error(status, "InternalFailure", "An internal error occurred."),
        Reply::Suspended => error(
            400,
            "AccountSuspendedException",
            "The message can't be sent because the account's ability to send email has been permanently restricted.",
        ),
        Reply::Rejected(to) => error(
            400,
            "MessageRejected",
            &format!("Email address is not verified. The following identities failed the check in region EU-WEST-1: {to}"),
        ),
        Reply::BadRequest(why) => error(400, "BadRequestException", why),
        Reply::Unauthorized(kind, message) => error(403, kind, message),
        Reply::Account { sent, .. } => respond(
            200,
            &[],
            Some(json!({
                "SendingEnabled": true,
                "ProductionAccessEnabled": true,
                "SendQuota": {
                    "Max24HourSend": 50000.0,
                    "MaxSendRate": 14.0,
                    "SentLast24Hours": sent as f64,
                },
            })),
        ),
    }
}

/// SendGrid v3: 202 with `X-Message-Id`; errors as `{"errors": [{"message", "field", "help"}]}`.
fn sendgrid(reply: Reply<'_>) -> Response {
    let error = |status: u16, headers: &[(&str, String)], message: &str, field: Value| {
        let body = json!({ "errors": [{ "message": message, "field": field, "help": null }] });
        respond(status, headers, Some(body))
    };
    match reply {
        Reply::Accepted { id, .. } => respond(202, &[("X-Message-Id", id.to_string())], None),
        Reply::Throttled => {
            let reset = chrono::Utc::now().timestamp() + 1;
            let headers = [
                ("X-RateLimit-Limit", "600".to_string()),
                ("X-RateLimit-Remaining", "0".to_string()),
                ("X-RateLimit-Reset", reset.to_string()),
            ];
            error(429, &headers, "too many requests", Value::Null)
        }
        Reply::ServerError(status) => error(status, &[], "internal error", Value::Null),
        Reply::Suspended => error(
            403,
            &[],
            "Your account has been suspended. Mail cannot be sent until this error is resolved.",
            Value::Null,
        ),
        Reply::Rejected(_) => error(
            400,
            &[],
            "Does not contain a valid address.",
            json!("personalizations.0.to.0.email"),
        ),
        Reply::BadRequest(why) => error(400, &[], why, Value::Null),
        Reply::Unauthorized(..) => error(
            401,
            &[],
            "The provided authorization grant is invalid, expired, or revoked",
            Value::Null,
        ),
        Reply::Account { .. } => respond(200, &[], Some(json!({ "scopes": ["mail.send"] }))),
    }
}

/// Postmark: `{"ErrorCode": n, "Message": …}`; request errors are HTTP 422.
fn postmark(reply: Reply<'_>) -> Response {
    let error = |status: u16, code: u32, message: &str| {
        respond(
            status,
            &[],
            Some(json!({ "ErrorCode": code, "Message": message })),
        )
    };
    match reply {
        Reply::Accepted { id, to } => respond(
            200,
            &[],
            Some(json!({
                "To": to.join(", "),
                "SubmittedAt": chrono::Utc::now().to_rfc3339(),
                "MessageID": id,
                "ErrorCode": 0,
                "Message": "OK",
            })),
        ),
        Reply::Throttled => error(429, 429, "Rate limit exceeded. Please retry after a moment."),
        Reply::ServerError(status) => error(status, 0, "Internal server error."),
        Reply::Suspended => error(
            422,
            412,
            "Your account has been suspended and is not allowed to send.",
        ),
        Reply::Rejected(to) => error(
            422,
            406,
            &format!("You tried to send to recipient(s) that have been marked as inactive. Found inactive addresses: {to}."),
        ),
        Reply::BadRequest(why) => error(422, 300, &format!("Invalid email request: {why}")),
        Reply::Unauthorized(..) => error(
            401,
            10,
            "The Server Token you provided in the X-Postmark-Server-Token request header was invalid.",
        ),
        Reply::Account { .. } => respond(200, &[], Some(json!({ "ID": 1, "Name": "postie-test" }))),
    }
}

/// Mailgun: `{"id": "<…>", "message": "Queued. Thank you."}`; errors `{"message": …}`.
fn mailgun(reply: Reply<'_>) -> Response {
    let error =
        |status: u16, message: &str| respond(status, &[], Some(json!({ "message": message })));
    match reply {
        Reply::Accepted { id, .. } => respond(
            200,
            &[],
            Some(json!({ "id": id, "message": "Queued. Thank you." })),
        ),
        Reply::Throttled => respond(
            429,
            &[("Retry-After", "1".into())],
            Some(json!({ "message": "Too many requests", "retry-seconds": 1 })),
        ),
        Reply::ServerError(status) => error(status, "Internal Server Error"),
        Reply::Suspended => error(
            403,
            "Domain is not allowed to send: the account is disabled",
        ),
        Reply::Rejected(to) => error(400, &format!("to parameter is not a valid address: {to}")),
        Reply::BadRequest(why) => error(400, why),
        Reply::Unauthorized(..) => (StatusCode::UNAUTHORIZED, "Forbidden").into_response(),
        Reply::Account { domain, .. } => respond(
            200,
            &[],
            Some(json!({ "domain": { "name": domain, "state": "active" } })),
        ),
    }
}
