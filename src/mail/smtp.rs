//! The SMTP relay transport: postie's own small pool of lettre connections, every step
//! of the conversation under `transport.timeout`, TLS as `transport.url` says, and the
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
//! The steps, each bounded by `transport.timeout` unless said otherwise:
//!
//! | step | when |
//! |---|---|
//! | NOOP | a pooled connection idle for [`RECENT`] or longer, before it is reused |
//! | connect, greeting and EHLO (TLS handshake too for `smtps://`) | a new connection: TCP connect within `transport.timeout`, the rest within a second `transport.timeout` |
//! | STARTTLS (handshake, EHLO again) | a new connection, as `transport.url` says |
//! | EHLO once more, to read PIPELINING (lettre keeps only the extensions it knows) | a new connection |
//! | AUTH | a new connection, when `transport.url` has a password |
//! | MAIL FROM, each RCPT TO, DATA (one write to a relay with PIPELINING) | every email |
//! | the body and the final reply | every email |
//! | or instead: MAIL FROM, RCPT TO, `BDAT <size> LAST` and the body in one write, and the three replies | an email for one recipient, to a relay with PIPELINING and CHUNKING |
//! | QUIT | a connection closed after idling |
//!
//! A connection back in the pool for less than [`RECENT`] is reused without a NOOP
//! (a round trip an email saved): if its MAIL FROM then meets a closed connection or a
//! 421, nothing was handed over, and the email goes once more on a new connection.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lettre::transport::smtp::authentication::{Credentials, DEFAULT_MECHANISMS};
use lettre::transport::smtp::client::{AsyncSmtpConnection, TlsParameters};
use lettre::transport::smtp::commands::Ehlo;
use lettre::transport::smtp::extension::ClientId;
use secrecy::ExposeSecret;

use super::{Clearance, Email, SendError, Transport};
use crate::config::{SmtpEndpoint, SmtpSecurity, SmtpSettings, TransportSettings};
use crate::endpoint::is_loopback_host;

/// How long a connection may idle in the pool. Relays close idle sessions after a few
/// minutes (RFC 5321 §4.5.3.2.7 lets them after 5); one idle longer is closed with
/// QUIT rather than checked.
const IDLE_LIMIT: Duration = Duration::from_secs(60);

/// A connection idle for less than this is reused without a NOOP first.
const RECENT: Duration = Duration::from_secs(2);

mod transaction;

use transaction::{Failed, Session};

/// TLS as `transport.url` asks for it.
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
    session: Session,
    since: Instant,
}

/// The SMTP relay: where it is, how to talk to it, and the idle connections.
pub(super) struct SmtpRelay {
    host: String,
    port: u16,
    tls: TlsUse,
    hello: ClientId,
    credentials: Option<Credentials>,
    /// `transport.timeout`: the bound of every step.
    step: Duration,
    /// Connections kept between sends: at most `transport.pool_size` (the mailer lets no
    /// more sends run at once, so no more are ever open).
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    throttles: ThrottleReplies,
    /// `smtp.chunking`: BDAT where the relay takes it.
    chunking: bool,
}

impl SmtpRelay {
    /// Builds the client (no connection yet). `smtp://` to a host other than this
    /// machine requires STARTTLS unless the URL says `tls=none` or
    /// `tls=opportunistic`; certificates are verified against the system's roots.
    pub(super) fn new(
        endpoint: SmtpEndpoint,
        shared: &TransportSettings,
        settings: &SmtpSettings,
    ) -> anyhow::Result<Self> {
        let host = endpoint.host;
        let params = || {
            TlsParameters::new(host.clone()).map_err(|e| {
                anyhow::anyhow!("transport.url: TLS towards {host} is not usable: {e}")
            })
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
                "transport.url sends to {host} {how}: emails{} can be read on the way; \
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
            step: shared.timeout,
            idle: Mutex::new(Vec::new()),
            max_idle: shared.pool_size as usize,
            throttles: ThrottleReplies::new(&settings.throttle_patterns),
            chunking: settings.chunking,
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
            Err(_) => Err(no_answer(what, limit)),
        }
    }

    /// A new connection, greeted, encrypted and authenticated as `transport.url` says.
    async fn open(&self) -> Result<Session, SendError> {
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
        // Before AUTH: an EHLO resets the session, and some relays forget AUTH with it.
        let ehlo = connection.command(Ehlo::new(self.hello.clone()));
        let ehlo = self.bounded("EHLO", self.step, ehlo).await?;
        if let Some(credentials) = &self.credentials {
            let auth = connection.auth(DEFAULT_MECHANISMS, credentials);
            self.bounded("AUTH", self.step, auth).await?;
        }
        Ok(Session::new(connection, &ehlo, self.chunking))
    }

    /// A pooled connection (checked with a NOOP unless it was in use within
    /// [`RECENT`]), else a new one; and whether it went unchecked.
    async fn checkout(&self) -> Result<(Session, bool), SendError> {
        while let Some(Idle { mut session, since }) = self.take_idle() {
            let idle = since.elapsed();
            if idle >= IDLE_LIMIT {
                self.close(session);
                continue;
            }
            if idle < RECENT {
                return Ok((session, true));
            }
            let noop = tokio::time::timeout(self.step, session.connection.test_connected());
            if noop.await == Ok(true) {
                return Ok((session, false));
            }
            // Broken or silent: dropped, which closes the socket.
        }
        Ok((self.open().await?, false))
    }

    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// Puts a connection whose last transaction ended with a 250 back in the pool.
    fn checkin(&self, session: Session) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push(Idle {
                session,
                since: Instant::now(),
            });
        } else {
            drop(idle);
            self.close(session);
        }
    }

    /// Says QUIT (bounded, off the send's path) and closes.
    fn close(&self, mut session: Session) {
        let step = self.step;
        tokio::spawn(async move {
            let _ = tokio::time::timeout(step, session.connection.quit()).await;
        });
    }
}

impl Transport for SmtpRelay {
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<Option<String>, SendError>> {
        async move {
            let (mut session, unchecked) = self.checkout().await?;
            let mut sent = self.transaction(&mut session, email, clearance).await;
            if unchecked && matches!(sent, Err(Failed::AtFirstReply(_))) {
                // The pooled connection had gone stale without a NOOP to tell: MAIL
                // FROM met a closed connection or a 421, so nothing was handed over.
                session = self.open().await?;
                sent = self.transaction(&mut session, email, clearance).await;
            }
            sent.map_err(Failed::into_error)?;
            self.checkin(session);
            Ok(None)
        }
        .boxed()
    }

    /// A new connection (connect, EHLO, TLS, AUTH) and a NOOP, each step bounded.
    fn probe(&self) -> BoxFuture<'_, bool> {
        async {
            let Ok(mut session) = self.open().await else {
                return false;
            };
            let noop = session.connection.test_connected();
            let answered = tokio::time::timeout(self.step, noop).await == Ok(true);
            self.close(session);
            answered
        }
        .boxed()
    }
}

/// The relay's silence through one step.
fn no_answer(what: &str, limit: Duration) -> SendError {
    SendError::Unreachable(format!(
        "the relay did not answer {what} within {}",
        humantime::format_duration(limit)
    ))
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
