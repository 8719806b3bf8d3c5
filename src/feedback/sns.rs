//! Amazon SES notifications through SNS: every message's signature verified
//! (SignatureVersion 1: SHA1withRSA, 2: SHA256withRSA, over the canonical string SNS
//! documents) with the certificate from `feedback.sns.certificate_file`, else fetched
//! from `SigningCertURL` over HTTPS from an allow-listed host (kept, a few at most);
//! a subscription confirmed by fetching its `SubscribeURL`, only on an allow-listed
//! host; a notification's `Message` read as SES's bounce or complaint.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;

use super::providers::evidence;
use super::verify::{pem_certificate, rsa_valid, RsaDigest};
use super::Refused;
use crate::config::SnsSettings;
use crate::inbox::{Feedback, FeedbackKind};
use crate::mail::{web_client, WebClient};

/// The most signing certificates kept (SNS rotates them rarely), each at most
/// `feedback.max_body_bytes`.
const CERTIFICATES: usize = 8;

/// What an SNS message was.
pub(super) enum Read {
    /// A notification: its bounces or complaints (none for other kinds).
    Notes(Vec<Feedback>),
    /// A subscription confirmed (its URL fetched).
    Subscribed,
}

/// SNS's settings, the configured certificate and the fetched ones.
pub(super) struct Sns {
    settings: SnsSettings,
    file_cert: Option<Vec<u8>>,
    fetched: Mutex<HashMap<String, Vec<u8>>>,
    client: WebClient,
    timeout: Duration,
    /// The largest certificate or subscription answer read (`feedback.max_body_bytes`).
    max_bytes: usize,
}

impl Sns {
    /// Reads `certificate_file` now (start-up fails on a bad one).
    pub(super) fn new(
        settings: &SnsSettings,
        timeout: Duration,
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
            fetched: Mutex::new(HashMap::new()),
            client: web_client(timeout)?,
            timeout,
            max_bytes,
        })
    }

    /// Verifies and reads one SNS message.
    pub(super) async fn read(&self, body: &[u8]) -> Result<Read, Refused> {
        let m: Value = serde_json::from_slice(body)
            .map_err(|e| Refused::Malformed(format!("not an SNS message: {e}")))?;
        let field = |name: &str| m.get(name).and_then(Value::as_str);
        let kind = field("Type").ok_or_else(|| Refused::Malformed("no Type".into()))?;
        let (Some(sig), Some(version)) = (field("Signature"), field("SignatureVersion")) else {
            return Err(Refused::Unauthenticated("no signature"));
        };
        let digest = match version {
            "1" => RsaDigest::Sha1,
            "2" => RsaDigest::Sha256,
            _ => return Err(Refused::Forbidden("unknown SignatureVersion")),
        };
        let topics = &self.settings.topic_arns;
        if !topics.is_empty() && !field("TopicArn").is_some_and(|t| topics.iter().any(|a| a == t)) {
            return Err(Refused::Forbidden("topic not in feedback.sns.topic_arns"));
        }
        let canonical = canonical(&m, kind).ok_or(Refused::Forbidden("bad signature"))?;
        let sig = base64::engine::general_purpose::STANDARD
            .decode(sig.trim())
            .map_err(|_| Refused::Forbidden("bad signature"))?;
        let cert = self.certificate(field("SigningCertURL")).await?;
        if !rsa_valid(&cert, digest, canonical.as_bytes(), &sig) {
            return Err(Refused::Forbidden("bad signature"));
        }
        match kind {
            "SubscriptionConfirmation" => {
                let url = field("SubscribeURL")
                    .ok_or_else(|| Refused::Malformed("no SubscribeURL".into()))?;
                let url = self
                    .allowed(url, false)
                    .ok_or(Refused::Forbidden("SubscribeURL's host is not allowed"))?;
                let status = self.get(&url).await.map_err(Refused::Upstream)?.0;
                if status != 200 {
                    return Err(Refused::Upstream(format!("SubscribeURL answered {status}")));
                }
                tracing::info!(
                    topic = field("TopicArn").unwrap_or(""),
                    "SNS subscription confirmed"
                );
                Ok(Read::Subscribed)
            }
            "Notification" => {
                let id =
                    field("MessageId").ok_or_else(|| Refused::Malformed("no MessageId".into()))?;
                let message: Value = serde_json::from_str(field("Message").unwrap_or(""))
                    .map_err(|e| Refused::Malformed(format!("Message is not SES's JSON: {e}")))?;
                Ok(Read::Notes(ses_notes(id, &message)))
            }
            _ => Ok(Read::Notes(Vec::new())),
        }
    }

    /// The configured certificate, else the one at `url` (https, allow-listed).
    async fn certificate(&self, url: Option<&str>) -> Result<Vec<u8>, Refused> {
        if let Some(cert) = &self.file_cert {
            return Ok(cert.clone());
        }
        let url = url
            .and_then(|u| self.allowed(u, true))
            .ok_or(Refused::Forbidden(
                "SigningCertURL is not https on an allowed host",
            ))?;
        if let Some(cert) = self.fetched.lock().expect("not poisoned").get(url.as_str()) {
            return Ok(cert.clone());
        }
        let (status, body) = self.get(&url).await.map_err(Refused::Upstream)?;
        let cert = (status == 200)
            .then(|| std::str::from_utf8(&body).ok().and_then(pem_certificate))
            .flatten()
            .ok_or_else(|| {
                Refused::Upstream(format!(
                    "SigningCertURL answered {status} without a certificate"
                ))
            })?;
        let mut fetched = self.fetched.lock().expect("not poisoned");
        if fetched.len() >= CERTIFICATES {
            fetched.clear();
        }
        fetched.insert(url.to_string(), cert.clone());
        Ok(cert)
    }

    /// `url` parsed if `feedback.sns.allowed_hosts` allows it: an entry `http://host:port`
    /// allows that plain-HTTP origin (tests, a proxy), any other entry a host over
    /// HTTPS (`*` one DNS label). A certificate's URL must be HTTPS.
    fn allowed(&self, url: &str, https_only: bool) -> Option<url::Url> {
        let url = url::Url::parse(url).ok()?;
        let host = url.host_str()?.to_ascii_lowercase();
        let ok =
            self.settings
                .allowed_hosts
                .iter()
                .any(|entry| match entry.strip_prefix("http://") {
                    Some(origin) => {
                        !https_only
                            && url.scheme() == "http"
                            && format!("{host}:{}", url.port_or_known_default().unwrap_or(80))
                                == origin
                    }
                    None => {
                        url.scheme() == "https"
                            && url.port().is_none()
                            && host_matches(entry, &host)
                    }
                });
        ok.then_some(url)
    }

    /// GET `url` within the request timeout; its status and (bounded) body.
    async fn get(&self, url: &url::Url) -> Result<(u16, Bytes), String> {
        let request = http::Request::get(url.as_str())
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let fetch = async {
            let reply = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = reply.status().as_u16();
            let body = Limited::new(reply.into_body(), self.max_bytes)
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            Ok((status, body.to_bytes()))
        };
        tokio::time::timeout(self.timeout, fetch)
            .await
            .map_err(|_| {
                format!(
                    "no answer from {} within {:?}",
                    url.host_str().unwrap_or(""),
                    self.timeout
                )
            })?
    }
}

/// Whether `host` matches `pattern`, `*` standing for one DNS label.
fn host_matches(pattern: &str, host: &str) -> bool {
    let (p, h): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), host.split('.').collect());
    p.len() == h.len()
        && p.iter()
            .zip(&h)
            .all(|(p, h)| *p == "*" && !h.is_empty() || p.eq_ignore_ascii_case(h))
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
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls_are_fetched_only_from_allowed_hosts_and_certificates_only_over_https() {
        let settings = SnsSettings {
            allowed_hosts: vec!["sns.*.amazonaws.com".into(), "http://127.0.0.1:8080".into()],
            ..SnsSettings::default()
        };
        let sns = Sns::new(&settings, Duration::from_secs(1), 1024).unwrap();
        let ok = |url: &str, https_only| sns.allowed(url, https_only).is_some();
        assert!(ok(
            "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-1.pem",
            true
        ));
        assert!(!ok("http://sns.eu-west-1.amazonaws.com/x.pem", true));
        assert!(!ok("https://sns.eu-west-1.amazonaws.com:8443/x.pem", true));
        assert!(!ok(
            "https://sns.eu-west-1.amazonaws.com.evil.example/x.pem",
            true
        ));
        assert!(!ok(
            "https://evil.example/?sns.eu-west-1.amazonaws.com",
            false
        ));
        assert!(ok("http://127.0.0.1:8080/confirm?Token=t", false));
        assert!(
            !ok("http://127.0.0.1:8080/cert.pem", true),
            "a certificate only over https"
        );
        assert!(!ok("http://127.0.0.1:8081/confirm", false));
        // No file and no allowed URL: refused before any fetch.
        let refused = sns.certificate(Some("https://evil.example/x.pem")).await;
        assert!(matches!(refused, Err(Refused::Forbidden(_))));
        assert!(matches!(
            sns.certificate(None).await,
            Err(Refused::Forbidden(_))
        ));
    }

    #[test]
    fn hosts_match_one_label_per_star_and_the_canonical_string_skips_no_subject() {
        assert!(host_matches(
            "sns.*.amazonaws.com",
            "sns.eu-west-1.amazonaws.com"
        ));
        assert!(!host_matches(
            "sns.*.amazonaws.com",
            "sns.evil.com.amazonaws.com"
        ));
        assert!(!host_matches("sns.*.amazonaws.com", "evil.com"));
        let m = serde_json::json!({"Message": "m", "MessageId": "i", "Timestamp": "t",
            "TopicArn": "a", "Type": "Notification"});
        assert_eq!(
            canonical(&m, "Notification").unwrap(),
            "Message\nm\nMessageId\ni\nTimestamp\nt\nTopicArn\na\nType\nNotification\n"
        );
        let ses = serde_json::json!({"notificationType": "Bounce",
            "bounce": {"bounceType": "Transient", "bouncedRecipients": [{"emailAddress": "a@x"}]},
            "mail": {"messageId": "ses-1", "headers": [{"name": "Message-ID", "value": "<m@x>"}]}});
        let notes = ses_notes("n1", &ses);
        assert_eq!(notes.len(), 1);
        assert_eq!(notes[0].kind, FeedbackKind::Bounce { hard: false });
        assert_eq!(notes[0].message_id.as_deref(), Some("<m@x>"));
        assert_eq!(notes[0].provider_message_id.as_deref(), Some("ses-1"));
    }
}
