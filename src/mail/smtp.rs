//! The SMTP relay transport: postie's own small pool of lettre connections, every step
//! of the conversation under `smtp.timeout`, TLS as `smtp.url` says, and the
//! classification of SMTP failures into transient, throttled, unreachable and permanent.
//!
//! lettre's pooled transport bounds only the TCP connect: a relay that accepts and then
//! never answers (a stuck provider endpoint, a middlebox that dropped the return path)
//! held every send, and so every connection slot, forever. Here each step is a
//! `tokio::time::timeout` of its own, and a connection goes back to the pool only after
//! a transaction that ended with the relay's 250: one whose step failed, timed out or
//! was cancelled is dropped (closed), never reused, so no late reply can be read as the
//! answer to the next email's command. That is also what makes a send safe to cancel
//! from outside ([`super::Mailer::send`]'s deadline, a hard stop).
//!
//! The steps, each bounded by `smtp.timeout` unless said otherwise:
//!
//! | step | when |
//! |---|---|
//! | NOOP | a pooled connection, before it is reused |
//! | connect, greeting and EHLO (TLS handshake too for `smtps://`) | a new connection: TCP connect within `smtp.timeout`, the rest within a second `smtp.timeout` |
//! | STARTTLS (handshake, EHLO again) | a new connection, as `smtp.url` says |
//! | AUTH | a new connection, when `smtp.url` has a password |
//! | MAIL FROM, each RCPT TO, DATA | every email |
//! | the body and the final reply | every email |
//! | QUIT | a connection closed after idling |

use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lettre::address::Envelope;
use lettre::transport::smtp::authentication::{Credentials, DEFAULT_MECHANISMS};
use lettre::transport::smtp::client::{AsyncSmtpConnection, TlsParameters};
use lettre::transport::smtp::commands::{Data, Mail, Rcpt};
use lettre::transport::smtp::extension::{
    ClientId, Extension, MailBodyParameter, MailParameter, ServerInfo,
};
use secrecy::ExposeSecret;

use super::{Clearance, Email, SendError, Transport};
use crate::config::{SmtpEndpoint, SmtpSecurity, SmtpSettings};
use crate::endpoint::is_loopback_host;

/// How long a connection may idle in the pool. Relays close idle sessions after a few
/// minutes (RFC 5321 §4.5.3.2.7 lets them after 5); one idle longer is closed with
/// QUIT rather than checked.
const IDLE_LIMIT: Duration = Duration::from_secs(60);

/// TLS as `smtp.url` asks for it.
enum TlsUse {
    /// Plaintext.
    None,
    /// STARTTLS after the greeting; `required`: no email without it.
    StartTls {
        params: TlsParameters,
        required: bool,
    },
    /// TLS from the first byte (`smtps://`).
    Implicit(TlsParameters),
}

/// A connection waiting in the pool, and since when.
struct Idle {
    connection: AsyncSmtpConnection,
    since: Instant,
}

/// The SMTP relay: where it is, how to talk to it, and the idle connections.
pub(super) struct SmtpRelay {
    host: String,
    port: u16,
    tls: TlsUse,
    hello: ClientId,
    credentials: Option<Credentials>,
    /// `smtp.timeout`: the bound of every step.
    step: Duration,
    /// Connections kept between sends: at most `smtp.pool_size` (the mailer lets no
    /// more sends run at once, so no more are ever open).
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    throttles: ThrottleReplies,
}

impl SmtpRelay {
    /// Builds the client (no connection yet). `smtp://` to a host other than this
    /// machine requires STARTTLS unless the URL says `tls=none` or
    /// `tls=opportunistic`; certificates are verified against the system's roots.
    pub(super) fn new(endpoint: SmtpEndpoint, settings: &SmtpSettings) -> anyhow::Result<Self> {
        let host = endpoint.host;
        let params = || {
            TlsParameters::new(host.clone())
                .map_err(|e| anyhow::anyhow!("smtp.url: TLS towards {host} is not usable: {e}"))
        };
        let tls = match endpoint.security {
            SmtpSecurity::Plaintext => TlsUse::None,
            SmtpSecurity::StartTlsRequired => TlsUse::StartTls {
                params: params()?,
                required: true,
            },
            SmtpSecurity::StartTlsOpportunistic => TlsUse::StartTls {
                params: params()?,
                required: false,
            },
            SmtpSecurity::ImplicitTls => TlsUse::Implicit(params()?),
        };
        let weak = match endpoint.security {
            SmtpSecurity::Plaintext => Some("without TLS (tls=none)"),
            SmtpSecurity::StartTlsOpportunistic => {
                Some("with STARTTLS only if offered (tls=opportunistic)")
            }
            _ => None,
        };
        if let Some(how) = weak.filter(|_| !is_loopback_host(&host)) {
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
        let hello = match endpoint.hello_name {
            Some(name) => ClientId::Domain(name),
            None => ClientId::default(),
        };
        let credentials = endpoint
            .credentials
            .map(|(user, password)| Credentials::new(user, password.expose_secret().to_owned()));
        Ok(Self {
            host,
            port: endpoint.port,
            tls,
            hello,
            credentials,
            step: settings.timeout,
            idle: Mutex::new(Vec::new()),
            max_idle: settings.pool_size as usize,
            throttles: ThrottleReplies::new(&settings.throttle_patterns),
        })
    }

    /// Runs one step under `limit`: a reply that is not positive is classified, no
    /// reply in time is the relay unreachable (a hung step).
    async fn bounded<T>(
        &self,
        what: &str,
        limit: Duration,
        step: impl std::future::Future<Output = Result<T, lettre::transport::smtp::Error>>,
    ) -> Result<T, SendError> {
        match tokio::time::timeout(limit, step).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(classify(error, &self.throttles)),
            Err(_) => Err(SendError::Unreachable(format!(
                "the relay did not answer {what} within {}",
                humantime::format_duration(limit)
            ))),
        }
    }

    /// A new connection, greeted, encrypted and authenticated as `smtp.url` says.
    async fn open(&self) -> Result<AsyncSmtpConnection, SendError> {
        let implicit = match &self.tls {
            TlsUse::Implicit(params) => Some(params.clone()),
            _ => None,
        };
        let connect = AsyncSmtpConnection::connect_tokio1(
            (self.host.as_str(), self.port),
            Some(self.step),
            &self.hello,
            implicit,
            None,
        );
        let mut connection = self
            .bounded("the connection and EHLO", self.step * 2, connect)
            .await?;
        if let TlsUse::StartTls { params, required } = &self.tls {
            if *required || connection.can_starttls() {
                let starttls = connection.starttls(params.clone(), &self.hello);
                self.bounded("STARTTLS", self.step, starttls).await?;
            }
        }
        if let Some(credentials) = &self.credentials {
            let auth = connection.auth(DEFAULT_MECHANISMS, credentials);
            self.bounded("AUTH", self.step, auth).await?;
        }
        Ok(connection)
    }

    /// A pooled connection that still answers NOOP, else a new one.
    async fn checkout(&self) -> Result<AsyncSmtpConnection, SendError> {
        while let Some(Idle {
            mut connection,
            since,
        }) = self.take_idle()
        {
            if since.elapsed() >= IDLE_LIMIT {
                self.close(connection);
                continue;
            }
            let noop = tokio::time::timeout(self.step, connection.test_connected());
            if noop.await == Ok(true) {
                return Ok(connection);
            }
            // Broken or silent: dropped, which closes the socket.
        }
        self.open().await
    }

    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// Puts a connection whose last transaction ended with a 250 back in the pool.
    fn checkin(&self, connection: AsyncSmtpConnection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push(Idle {
                connection,
                since: Instant::now(),
            });
        } else {
            drop(idle);
            self.close(connection);
        }
    }

    /// Says QUIT (bounded, off the send's path) and closes.
    fn close(&self, mut connection: AsyncSmtpConnection) {
        let step = self.step;
        tokio::spawn(async move {
            let _ = tokio::time::timeout(step, connection.quit()).await;
        });
    }

    /// MAIL, RCPT, DATA and the body on `connection`, each step bounded. `DATA` is
    /// never sent once `clearance` is withdrawn.
    async fn transaction(
        &self,
        connection: &mut AsyncSmtpConnection,
        email: &Email,
        clearance: &Clearance,
    ) -> Result<(), SendError> {
        let (envelope, body) = (email.envelope(), email.formatted());
        let options = mail_options(connection.server_info(), envelope, body)?;
        clearance.check()?;
        let mail = connection.command(Mail::new(envelope.from().cloned(), options));
        self.bounded("MAIL FROM", self.step, mail).await?;
        for to in envelope.to() {
            let rcpt = connection.command(Rcpt::new(to.clone(), vec![]));
            self.bounded("RCPT TO", self.step, rcpt).await?;
        }
        clearance.check()?;
        self.bounded("DATA", self.step, connection.command(Data))
            .await?;
        self.bounded("the end of data", self.step, connection.message(body))
            .await?;
        Ok(())
    }
}

/// MAIL FROM's parameters, as lettre's own `send` picks them: SMTPUTF8 for non-ASCII
/// addresses, 8BITMIME for a non-ASCII body; a relay without the extension can never
/// take the email (permanent).
fn mail_options(
    server: &ServerInfo,
    envelope: &Envelope,
    body: &[u8],
) -> Result<Vec<MailParameter>, SendError> {
    let mut options = Vec::new();
    let non_ascii_address = envelope
        .to()
        .iter()
        .chain(envelope.from())
        .any(|address| !AsRef::<str>::as_ref(address).is_ascii());
    if non_ascii_address {
        if !server.supports_feature(Extension::SmtpUtfEight) {
            return Err(SendError::Permanent(
                "the envelope has non-ASCII addresses and the relay does not support SMTPUTF8"
                    .into(),
            ));
        }
        options.push(MailParameter::SmtpUtfEight);
    }
    if !body.is_ascii() {
        if !server.supports_feature(Extension::EightBitMime) {
            return Err(SendError::Permanent(
                "the message is not ASCII and the relay does not support 8BITMIME".into(),
            ));
        }
        options.push(MailParameter::Body(MailBodyParameter::EightBitMime));
    }
    Ok(options)
}

impl Transport for SmtpRelay {
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<(), SendError>> {
        async move {
            let mut connection = self.checkout().await?;
            self.transaction(&mut connection, email, clearance).await?;
            self.checkin(connection);
            Ok(())
        }
        .boxed()
    }

    /// A new connection (connect, EHLO, TLS, AUTH) and a NOOP, each step bounded.
    fn probe(&self) -> BoxFuture<'_, bool> {
        async {
            let Ok(mut connection) = self.open().await else {
                return false;
            };
            let answered =
                tokio::time::timeout(self.step, connection.test_connected()).await == Ok(true);
            self.close(connection);
            answered
        }
        .boxed()
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
    // lettre's client errors here are about the relay's set-up (no STARTTLS, no usable
    // AUTH mechanism): the relay's fault, not the job's, so they must pause consumption
    // rather than dead-letter every job. (Emails a relay can never take, for want of
    // SMTPUTF8 or 8BITMIME, are found by `mail_options` before any command.)
    if e.is_permanent() {
        SendError::Permanent(text)
    } else if e.is_transient() {
        let code = e.status().map(|c| c.to_string()).unwrap_or_default();
        if throttles.matches(&code, &text) {
            SendError::Throttled(text)
        } else {
            SendError::Transient(text)
        }
    } else {
        // No SMTP reply: refused, reset, TLS, or a broken reply.
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
