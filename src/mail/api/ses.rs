//! Amazon SES v2 `SendEmail` (`POST /v2/email/outbound-emails`) with `Content.Raw`:
//! the MIME postie built, base64, so the Message-ID and every header stay postie's.
//! The envelope's recipients (Bcc too) go in `Destination.ToAddresses` and the
//! envelope sender in `FromEmailAddress`; `ConfigurationSetName` when configured.
//! Signed with AWS's own SigV4 implementation (`aws-sigv4`), service `ses`.
//!
//! An email with attachments is streamed (`payload.rs`): the JSON around
//! `Content.Raw.Data`, and in it the MIME base64-encoded as it is read. SigV4 signs
//! the body's SHA-256, so the body is read twice: once to hash it, once to send it.
//! SES takes at most 40 MB a message, as sent (its attachments base64-encoded):
//! refused before sending when larger.
//!
//! Errors are REST-JSON: the type in `x-amzn-ErrorType` (`TooManyRequestsException`,
//! `MessageRejected`, `AccountSuspendedException`, `SendingPausedException`, …), the
//! text in `{"message": …}`. A 403 is the signature or the key refused
//! (`SignatureDoesNotMatch`, `UnrecognizedClientException`): postie's set-up, so
//! unreachable, not the job's fault.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
use aws_sigv4::sign::v4;
use base64::Engine as _;
use secrecy::ExposeSecret;

use super::payload::{split_json, Payload};
use super::{failure, HttpRequest, Reply};
use crate::config::ApiProvider;
use crate::mail::{stream, Email, SendError};

/// SES's largest message, as sent: 40 MB.
const MAX_MESSAGE: u64 = 40_000_000;

/// What every SES request needs.
pub(super) struct Ses {
    url: String,
    /// `GetAccount` (`GET /v2/email/account`): the breaker's probe.
    account: String,
    region: String,
    configuration_set: Option<String>,
    credentials: Credentials,
}

impl Ses {
    pub(super) fn new(provider: &ApiProvider, base: &str) -> anyhow::Result<Self> {
        let ApiProvider::Ses {
            region,
            configuration_set,
            access_key_id,
            secret_access_key,
            session_token,
        } = provider
        else {
            anyhow::bail!("not an SES endpoint");
        };
        let credentials = Credentials::new(
            access_key_id,
            secret_access_key.expose_secret(),
            session_token
                .as_ref()
                .map(|t| t.expose_secret().to_string()),
            None,
            "transport.url",
        );
        Ok(Self {
            url: format!("{base}/v2/email/outbound-emails"),
            account: format!("{base}/v2/email/account"),
            region: region.clone(),
            configuration_set: configuration_set.clone(),
            credentials,
        })
    }

    /// The signed `SendEmail` request.
    pub(super) fn request(&self, email: &Email) -> Result<HttpRequest, SendError> {
        let envelope = email.envelope();
        let streamed = email.is_streamed();
        let data_mark = stream::mark(&uuid::Uuid::new_v4().simple().to_string(), 0);
        let data = if streamed {
            data_mark.clone()
        } else {
            base64::engine::general_purpose::STANDARD.encode(email.formatted())
        };
        let mut body = serde_json::json!({
            "Destination": {
                "ToAddresses": envelope.to().iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            },
            "Content": {
                "Raw": { "Data": data },
            },
        });
        if let Some(from) = envelope.from() {
            body["FromEmailAddress"] = from.to_string().into();
        }
        if let Some(set) = &self.configuration_set {
            body["ConfigurationSetName"] = set.clone().into();
        }
        let content_type = ("content-type", "application/json");
        let request = HttpRequest::post(&self.url).header(content_type.0, content_type.1);
        if streamed {
            if email.size() > MAX_MESSAGE {
                return Err(SendError::Permanent(format!(
                    "ses: the email is {} bytes with its attachments, over SES's limit of {MAX_MESSAGE}",
                    email.size()
                )));
            }
            let (parts, _) = split_json(&body, &[data_mark])?;
            let payload = Payload::default()
                .text(parts[0].clone())
                .email(email, true)
                .text(parts[1].clone());
            let hash = SignableBody::Precomputed(payload.sha256_hex()?);
            return self
                .signed(request, "POST", &self.url, hash, Some(content_type))
                .map(|request| request.streamed(payload));
        }
        let body = serde_json::to_vec(&body).map_err(|e| {
            SendError::Permanent(format!("ses: the request cannot be encoded: {e}"))
        })?;
        let signable = SignableBody::Bytes(&body);
        let signed = self.signed(request, "POST", &self.url, signable, Some(content_type))?;
        Ok(signed.body(body))
    }

    /// The signed `GetAccount` request: the breaker's probe (it also proves the key).
    pub(super) fn account_request(&self) -> Result<HttpRequest, SendError> {
        self.signed(
            HttpRequest::get(&self.account),
            "GET",
            &self.account,
            SignableBody::Bytes(&[]),
            None,
        )
    }

    /// `request` with the SigV4 headers for `method url`, `body` and `header`.
    fn signed(
        &self,
        mut request: HttpRequest,
        method: &str,
        url: &str,
        body: SignableBody<'_>,
        header: Option<(&str, &str)>,
    ) -> Result<HttpRequest, SendError> {
        for (name, value) in self.sign(method, url, body, header)? {
            request = request.header(&name, value);
        }
        Ok(request)
    }

    /// The headers SigV4 adds (`authorization`, `x-amz-date`, and the session token).
    fn sign(
        &self,
        method: &str,
        url: &str,
        body: SignableBody<'_>,
        header: Option<(&str, &str)>,
    ) -> Result<Vec<(String, String)>, SendError> {
        // A signing failure is postie's set-up (a URL it cannot sign for), not the job's.
        let failed = |e: &dyn std::fmt::Display| {
            SendError::Unreachable(format!("ses: the request cannot be signed: {e}"))
        };
        let identity = self.credentials.clone().into();
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name("ses")
            .time(SystemTime::now())
            .settings(SigningSettings::default())
            .build()
            .map_err(|e| failed(&e))?
            .into();
        let signable =
            SignableRequest::new(method, url, header.into_iter(), body).map_err(|e| failed(&e))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| failed(&e))?
            .into_parts();
        Ok(instructions
            .headers()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect())
    }
}

/// `MessageId`, or the class of SES's error.
pub(super) fn read(reply: &Reply) -> Result<Option<String>, SendError> {
    let body = reply.json();
    if reply.status.is_success() {
        return Ok(body["MessageId"].as_str().map(str::to_string));
    }
    // `x-amzn-ErrorType: TooManyRequestsException:http://…`: the name before any ':'.
    let kind = reply.header("x-amzn-errortype");
    let kind = kind.split(':').next().unwrap_or("");
    let kind = if kind.is_empty() {
        body["__type"]
            .as_str()
            .unwrap_or("")
            .rsplit('#')
            .next()
            .unwrap_or("")
    } else {
        kind
    };
    let message = body["message"]
        .as_str()
        .or_else(|| body["Message"].as_str())
        .map(str::to_string)
        .unwrap_or_else(|| reply.text());
    let detail = format!("{kind}: {message}");
    let throttle = kind.contains("TooManyRequests") || kind.contains("Throttl");
    if reply.status.as_u16() == 403 {
        return Err(SendError::Unreachable(format!(
            "ses answered 403: {detail} (check the credentials and region in transport.url)"
        )));
    }
    Err(failure("ses", reply, throttle, &detail))
}

#[cfg(test)]
mod tests {
    use super::super::reply;
    use super::*;

    fn error(status: u16, kind: &str, message: &str) -> SendError {
        let body = serde_json::json!({ "message": message }).to_string();
        read(&reply(status, &[("x-amzn-ErrorType", kind)], &body)).unwrap_err()
    }

    #[test]
    fn ses_replies_are_classed() {
        let ok = reply(200, &[], r#"{"MessageId":"0100-abc"}"#);
        assert_eq!(read(&ok).unwrap().as_deref(), Some("0100-abc"));
        assert!(matches!(
            error(429, "TooManyRequestsException", "Maximum sending rate exceeded."),
            SendError::Throttled(t) if t.contains("Maximum sending rate exceeded.")
        ));
        assert!(matches!(
            error(400, "ThrottlingException:http://internal", "Rate exceeded"),
            SendError::Throttled(_)
        ));
        let suspended = error(400, "AccountSuspendedException", "restricted");
        assert!(
            matches!(&suspended, SendError::Permanent(t) if t.contains("AccountSuspendedException: restricted")),
            "{suspended:?}"
        );
        assert!(matches!(
            error(400, "MessageRejected", "Email address is not verified."),
            SendError::Permanent(t) if t.contains("Email address is not verified.")
        ));
        assert!(matches!(
            error(500, "InternalFailure", "x"),
            SendError::Transient(_)
        ));
        assert!(matches!(
            error(503, "ServiceUnavailable", "x"),
            SendError::Transient(_)
        ));
        assert!(matches!(
            error(403, "SignatureDoesNotMatch", "The request signature …"),
            SendError::Unreachable(_)
        ));
    }
}
