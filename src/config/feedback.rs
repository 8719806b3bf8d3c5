//! `feedback.*`: the providers' bounce and complaint webhooks (issue 30).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::de::{duration, optional_addr};

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
            sns: SnsSettings::default(),
            sendgrid: SendgridSettings::default(),
            postmark: PostmarkSettings::default(),
            mailgun: MailgunSettings::default(),
        }
    }
}

/// SNS: every message's signature is verified (SignatureVersion 1 and 2).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnsSettings {
    /// The signing certificate (PEM); when set, `SigningCertURL` is never fetched.
    pub certificate_file: Option<PathBuf>,
    /// Hosts `SigningCertURL` (https only) and `SubscribeURL` may name; `*` stands
    /// for one DNS label (`sns.*.amazonaws.com`, SNS's own hosts in every region).
    pub allowed_hosts: Vec<String>,
    /// Topic ARNs accepted; empty: any topic.
    pub topic_arns: Vec<String>,
}

impl Default for SnsSettings {
    fn default() -> Self {
        Self {
            certificate_file: None,
            allowed_hosts: vec!["sns.*.amazonaws.com".into()],
            topic_arns: Vec::new(),
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
    /// The oldest signed timestamp accepted.
    #[serde(deserialize_with = "duration")]
    pub max_age: Duration,
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
        }
    }
}
