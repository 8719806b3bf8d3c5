//! Turning an [`EmailJob`] into an RFC 5322 message and handing it to SMTP (lettre's
//! pooled transport) or to `.eml` files, with every failure classed as transient or
//! permanent.

use std::path::PathBuf;

use lettre::message::header::{HeaderName, HeaderValue};
use lettre::message::{MultiPart, SinglePart};
use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::{Tls, TlsParameters};
use lettre::transport::smtp::extension::ClientId;
use lettre::transport::smtp::PoolConfig;
use lettre::{AsyncFileTransport, AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use secrecy::ExposeSecret;

use crate::config::{is_loopback_host, smtp_endpoint, SmtpSecurity, SmtpSettings};
use crate::job::EmailJob;

/// Why a send failed, and whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The server answered 4xx (or the file transport failed): try again later.
    #[error("transient: {0}")]
    Transient(String),
    /// The relay could not be reached, dropped the connection or timed out.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// 5xx or a message the server can never take: dead-letter now.
    #[error("permanent: {0}")]
    Permanent(String),
}

enum Transport {
    Smtp(AsyncSmtpTransport<Tokio1Executor>),
    File(AsyncFileTransport<Tokio1Executor>),
}

/// Sends emails; cheap to clone (the SMTP pool is shared).
#[derive(Clone)]
pub struct Mailer {
    transport: std::sync::Arc<Transport>,
    message_id_domain: String,
}

impl Mailer {
    /// Builds the transport named by `smtp.url` (no connection is made yet).
    ///
    /// `smtp://` to a host other than this machine requires STARTTLS unless the URL
    /// says `tls=none` or `tls=opportunistic` (see [`smtp_endpoint`]); certificates
    /// are verified against the system's roots.
    pub fn new(settings: &SmtpSettings) -> anyhow::Result<Self> {
        let raw = settings.url.expose_secret();
        let transport = match smtp_endpoint(raw)? {
            None => {
                let dir = PathBuf::from(raw.trim_start_matches("file://"));
                std::fs::create_dir_all(&dir).map_err(|e| {
                    anyhow::anyhow!("smtp.url: cannot create directory {}: {e}", dir.display())
                })?;
                Transport::File(AsyncFileTransport::<Tokio1Executor>::new(dir))
            }
            Some(endpoint) => {
                let host = endpoint.host.as_str();
                let params = || {
                    TlsParameters::new(host.to_string()).map_err(|e| {
                        anyhow::anyhow!("smtp.url: TLS towards {host} is not usable: {e}")
                    })
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
                    builder = builder
                        .credentials(Credentials::new(user, password.expose_secret().to_owned()));
                }
                Transport::Smtp(builder.build())
            }
        };
        Ok(Self {
            transport: std::sync::Arc::new(transport),
            message_id_domain: settings.message_id_domain.clone(),
        })
    }

    /// The Message-ID the job's emails carry.
    pub fn message_id(&self, job: &EmailJob) -> String {
        job.key.message_id(&self.message_id_domain)
    }

    /// Builds the email; an error here is permanent (the job can never be sent).
    pub fn build(&self, job: &EmailJob) -> Result<Message, SendError> {
        let mut builder = Message::builder()
            .from(job.from.clone())
            .subject(job.subject.clone())
            .message_id(Some(self.message_id(job)))
            .date_now();
        for to in &job.to {
            builder = builder.to(to.clone());
        }
        for cc in &job.cc {
            builder = builder.cc(cc.clone());
        }
        for bcc in &job.bcc {
            builder = builder.bcc(bcc.clone());
        }
        if let Some(reply_to) = &job.reply_to {
            builder = builder.reply_to(reply_to.clone());
        }
        let built = match (&job.text, &job.html) {
            (Some(text), Some(html)) => builder.multipart(MultiPart::alternative_plain_html(
                text.clone(),
                html.clone(),
            )),
            (Some(text), None) => builder.singlepart(SinglePart::plain(text.clone())),
            (None, Some(html)) => builder.singlepart(SinglePart::html(html.clone())),
            (None, None) => return Err(SendError::Permanent("job has no body".into())),
        };
        let mut message =
            built.map_err(|e| SendError::Permanent(format!("cannot build email: {e}")))?;
        for (name, value) in &job.headers {
            let name = HeaderName::new_from_ascii(name.clone())
                .map_err(|e| SendError::Permanent(format!("header {name:?}: {e}")))?;
            message
                .headers_mut()
                .insert_raw(HeaderValue::new(name, value.clone()));
        }
        Ok(message)
    }

    /// Sends one email. `smtp.timeout` bounds every SMTP command (lettre's own
    /// timeout), never the send as a whole from outside: cancelling a send would
    /// hand its connection back to lettre's pool mid-transaction, and the next email
    /// on that connection would read the previous one's late replies, so a reply meant
    /// for another command could be taken for "250 accepted" (found by the chaos
    /// harness as emails recorded sent that the server never took).
    pub async fn send(&self, message: &Message) -> Result<(), SendError> {
        match &*self.transport {
            Transport::Smtp(smtp) => smtp
                .send(message.clone())
                .await
                .map(|_| ())
                .map_err(classify),
            Transport::File(file) => file
                .send(message.clone())
                .await
                .map(|_| ())
                .map_err(|e| SendError::Transient(format!("writing .eml file: {e}"))),
        }
    }

    /// Asks the relay whether it answers (EHLO + NOOP; bounded by lettre's timeout,
    /// for the same reason as [`Mailer::send`]).
    pub async fn probe(&self) -> bool {
        match &*self.transport {
            Transport::Smtp(smtp) => smtp.test_connection().await.unwrap_or(false),
            Transport::File(_) => true,
        }
    }
}

fn classify(e: lettre::transport::smtp::Error) -> SendError {
    // The server's reply text goes into headers, logs and the inbox: one short line.
    let text = crate::job::readable(&error_chain(&e), 1_000);
    // lettre's client errors are either about this message (non-ASCII envelope or
    // body the server cannot take) or about the relay's set-up (no STARTTLS, no usable
    // AUTH). The first kind can never succeed; the second is the relay's fault, not
    // the job's, and must pause consumption rather than dead-letter every job.
    let about_the_message =
        e.is_client() && (text.contains("SMTPUTF8") || text.contains("8BITMIME"));
    if e.is_permanent() || about_the_message {
        SendError::Permanent(text)
    } else if e.is_transient() {
        SendError::Transient(text)
    } else {
        // No SMTP reply: refused, reset, TLS, timeout, or a broken reply.
        SendError::Unreachable(text)
    }
}

/// The error and its causes on one line, each said once.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
