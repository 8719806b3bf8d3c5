//! `transport.url` taken apart: host, port, credentials, and the TLS decision.

use secrecy::SecretString;

use super::ConfigError;
use crate::endpoint::{is_loopback_host, percent_decode, redact_url};

/// How postie talks to the SMTP relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpSecurity {
    /// No TLS: `tls=none`, or `smtp://` to this machine without `tls=`.
    Plaintext,
    /// STARTTLS, and no email or credentials unless it succeeds (the default for
    /// `smtp://` to any other host).
    StartTlsRequired,
    /// STARTTLS if the server offers it (`tls=opportunistic`): a man in the middle can
    /// strip it.
    StartTlsOpportunistic,
    /// TLS from the first byte (`smtps://`).
    ImplicitTls,
}

/// `transport.url` taken apart. Credentials stay secret; `Debug` shows none.
#[derive(Debug, Clone)]
pub struct SmtpEndpoint {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port: as given, else 465 for `smtps://`, 587 for an explicit `tls=required` or
    /// `tls=opportunistic`, and 25 otherwise.
    pub port: u16,
    /// TLS.
    pub security: SmtpSecurity,
    /// The EHLO name, from the URL's path (`smtp://host/ehlo.name`).
    pub hello_name: Option<String>,
    /// User name and password, percent-decoded, when the URL has a password.
    pub credentials: Option<(String, SecretString)>,
}

/// Takes `transport.url` apart and decides on TLS: `None` for `file://`.
///
/// `smtp://` without `tls=` means STARTTLS required, except to this machine (see
/// [`is_loopback_host`]), where local relays such as Mailpit speak plaintext. Plaintext
/// to another host needs an explicit `tls=none`. `smtps://` is implicit TLS.
pub(crate) fn smtp_endpoint(raw: &str) -> Result<Option<SmtpEndpoint>, ConfigError> {
    if raw.starts_with("file://") {
        return Ok(None);
    }
    let fail = |why: &str| ConfigError(format!("transport.url {} {why}", redact_url(raw)));
    let url = url::Url::parse(raw).map_err(|e| fail(&format!("is not a URL: {e}")))?;
    let host = match url.host() {
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        Some(host) => host.to_string(),
        None => return Err(fail("names no host")),
    };
    if host.is_empty() {
        return Err(fail("names no host"));
    }
    let tls = url
        .query_pairs()
        .filter(|(k, _)| k == "tls")
        .last()
        .map(|(_, v)| v.to_ascii_lowercase());
    let (security, default_port) = match (url.scheme(), tls.as_deref()) {
        ("smtp", None) if is_loopback_host(&host) => (SmtpSecurity::Plaintext, 25),
        ("smtp", None) => (SmtpSecurity::StartTlsRequired, 25),
        ("smtp", Some("none")) => (SmtpSecurity::Plaintext, 25),
        ("smtp", Some("required")) => (SmtpSecurity::StartTlsRequired, 587),
        ("smtp", Some("opportunistic")) => (SmtpSecurity::StartTlsOpportunistic, 587),
        ("smtps", None | Some("required")) => (SmtpSecurity::ImplicitTls, 465),
        ("smtp" | "smtps", Some(other)) => {
            return Err(fail(&format!(
                "has tls={other}: use tls=required, tls=opportunistic or tls=none with \
                 smtp://, and no tls= with smtps://"
            )))
        }
        _ => return Err(fail("must start with smtp://, smtps:// or file://")),
    };
    let credentials = url.password().map(|password| {
        (
            percent_decode(url.username()),
            SecretString::from(percent_decode(password)),
        )
    });
    let path = url.path().trim_matches('/');
    Ok(Some(SmtpEndpoint {
        host,
        port: url.port().unwrap_or(default_port),
        security,
        hello_name: (!path.is_empty()).then(|| path.to_string()),
        credentials,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    /// `transport.url` → (TLS, port), or the error's words.
    fn smtp_decision(url: &str) -> Result<(SmtpSecurity, u16), String> {
        smtp_endpoint(url)
            .map(|e| e.map(|e| (e.security, e.port)).expect("not file://"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn smtp_requires_starttls_off_the_machine_unless_told_otherwise() {
        use SmtpSecurity::*;
        for (url, expected) in [
            ("smtp://127.0.0.1:1025", Ok((Plaintext, 1025))),
            ("smtp://127.5.5.5", Ok((Plaintext, 25))),
            ("smtp://[::1]:1025", Ok((Plaintext, 1025))),
            ("smtp://localhost:1025", Ok((Plaintext, 1025))),
            ("smtp://mail.example.com", Ok((StartTlsRequired, 25))),
            ("smtp://10.0.0.5:2525", Ok((StartTlsRequired, 2525))),
            ("smtp://u:p@relay.internal:587", Ok((StartTlsRequired, 587))),
            (
                "smtp://mail.example.com?tls=required",
                Ok((StartTlsRequired, 587)),
            ),
            (
                "smtp://127.0.0.1:1025?tls=required",
                Ok((StartTlsRequired, 1025)),
            ),
            (
                "smtp://mail.example.com?tls=opportunistic",
                Ok((StartTlsOpportunistic, 587)),
            ),
            ("smtp://mail.example.com:25?tls=none", Ok((Plaintext, 25))),
            ("smtp://mail.example.com?tls=NONE", Ok((Plaintext, 25))),
            ("smtps://mail.example.com", Ok((ImplicitTls, 465))),
            ("smtps://u:p@mail.example.com:2465", Ok((ImplicitTls, 2465))),
            ("smtps://mail.example.com?tls=none", Err("tls=none")),
            ("smtp://mail.example.com?tls=yes", Err("tls=yes")),
            ("http://mail.example.com", Err("must start with smtp://")),
            (
                "smtp://u:secret@mail.example.com?tls=maybe",
                Err("smtp://u:***@mail.example.com"),
            ),
        ] {
            match (smtp_decision(url), expected) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{url}"),
                (Err(err), Err(words)) => {
                    assert!(err.contains(words), "{url}: {err}");
                    assert!(!err.contains("secret"), "{url}: {err}");
                }
                (got, _) => panic!("{url}: {got:?}, expected {expected:?}"),
            }
        }
        assert!(smtp_endpoint("file:///tmp/mail").unwrap().is_none());
    }

    #[test]
    fn smtp_credentials_and_ehlo_name_come_from_the_url() {
        let endpoint =
            smtp_endpoint("smtp://us%40er:p%2Bw%3Ad+x@[2001:db8::1]:2525/client.example")
                .unwrap()
                .unwrap();
        assert_eq!(endpoint.host, "2001:db8::1");
        assert_eq!(endpoint.security, SmtpSecurity::StartTlsRequired);
        assert_eq!(endpoint.hello_name.as_deref(), Some("client.example"));
        let (user, password) = endpoint.credentials.clone().unwrap();
        assert_eq!(user, "us@er");
        assert_eq!(password.expose_secret(), "p+w:d+x");
        assert!(!format!("{endpoint:?}").contains("p+w"), "{endpoint:?}");
    }
}
