//! What SNS makes postie fetch: the signing certificate at `SigningCertURL` and a
//! subscription's `SubscribeURL`, each only from an allowed host (`*` in an entry of
//! `feedback.sns.allowed_hosts` is one AWS region name, as AWS's own validators match
//! `sns.<region>.amazonaws.com`); a certificate only over HTTPS, only if its subject
//! is SNS's (`sns.amazonaws.com`, `sns.amazonaws.com.cn` in China), at most
//! [`FETCHES`] at once, and kept (the last [`CERTIFICATES`] of them).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use tokio::sync::Semaphore;

use super::super::verify::{certificate_common_name, pem_certificate};
use super::super::Refused;
use crate::mail::{web_client, WebClient};

/// The most signing certificates kept (SNS rotates them rarely), each at most
/// `feedback.max_body_bytes`; the oldest goes first.
const CERTIFICATES: usize = 8;
/// The most certificate fetches at once, whatever arrives: a flood of notices naming
/// new certificate URLs waits its turn (within each request's timeout).
const FETCHES: usize = 2;

/// The allowed hosts, the HTTPS client and the certificates fetched.
pub(super) struct Fetcher {
    allowed_hosts: Vec<String>,
    client: WebClient,
    timeout: Duration,
    /// The largest certificate or subscription answer read (`feedback.max_body_bytes`).
    max_bytes: usize,
    /// (URL, DER), newest last.
    kept: Mutex<VecDeque<(String, Vec<u8>)>>,
    fetches: Semaphore,
}

impl Fetcher {
    pub(super) fn new(
        allowed_hosts: &[String],
        timeout: Duration,
        max_bytes: usize,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            allowed_hosts: allowed_hosts.to_vec(),
            client: web_client(timeout)?,
            timeout,
            max_bytes,
            kept: Mutex::new(VecDeque::with_capacity(CERTIFICATES)),
            fetches: Semaphore::new(FETCHES),
        })
    }

    /// The certificate at `url` (https, allowed host, SNS's subject): kept, or fetched.
    pub(super) async fn certificate(&self, url: Option<&str>) -> Result<Vec<u8>, Refused> {
        let url = url
            .and_then(|u| self.allowed(u, true))
            .ok_or(Refused::Forbidden(
                "SigningCertURL is not https on an allowed host",
            ))?;
        if let Some(cert) = self.kept(url.as_str()) {
            return Ok(cert);
        }
        let _turn = self
            .fetches
            .acquire()
            .await
            .map_err(|_| Refused::Upstream("certificate fetches stopped".into()))?;
        // Another request may have fetched it while this one waited.
        if let Some(cert) = self.kept(url.as_str()) {
            return Ok(cert);
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
        let host = url.host_str().unwrap_or("");
        if !is_sns_subject(&cert, host) {
            return Err(Refused::Forbidden(
                "the certificate at SigningCertURL is not SNS's (its subject)",
            ));
        }
        let mut kept = self.kept.lock().expect("not poisoned");
        if kept.len() >= CERTIFICATES {
            kept.pop_front();
        }
        kept.push_back((url.to_string(), cert.clone()));
        Ok(cert)
    }

    fn kept(&self, url: &str) -> Option<Vec<u8>> {
        let kept = self.kept.lock().expect("not poisoned");
        kept.iter().find(|(u, _)| u == url).map(|(_, c)| c.clone())
    }

    /// `url` parsed if `feedback.sns.allowed_hosts` allows it: an entry `http://host:port`
    /// allows that plain-HTTP origin (tests, a proxy), any other entry a host over
    /// HTTPS (`*` one AWS region name). A certificate's URL must be HTTPS.
    pub(super) fn allowed(&self, url: &str, https_only: bool) -> Option<url::Url> {
        let url = url::Url::parse(url).ok()?;
        let host = url.host_str()?.to_ascii_lowercase();
        let ok = self
            .allowed_hosts
            .iter()
            .any(|entry| match entry.strip_prefix("http://") {
                Some(origin) => {
                    !https_only
                        && url.scheme() == "http"
                        && format!("{host}:{}", url.port_or_known_default().unwrap_or(80)) == origin
                }
                None => {
                    url.scheme() == "https" && url.port().is_none() && host_matches(entry, &host)
                }
            });
        ok.then_some(url)
    }

    /// GET `url` within the request timeout; its status and (bounded) body.
    pub(super) async fn get(&self, url: &url::Url) -> Result<(u16, Bytes), String> {
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

/// Whether `cert` (DER) names SNS as its subject: `sns.amazonaws.com`, or
/// `sns.amazonaws.com.cn` when fetched from China's partition.
fn is_sns_subject(cert: &[u8], host: &str) -> bool {
    let expected = if host.ends_with(".amazonaws.com.cn") {
        "sns.amazonaws.com.cn"
    } else {
        "sns.amazonaws.com"
    };
    certificate_common_name(cert).is_some_and(|cn| cn.eq_ignore_ascii_case(expected))
}

/// Whether `host` matches `pattern`, label by label, `*` standing for one AWS region
/// name ([`is_region`]).
pub(super) fn host_matches(pattern: &str, host: &str) -> bool {
    let (p, h): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), host.split('.').collect());
    p.len() == h.len()
        && p.iter()
            .zip(&h)
            .all(|(p, h)| *p == "*" && is_region(h) || p.eq_ignore_ascii_case(h))
}

/// An AWS region name: a two-letter area, one or more lowercase words, a number
/// (`eu-west-1`, `us-gov-west-1`, `ap-southeast-2`, `cn-north-1`,
/// `us-isob-east-1`). Not `s3`, `s3-website`, `evil`.
pub(super) fn is_region(label: &str) -> bool {
    let parts: Vec<&str> = label.split('-').collect();
    let word = |w: &&str| w.len() >= 2 && w.bytes().all(|b| b.is_ascii_lowercase());
    label.len() <= 32
        && parts.len() >= 3
        && parts[0].len() == 2
        && parts[0].bytes().all(|b| b.is_ascii_lowercase())
        && parts[1..parts.len() - 1].iter().all(word)
        && parts
            .last()
            .is_some_and(|n| (1..=2).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate whose subject is `CN=sns.amazonaws.com` (made with openssl for
    /// these tests: a P-256 key, self-signed), and one whose subject is another name.
    const SNS_PEM: &str = include_str!("testdata/sns-subject.pem");
    const OTHER_PEM: &str = include_str!("testdata/other-subject.pem");

    #[test]
    fn hosts_match_a_region_per_star_only() {
        let sns = "sns.*.amazonaws.com";
        for good in [
            "sns.eu-west-1.amazonaws.com",
            "sns.us-gov-west-1.amazonaws.com",
            "sns.ap-southeast-2.amazonaws.com",
            "sns.us-isob-east-1.amazonaws.com",
        ] {
            assert!(host_matches(sns, good), "{good}");
        }
        for bad in [
            "sns.s3.amazonaws.com",
            "sns.s3-website.amazonaws.com",
            "sns.evil.amazonaws.com",
            "sns.evil.com.amazonaws.com",
            "sns.eu-west-1.amazonaws.com.evil.example",
            "sns..amazonaws.com",
            "evil.com",
        ] {
            assert!(!host_matches(sns, bad), "{bad} admitted");
        }
        assert!(host_matches(
            "sns.*.amazonaws.com.cn",
            "sns.cn-north-1.amazonaws.com.cn"
        ));
        assert!(!is_region("eu-west-100") && !is_region("EU-west-1") && !is_region("eu-1"));
    }

    #[test]
    fn a_certificate_is_snss_by_its_subject() {
        let sns = pem_certificate(SNS_PEM).unwrap();
        let other = pem_certificate(OTHER_PEM).unwrap();
        assert!(is_sns_subject(&sns, "sns.eu-west-1.amazonaws.com"));
        assert!(!is_sns_subject(&sns, "sns.cn-north-1.amazonaws.com.cn"));
        assert!(!is_sns_subject(&other, "sns.eu-west-1.amazonaws.com"));
        assert!(!is_sns_subject(
            b"not a certificate",
            "sns.eu-west-1.amazonaws.com"
        ));
    }

    #[tokio::test]
    async fn urls_are_fetched_only_from_allowed_hosts_and_certificates_only_over_https() {
        let hosts = crate::config::SnsSettings::default().allowed_hosts;
        let defaults = Fetcher::new(&hosts, Duration::from_secs(1), 1024).unwrap();
        let ok = |f: &Fetcher, url: &str, https_only| f.allowed(url, https_only).is_some();
        let pem = "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-1.pem";
        assert!(ok(&defaults, pem, true));
        assert!(ok(
            &defaults,
            "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-1.pem",
            true
        ));
        assert!(!ok(&defaults, "https://sns.s3.amazonaws.com/x.pem", true));
        assert!(!ok(
            &defaults,
            "http://sns.eu-west-1.amazonaws.com/x.pem",
            true
        ));
        assert!(!ok(
            &defaults,
            "https://sns.eu-west-1.amazonaws.com:8443/x.pem",
            true
        ));
        assert!(!ok(
            &defaults,
            "https://evil.example/?sns.eu-west-1.amazonaws.com",
            false
        ));
        let local = Fetcher::new(
            &["http://127.0.0.1:8080".into()],
            Duration::from_secs(1),
            1024,
        )
        .unwrap();
        assert!(ok(&local, "http://127.0.0.1:8080/confirm?Token=t", false));
        assert!(
            !ok(&local, "http://127.0.0.1:8080/cert.pem", true),
            "a certificate only over https"
        );
        assert!(!ok(&local, "http://127.0.0.1:8081/confirm", false));
        // Not allowed: refused before any fetch.
        let refused = defaults
            .certificate(Some("https://sns.s3.amazonaws.com/x.pem"))
            .await;
        assert!(matches!(refused, Err(Refused::Forbidden(_))));
        assert!(matches!(
            defaults.certificate(None).await,
            Err(Refused::Forbidden(_))
        ));
    }
}
