//! The SMTP relay transport: lettre's pooled client, TLS as `smtp.url` says, and the
//! classification of SMTP failures into transient, unreachable and permanent.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::{Tls, TlsParameters};
use lettre::transport::smtp::extension::ClientId;
use lettre::transport::smtp::PoolConfig;
use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use secrecy::ExposeSecret;

use super::{SendError, Transport};
use crate::config::{SmtpEndpoint, SmtpSecurity, SmtpSettings};
use crate::endpoint::is_loopback_host;

/// lettre's pooled SMTP client towards one relay.
pub(super) struct SmtpRelay(AsyncSmtpTransport<Tokio1Executor>, ThrottleReplies);

impl SmtpRelay {
    /// Builds the client (no connection yet). `smtp://` to a host other than this
    /// machine requires STARTTLS unless the URL says `tls=none` or
    /// `tls=opportunistic`; certificates are verified against the system's roots.
    pub(super) fn new(endpoint: SmtpEndpoint, settings: &SmtpSettings) -> anyhow::Result<Self> {
        let host = endpoint.host.as_str();
        let params = || {
            TlsParameters::new(host.to_string())
                .map_err(|e| anyhow::anyhow!("smtp.url: TLS towards {host} is not usable: {e}"))
        };
        let tls = match endpoint.security {
            SmtpSecurity::Plaintext => Tls::None,
            SmtpSecurity::StartTlsRequired => Tls::Required(params()?),
            SmtpSecurity::StartTlsOpportunistic => Tls::Opportunistic(params()?),
            SmtpSecurity::ImplicitTls => Tls::Wrapper(params()?),
        };
        let weak = match endpoint.security {
            SmtpSecurity::Plaintext => Some("without TLS (tls=none)"),
            SmtpSecurity::StartTlsOpportunistic => {
                Some("with STARTTLS only if offered (tls=opportunistic)")
            }
            _ => None,
        };
        if let Some(how) = weak.filter(|_| !is_loopback_host(host)) {
            tracing::warn!(
                "smtp.url sends to {host} {how}: emails{} can be read on the way; \
                 drop tls= to require STARTTLS",
                if endpoint.credentials.is_some() {
                    " and the password"
                } else {
                    ""
                }
            );
        }
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(host)
            .port(endpoint.port)
            .tls(tls)
            .timeout(Some(settings.timeout))
            .pool_config(PoolConfig::new().max_size(settings.pool_size));
        if let Some(name) = endpoint.hello_name {
            builder = builder.hello_name(ClientId::Domain(name));
        }
        if let Some((user, password)) = endpoint.credentials {
            builder =
                builder.credentials(Credentials::new(user, password.expose_secret().to_owned()));
        }
        Ok(Self(
            builder.build(),
            ThrottleReplies::new(&settings.throttle_patterns),
        ))
    }
}

impl Transport for SmtpRelay {
    fn send<'a>(&'a self, email: &'a Message) -> BoxFuture<'a, Result<(), SendError>> {
        async move {
            self.0
                .send(email.clone())
                .await
                .map(|_| ())
                .map_err(|e| classify(e, &self.1))
        }
        .boxed()
    }

    /// EHLO + NOOP, bounded by lettre's timeout.
    fn probe(&self) -> BoxFuture<'_, bool> {
        async { self.0.test_connection().await.unwrap_or(false) }.boxed()
    }
}

/// `smtp.throttle_patterns`, lower-cased: which transient replies are throttles.
pub(super) struct ThrottleReplies(Vec<String>);

impl ThrottleReplies {
    pub(super) fn new(patterns: &[String]) -> Self {
        Self(
            patterns
                .iter()
                .map(|p| p.to_lowercase())
                .filter(|p| !p.is_empty())
                .collect(),
        )
    }

    /// A 421, 451 or 454 reply whose text matches a pattern (case-insensitive).
    pub(super) fn matches(&self, code: &str, text: &str) -> bool {
        let text = text.to_lowercase();
        matches!(code, "421" | "451" | "454") && self.0.iter().any(|p| text.contains(p))
    }
}

fn classify(e: lettre::transport::smtp::Error, throttles: &ThrottleReplies) -> SendError {
    // The server's reply text goes into headers, logs and the inbox: one short line.
    let text = crate::contract::readable(&crate::error_chain(&e), 1_000);
    // lettre's client errors are either about this message (non-ASCII envelope or
    // body the server cannot take) or about the relay's set-up (no STARTTLS, no usable
    // AUTH). The first kind can never succeed; the second is the relay's fault, not
    // the job's, and must pause consumption rather than dead-letter every job.
    let about_the_message =
        e.is_client() && (text.contains("SMTPUTF8") || text.contains("8BITMIME"));
    if e.is_permanent() || about_the_message {
        SendError::Permanent(text)
    } else if e.is_transient() {
        let code = e.status().map(|c| c.to_string()).unwrap_or_default();
        if throttles.matches(&code, &text) {
            SendError::Throttled(text)
        } else {
            SendError::Transient(text)
        }
    } else {
        // No SMTP reply: refused, reset, TLS, timeout, or a broken reply.
        SendError::Unreachable(text)
    }
}

#[cfg(test)]
mod tests {
    use super::ThrottleReplies;

    #[test]
    fn throttles_are_421_451_454_with_a_matching_text() {
        let defaults = crate::config::SmtpSettings::default().throttle_patterns;
        let t = ThrottleReplies::new(&defaults);
        let ses = "4.7.0 Throttling failure: Maximum sending rate exceeded.";
        assert!(t.matches("454", ses));
        assert!(t.matches("421", "4.7.28 Too Many messages from your IP"));
        assert!(t.matches("451", "Try again later"));
        assert!(!t.matches("450", ses), "other 4xx keep their meaning");
        assert!(!t.matches("452", "Too many recipients"));
        assert!(!t.matches("451", "4.3.0 Local error in processing"));
        assert!(!ThrottleReplies::new(&[]).matches("454", ses));
    }
}
