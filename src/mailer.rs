//! Turning an [`EmailJob`] into an RFC 5322 message and handing it to SMTP (lettre's
//! pooled transport) or to `.eml` files, with every failure classed as transient or
//! permanent.

use std::path::PathBuf;
use std::time::Duration;

use lettre::message::header::{HeaderName, HeaderValue};
use lettre::message::{MultiPart, SinglePart};
use lettre::transport::smtp::PoolConfig;
use lettre::{AsyncFileTransport, AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use secrecy::ExposeSecret;

use crate::config::{redact_url, SmtpSettings};
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
    timeout: Duration,
    message_id_domain: String,
}

impl Mailer {
    /// Builds the transport named by `smtp.url` (no connection is made yet).
    pub fn new(settings: &SmtpSettings) -> anyhow::Result<Self> {
        let raw = settings.url.expose_secret();
        let transport = if let Some(dir) = raw.strip_prefix("file://") {
            let dir = PathBuf::from(dir);
            std::fs::create_dir_all(&dir).map_err(|e| {
                anyhow::anyhow!("smtp.url: cannot create directory {}: {e}", dir.display())
            })?;
            Transport::File(AsyncFileTransport::<Tokio1Executor>::new(dir))
        } else {
            let builder = AsyncSmtpTransport::<Tokio1Executor>::from_url(raw)
                .map_err(|e| anyhow::anyhow!("smtp.url {} is not usable: {e}", redact_url(raw)))?;
            Transport::Smtp(
                builder
                    .timeout(Some(settings.timeout))
                    .pool_config(PoolConfig::new().max_size(settings.pool_size))
                    .build(),
            )
        };
        Ok(Self {
            transport: std::sync::Arc::new(transport),
            timeout: settings.timeout,
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

    /// Sends one email within the configured timeout.
    pub async fn send(&self, message: &Message) -> Result<(), SendError> {
        let sending = async {
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
        };
        match tokio::time::timeout(self.timeout, sending).await {
            Ok(result) => result,
            Err(_) => Err(SendError::Unreachable(format!(
                "SMTP send timed out after {}",
                humantime::format_duration(self.timeout)
            ))),
        }
    }

    /// Asks the relay whether it answers (EHLO + NOOP on a fresh connection).
    pub async fn probe(&self) -> bool {
        match &*self.transport {
            Transport::Smtp(smtp) => {
                tokio::time::timeout(self.timeout, smtp.test_connection())
                    .await
                    .is_ok_and(|r| r.unwrap_or(false))
            }
            Transport::File(_) => true,
        }
    }
}

fn classify(e: lettre::transport::smtp::Error) -> SendError {
    let text = error_chain(&e);
    if e.is_permanent() {
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
