//! `feedback.*`: the providers' bounce and complaint webhooks (issue 30), and what
//! their notices and the reports are trusted with (issue 45).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::de::{duration, optional_addr};

/// The sources of feedback, as `postie_feedback.source` and `feedback.trust_unmatched`
/// name them: the webhooks' providers and the two kinds of report.
pub(crate) const FEEDBACK_SOURCES: &[&str] =
    &["ses", "sendgrid", "postmark", "mailgun", "dsn", "arf"];

/// The feedback endpoint (`/feedback/<provider>`): bounces and complaints the
/// providers report after the email was accepted. Off unless `listen` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedbackSettings {
    /// Where `/feedback/ses`, `/feedback/sendgrid`, `/feedback/postmark` and
    /// `/feedback/mailgun` listen (its own address, not `http.listen`); empty: off.
    #[serde(deserialize_with = "optional_addr")]
    pub listen: Option<SocketAddr>,
    /// The largest request body read; a larger one is refused (413) unread.
    pub max_body_bytes: usize,
    /// Each request, body and database included, within this (and each fetch of an
    /// SNS certificate or subscription URL).
    #[serde(deserialize_with = "duration")]
    pub request_timeout: Duration,
    /// The sources (`ses`, `sendgrid`, `postmark`, `mailgun`, `dsn`, `arf`) whose
    /// notices suppress an address even when they match no email postie sent to it
    /// (by Message-ID or the provider's id, the address among that email's
    /// recipients). Empty, the default: an unmatched notice is recorded and suppresses
    /// no one. Anyone who can mail the bounce mailbox can write a DSN or an ARF
    /// report, so trusting `dsn` or `arf` lets them suppress any address.
    pub trust_unmatched: Vec<String>,
    /// Amazon SES through SNS.
    pub sns: SnsSettings,
    /// SendGrid's signed event webhook.
    pub sendgrid: SendgridSettings,
    /// Postmark's bounce and spam-complaint webhooks.
    pub postmark: PostmarkSettings,
    /// Mailgun's webhooks.
    pub mailgun: MailgunSettings,
}

impl Default for FeedbackSettings {
    fn default() -> Self {
        Self {
            listen: None,
            max_body_bytes: 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            trust_unmatched: Vec::new(),
            sns: SnsSettings::default(),
            sendgrid: SendgridSettings::default(),
            postmark: PostmarkSettings::default(),
            mailgun: MailgunSettings::default(),
        }
    }
}

impl FeedbackSettings {
    /// Whether an unmatched notice from `source` suppresses its address.
    pub fn trusts_unmatched(&self, source: &str) -> bool {
        self.trust_unmatched.iter().any(|s| s == source)
    }

    /// The rules the types cannot express; the line names the key.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.max_body_bytes == 0 || self.request_timeout.is_zero() {
            return Err("feedback.max_body_bytes and request_timeout must be above zero".into());
        }
        if let Some(unknown) = self
            .trust_unmatched
            .iter()
            .find(|s| !FEEDBACK_SOURCES.contains(&s.as_str()))
        {
            return Err(format!(
                "feedback.trust_unmatched: {unknown:?} is not a source of feedback ({})",
                FEEDBACK_SOURCES.join(", ")
            ));
        }
        if self.listen.is_some() && self.sns.enabled && self.sns.topic_arns.is_empty() {
            return Err("feedback.sns.topic_arns is empty while /feedback/ses is served (feedback.listen): SNS signs every topic's notifications with the same certificate, so any AWS account could suppress any address; name your SES notification topics, or set feedback.sns.enabled = false".into());
        }
        if self.sns.max_age.is_zero() || self.mailgun.max_tokens == 0 {
            return Err(
                "feedback.sns.max_age and feedback.mailgun.max_tokens must be above zero".into(),
            );
        }
        Ok(())
    }
}

/// SNS: every message's signature is verified (SignatureVersion 1 and 2), and only
/// the operator's topics are heard.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnsSettings {
    /// Whether `/feedback/ses` is served (with `feedback.listen`); when it is,
    /// `topic_arns` must name the topics (start-up is refused otherwise).
    pub enabled: bool,
    /// The signing certificate (PEM); when set, `SigningCertURL` is never fetched.
    pub certificate_file: Option<PathBuf>,
    /// Hosts `SigningCertURL` (https only) and `SubscribeURL` may name; `*` stands
    /// for one AWS region name (`eu-west-1`, `us-gov-west-1`, `cn-north-1`), so the
    /// defaults are SNS's own hosts in every region, China's included.
    pub allowed_hosts: Vec<String>,
    /// The topic ARNs heard: a notification or subscription from any other topic is
    /// refused (403), never confirmed. Required while `enabled`.
    pub topic_arns: Vec<String>,
    /// How far a notification's signed `Timestamp` may be from now (either way): one
    /// captured and posted again later is refused.
    #[serde(deserialize_with = "duration")]
    pub max_age: Duration,
}

impl Default for SnsSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            certificate_file: None,
            allowed_hosts: vec![
                "sns.*.amazonaws.com".into(),
                "sns.*.amazonaws.com.cn".into(),
            ],
            topic_arns: Vec::new(),
            max_age: Duration::from_secs(3600),
        }
    }
}

/// SendGrid's Signed Event Webhook; unset: `/feedback/sendgrid` refuses everything.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SendgridSettings {
    /// The verification key as SendGrid shows it (base64 of the ECDSA P-256 public
    /// key's SubjectPublicKeyInfo).
    pub public_key: Option<SecretString>,
    /// The oldest signed timestamp accepted.
    #[serde(deserialize_with = "duration")]
    pub max_age: Duration,
}

/// Postmark's webhooks with basic auth; unset: `/feedback/postmark` refuses everything.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostmarkSettings {
    /// The user in the webhook URL.
    pub user: Option<String>,
    /// Its password.
    pub password: Option<SecretString>,
}

/// Mailgun's signed webhooks; unset: `/feedback/mailgun` refuses everything.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MailgunSettings {
    /// The HTTP webhook signing key.
    pub signing_key: Option<SecretString>,
    /// The oldest signed timestamp accepted; each token is remembered for twice this.
    #[serde(deserialize_with = "duration")]
    pub max_age: Duration,
    /// The most tokens remembered at once (`postie_webhook_tokens`, shared by every
    /// instance): past it a new request is refused with 503, which Mailgun retries,
    /// rather than a token forgotten early.
    pub max_tokens: i64,
}

/// Signed timestamps older than this are refused by default (a replay of a captured
/// request).
const MAX_AGE: Duration = Duration::from_secs(600);

impl Default for SendgridSettings {
    fn default() -> Self {
        Self {
            public_key: None,
            max_age: MAX_AGE,
        }
    }
}

impl Default for MailgunSettings {
    fn default() -> Self {
        Self {
            signing_key: None,
            max_age: MAX_AGE,
            max_tokens: 100_000,
        }
    }
}
