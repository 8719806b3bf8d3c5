//! Handing an [`EmailJob`] to a mail transport: the [`Transport`] seam, the
//! [`Mailer`] that builds the message and picks the transport from `smtp.url`, and
//! the one classification every transport's failures fall into ([`SendError`]).
//!
//! lettre lives here and nowhere else: the job model is postie's own
//! ([`crate::contract`]), so adding a transport touches this folder and the
//! `smtp.url` parsing in [`crate::config`], nothing more.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use lettre::Message;
use secrecy::ExposeSecret;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod file;
mod message;
mod smtp;

use crate::config::{smtp_endpoint, SmtpSettings};
use crate::contract::EmailJob;

/// Why a send failed, and whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The server answered 4xx (or the file transport failed): try again later.
    #[error("transient: {0}")]
    Transient(String),
    /// The server is throttling this sender (421/451/454 matching
    /// `smtp.throttle_patterns`): not this email's fault; slow down and try again soon.
    #[error("throttled: {0}")]
    Throttled(String),
    /// The relay could not be reached, dropped the connection or timed out.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// 5xx or a message the server can never take: dead-letter now.
    #[error("permanent: {0}")]
    Permanent(String),
}

impl SendError {
    /// What went wrong, without the class.
    pub fn detail(&self) -> &str {
        match self {
            Self::Transient(text)
            | Self::Throttled(text)
            | Self::Unreachable(text)
            | Self::Permanent(text) => text,
        }
    }
}

/// Somewhere an email can be handed to: an SMTP relay, a directory of `.eml` files.
pub trait Transport: Send + Sync {
    /// Hands one email over; every failure classed as a [`SendError`]. A transport
    /// bounds its own steps (never cancel a send from outside: see [`Mailer::send`]).
    fn send<'a>(&'a self, email: &'a Message) -> BoxFuture<'a, Result<(), SendError>>;
    /// Whether the far end answers now (the circuit breaker's prober asks this).
    fn probe(&self) -> BoxFuture<'_, bool>;
}

/// Sends emails; cheap to clone (the transport, and its connection pool, is shared).
#[derive(Clone)]
pub struct Mailer {
    transport: Arc<dyn Transport>,
    message_id_domain: String,
    /// `smtp.pool_size` turns: at most that many sends at once, so at most that many
    /// connections to the relay (lettre's pool caps only the idle ones, and opened and
    /// closed a connection for every send beyond them).
    slots: Arc<Semaphore>,
}

/// A turn on one of the transport's `smtp.pool_size` connections, which a send needs.
/// The worker takes it before the claim: waiting for a connection never eats into a
/// lease.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Mailer {
    /// Builds the transport named by `smtp.url` (no connection is made yet):
    /// `file:///dir` writes `.eml` files, anything else is an SMTP relay (see
    /// [`smtp_endpoint`] for its TLS rules).
    pub fn new(settings: &SmtpSettings) -> anyhow::Result<Self> {
        let raw = settings.url.expose_secret();
        let transport: Arc<dyn Transport> = match smtp_endpoint(raw)? {
            None => Arc::new(file::EmlFiles::new(raw.trim_start_matches("file://"))?),
            Some(endpoint) => Arc::new(smtp::SmtpRelay::new(endpoint, settings)?),
        };
        Ok(Self::with_transport(transport, settings))
    }

    /// A mailer over a transport of the caller's choosing.
    pub fn with_transport(transport: Arc<dyn Transport>, settings: &SmtpSettings) -> Self {
        Self {
            transport,
            message_id_domain: settings.message_id_domain.clone(),
            slots: Arc::new(Semaphore::new(settings.pool_size as usize)),
        }
    }

    /// Waits for a free connection turn (see [`Slot`]).
    pub async fn slot(&self) -> Slot {
        let permit = self.slots.clone().acquire_owned().await;
        Slot {
            _permit: permit.expect("the mailer never closes its semaphore"),
        }
    }

    /// The Message-ID the job's emails carry.
    pub fn message_id(&self, job: &EmailJob) -> String {
        job.key.message_id(&self.message_id_domain)
    }

    /// Builds the email; an error here is permanent (the job can never be sent).
    pub fn build(&self, job: &EmailJob) -> Result<Message, SendError> {
        message::build(job, self.message_id(job))
    }

    /// Sends one email. `smtp.timeout` bounds every SMTP command (lettre's own
    /// timeout), never the send as a whole from outside: cancelling a send would
    /// hand its connection back to lettre's pool mid-transaction, and the next email
    /// on that connection would read the previous one's late replies, so a reply meant
    /// for another command could be taken for "250 accepted" (found by the chaos
    /// harness as emails recorded sent that the server never took).
    ///
    /// `_slot` is the connection turn the send runs on ([`Mailer::slot`]).
    pub async fn send(&self, _slot: &Slot, message: &Message) -> Result<(), SendError> {
        self.transport.send(message).await
    }

    /// Asks the transport whether it answers (bounded by its own timeouts, for the
    /// same reason as [`Mailer::send`]).
    pub async fn probe(&self) -> bool {
        self.transport.probe().await
    }
}
