//! Amazon SES notifications through SNS, heard only from the operator's topics
//! (`feedback.sns.topic_arns`, required while the endpoint is served): SNS signs
//! every topic's notifications with the same certificate, so a valid signature says
//! only that SNS sent it, not for whom. Each message's topic and signed `Timestamp`
//! (within `feedback.sns.max_age` of now) and the canonical string are checked before
//! anything is fetched (`check`: what needs no certificate);
//! its signature (SignatureVersion 1: SHA1withRSA, 2: SHA256withRSA, over the
//! canonical string SNS documents) with the certificate from
//! `feedback.sns.certificate_file`, else the one at `SigningCertURL` (`fetch.rs`:
//! allowed hosts, SNS's subject, bounded and kept). A subscription is confirmed, for
//! those topics only, by fetching its `SubscribeURL`, on an allowed host; a notification's `Message` is
//! read as SES's bounce or complaint.

use base64::Engine;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::providers::evidence;
use super::verify::{pem_certificate, rsa_valid, RsaDigest};
use super::Refused;
use crate::config::SnsSettings;
use crate::inbox::{Feedback, FeedbackKind};

mod fetch;

/// What an SNS message was.
pub(super) enum Read {
    /// A notification: its bounces or complaints (none for other kinds).
    Notes(Vec<Feedback>),
    /// A subscription confirmed (its URL fetched).
    Subscribed,
}

/// SNS's settings, the configured certificate and the fetcher of the others.
pub(super) struct Sns {
    settings: SnsSettings,
    file_cert: Option<Vec<u8>>,
    fetcher: fetch::Fetcher,
}

/// An SNS message checked as far as it can be without its certificate.
pub(super) struct Checked {
    message: Value,
    digest: RsaDigest,
    signature: Vec<u8>,
    canonical: String,
}

impl Checked {
    /// A string member of the message.
    fn field(&self, name: &str) -> Option<&str> {
        self.message.get(name).and_then(Value::as_str)
    }

    /// Whether `cert` (DER) signed it.
    fn signed_by(&self, cert: &[u8]) -> bool {
        rsa_valid(
            cert,
            self.digest,
            self.canonical.as_bytes(),
            &self.signature,
        )
    }
}

/// Reads `body` as an SNS message and checks what needs no certificate: a signature
/// of a known version, a topic of `settings.topic_arns`, a `Timestamp` within
/// `settings.max_age` of `now`, the fields its type signs.
pub(super) fn check(
    body: &[u8],
    settings: &SnsSettings,
    now: DateTime<Utc>,
) -> Result<Checked, Refused> {
    let message: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::Malformed(format!("not an SNS message: {e}")))?;
    let field = |name: &str| message.get(name).and_then(Value::as_str);
    let kind = field("Type").ok_or_else(|| Refused::Malformed("no Type".into()))?;
    let (Some(sig), Some(version)) = (field("Signature"), field("SignatureVersion")) else {
        return Err(Refused::Unauthenticated("no signature"));
    };
    let digest = match version {
        "1" => RsaDigest::Sha1,
        "2" => RsaDigest::Sha256,
        _ => return Err(Refused::Forbidden("unknown SignatureVersion")),
    };
    let topics = &settings.topic_arns;
    if !field("TopicArn").is_some_and(|t| topics.iter().any(|a| a == t)) {
        return Err(Refused::Forbidden("topic not in feedback.sns.topic_arns"));
    }
    let at = field("Timestamp")
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .ok_or(Refused::Forbidden("no readable Timestamp"))?;
    let age = now
        .signed_duration_since(at)
        .abs()
        .to_std()
        .unwrap_or_default();
    if age > settings.max_age {
        return Err(Refused::Forbidden("Timestamp outside feedback.sns.max_age"));
    }
    let canonical = canonical(&message, kind).ok_or(Refused::Forbidden("bad signature"))?;
    let signature = base64::engine::general_purpose::STANDARD
        .decode(sig.trim())
        .map_err(|_| Refused::Forbidden("bad signature"))?;
    Ok(Checked {
        message,
        digest,
        signature,
        canonical,
    })
}

impl Sns {
    /// Reads `certificate_file` now (start-up fails on a bad one).
    pub(super) fn new(
        settings: &SnsSettings,
        timeout: std::time::Duration,
        max_bytes: usize,
    ) -> anyhow::Result<Self> {
        let file_cert = match &settings.certificate_file {
            None => None,
            Some(path) => {
                let pem = std::fs::read_to_string(path).map_err(|e| {
                    anyhow::anyhow!("feedback.sns.certificate_file {}: {e}", path.display())
                })?;
                Some(pem_certificate(&pem).ok_or_else(|| {
                    anyhow::anyhow!(
                        "feedback.sns.certificate_file {}: no PEM certificate in it",
                        path.display()
                    )
                })?)
            }
        };
        Ok(Self {
            settings: settings.clone(),
            file_cert,
            fetcher: fetch::Fetcher::new(&settings.allowed_hosts, timeout, max_bytes)?,
        })
    }

    /// Verifies and reads one SNS message.
    pub(super) async fn read(&self, body: &[u8]) -> Result<Read, Refused> {
        if !self.settings.enabled {
            return Err(Refused::Forbidden("feedback.sns.enabled is false"));
        }
        let m = check(body, &self.settings, Utc::now())?;
        let cert = match &self.file_cert {
            Some(cert) => cert.clone(),
            None => self.fetcher.certificate(m.field("SigningCertURL")).await?,
        };
        if !m.signed_by(&cert) {
            return Err(Refused::Forbidden("bad signature"));
        }
        match m.field("Type").unwrap_or("") {
            "SubscriptionConfirmation" => self.subscribe(&m).await,
            "Notification" => {
                let id = m
                    .field("MessageId")
                    .ok_or_else(|| Refused::Malformed("no MessageId".into()))?;
                let message: Value = serde_json::from_str(m.field("Message").unwrap_or(""))
                    .map_err(|e| Refused::Malformed(format!("Message is not SES's JSON: {e}")))?;
                Ok(Read::Notes(ses_notes(id, &message)))
            }
            _ => Ok(Read::Notes(Vec::new())),
        }
    }

    /// Confirms a subscription (of an allowed topic: `check` saw to it) by fetching
    /// its `SubscribeURL` on an allowed host.
    async fn subscribe(&self, m: &Checked) -> Result<Read, Refused> {
        let url = m
            .field("SubscribeURL")
            .ok_or_else(|| Refused::Malformed("no SubscribeURL".into()))?;
        let url = self
            .fetcher
            .allowed(url, false)
            .ok_or(Refused::Forbidden("SubscribeURL's host is not allowed"))?;
        let status = self.fetcher.get(&url).await.map_err(Refused::Upstream)?.0;
        if status != 200 {
            return Err(Refused::Upstream(format!("SubscribeURL answered {status}")));
        }
        tracing::info!(
            topic = m.field("TopicArn").unwrap_or(""),
            "SNS subscription confirmed"
        );
        Ok(Read::Subscribed)
    }
}

/// The string SNS signs: `Name\nvalue\n` for each signed field present, in order.
fn canonical(m: &Value, kind: &str) -> Option<String> {
    let fields: &[&str] = match kind {
        "Notification" => &[
            "Message",
            "MessageId",
            "Subject",
            "Timestamp",
            "TopicArn",
            "Type",
        ],
        "SubscriptionConfirmation" | "UnsubscribeConfirmation" => &[
            "Message",
            "MessageId",
            "SubscribeURL",
            "Timestamp",
            "Token",
            "TopicArn",
            "Type",
        ],
        _ => return None,
    };
    let mut out = String::new();
    for name in fields {
        match m.get(*name).and_then(Value::as_str) {
            Some(value) => out.push_str(&format!("{name}\n{value}\n")),
            None if *name == "Subject" => {}
            None => return None,
        }
    }
    Some(out)
}

/// SES's bounce or complaint: one [`Feedback`] per recipient.
fn ses_notes(notification_id: &str, m: &Value) -> Vec<Feedback> {
    let kind_of = m.get("notificationType").or_else(|| m.get("eventType"));
    let (kind, list, detail) = match kind_of.and_then(Value::as_str) {
        Some("Bounce") => {
            let b = &m["bounce"];
            let hard = b["bounceType"].as_str() == Some("Permanent");
            let detail = format!(
                "{} {}",
                b["bounceType"].as_str().unwrap_or(""),
                b["bounceSubType"].as_str().unwrap_or("")
            );
            (
                FeedbackKind::Bounce { hard },
                &b["bouncedRecipients"],
                detail,
            )
        }
        Some("Complaint") => {
            let c = &m["complaint"];
            let detail = c["complaintFeedbackType"]
                .as_str()
                .unwrap_or("")
                .to_string();
            (FeedbackKind::Complaint, &c["complainedRecipients"], detail)
        }
        _ => return Vec::new(),
    };
    let mail = &m["mail"];
    let message_id = mail
        .pointer("/commonHeaders/messageId")
        .and_then(Value::as_str)
        .or_else(|| {
            mail["headers"].as_array()?.iter().find_map(|h| {
                h["name"]
                    .as_str()?
                    .eq_ignore_ascii_case("message-id")
                    .then(|| h["value"].as_str())?
            })
        });
    let recipients = list.as_array().map(Vec::as_slice).unwrap_or_default();
    recipients
        .iter()
        .filter_map(|r| {
            let address = r["emailAddress"].as_str()?;
            let diagnostic = r["diagnosticCode"].as_str().unwrap_or("");
            Some(Feedback {
                source: "ses".into(),
                notification_id: notification_id.to_string(),
                kind,
                address: address.to_string(),
                message_id: message_id.map(str::to_string),
                provider_message_id: mail["messageId"].as_str().map(str::to_string),
                evidence: evidence(format!("ses {} {detail} {diagnostic}", kind.as_str())),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
