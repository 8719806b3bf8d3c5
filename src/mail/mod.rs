//! Handing an [`EmailJob`] to a mail transport: the [`Transport`] seam, the
//! [`Mailer`] that builds the message and picks the transport from `smtp.url`, and
//! the one classification every transport's failures fall into ([`SendError`]).
//!
//! lettre lives here and nowhere else: the job model is postie's own
//! ([`crate::contract`]), so adding a transport touches this folder and the
//! `smtp.url` parsing in [`crate::config`], nothing more.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lettre::address::Envelope;
use lettre::Message;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod api;
mod file;
mod message;
mod smtp;

use crate::config::{SmtpSettings, SmtpTransport};
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
    /// The send stopped before the body because its [`Clearance`] was withdrawn (the
    /// claim was lost): the email was not handed over.
    #[error("withdrawn: {0}")]
    Withdrawn(String),
}

impl SendError {
    /// What went wrong, without the class.
    pub(crate) fn detail(&self) -> &str {
        match self {
            Self::Transient(text)
            | Self::Throttled(text)
            | Self::Unreachable(text)
            | Self::Permanent(text)
            | Self::Withdrawn(text) => text,
        }
    }
}

/// Whether a send may still hand its email over. The worker withdraws it when it finds
/// its claim gone; a transport checks it before the envelope and again before the
/// body (and before `DATA` when it sends commands one at a time), and never starts the
/// body once it is withdrawn. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct Clearance(Arc<AtomicBool>);

impl Clearance {
    /// A clearance in force.
    pub fn new() -> Self {
        Self::default()
    }

    /// Withdraws it: a send that has not started the body stops.
    pub(crate) fn withdraw(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// `Err(Withdrawn)` once withdrawn.
    pub(crate) fn check(&self) -> Result<(), SendError> {
        if self.0.load(Ordering::Relaxed) {
            return Err(SendError::Withdrawn(
                "the claim was lost before the body; the email was not handed over".into(),
            ));
        }
        Ok(())
    }
}

/// An email ready to be handed over: its envelope and its RFC 5322 text, formatted
/// once when it is built. Transports borrow it: nothing of the message is copied on
/// the way to the relay or the file.
#[derive(Debug, Clone)]
pub struct Email {
    envelope: Envelope,
    formatted: Vec<u8>,
    /// The job's fields, for a transport that asks for them
    /// ([`Transport::wants_fields`]: SendGrid, Postmark).
    fields: Option<Box<message::Fields>>,
}

impl Email {
    /// `message`, formatted.
    pub fn new(message: &Message) -> Self {
        Self {
            envelope: message.envelope().clone(),
            formatted: message.formatted(),
            fields: None,
        }
    }

    /// The job's fields, when the mailer's transport asked for them.
    pub(crate) fn fields(&self) -> Option<&message::Fields> {
        self.fields.as_deref()
    }

    /// MAIL FROM and RCPT TO.
    pub(crate) fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// The message as sent after `DATA`.
    pub fn formatted(&self) -> &[u8] {
        &self.formatted
    }
}

/// Somewhere an email can be handed to: an SMTP relay, a directory of `.eml` files.
pub(crate) trait Transport: Send + Sync {
    /// Hands one email over; every failure classed as a [`SendError`]. A transport
    /// bounds each of its own steps, and must be safe to cancel at any await (a
    /// connection interrupted mid-transaction is never reused): [`Mailer::send`]
    /// puts the whole send under its deadline. It checks `clearance` before it
    /// starts handing the body over.
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<(), SendError>>;
    /// Whether the far end answers now (the circuit breaker's prober asks this),
    /// each step bounded.
    fn probe(&self) -> BoxFuture<'_, bool>;
    /// Whether [`Email`]s for this transport must carry the job's fields besides the
    /// formatted message (an API that takes JSON fields, not MIME).
    fn wants_fields(&self) -> bool {
        false
    }
}

/// Sends emails; cheap to clone (the transport, and its connection pool, is shared).
#[derive(Clone)]
pub struct Mailer {
    transport: Arc<dyn Transport>,
    message_id_domain: String,
    /// The transport's [`Transport::wants_fields`].
    with_fields: bool,
    /// `smtp.pool_size` turns: at most that many sends at once, so at most that many
    /// connections to the relay.
    slots: Arc<Semaphore>,
    /// The most one send may take ([`SmtpSettings::send_deadline`]).
    deadline: Duration,
}

/// A turn on one of the transport's `smtp.pool_size` connections, which a send needs.
/// The worker takes it before the claim: waiting for a connection never eats into a
/// lease.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Mailer {
    /// Builds the transport `smtp.url` names, as validation parsed it
    /// ([`SmtpSettings::transport`]; no connection is made yet): `file:///dir` writes
    /// `.eml` files, anything else is an SMTP relay (see
    /// [`smtp_endpoint`](crate::config::smtp_endpoint) for its TLS rules).
    pub fn new(transport: &SmtpTransport, settings: &SmtpSettings) -> anyhow::Result<Self> {
        let transport: Arc<dyn Transport> = match transport {
            SmtpTransport::Files(dir) => Arc::new(file::EmlFiles::new(dir)?),
            SmtpTransport::Relay(endpoint) => {
                Arc::new(smtp::SmtpRelay::new(endpoint.clone(), settings)?)
            }
            SmtpTransport::Api(endpoint) => Arc::new(api::ApiTransport::new(endpoint, settings)?),
        };
        Ok(Self::with_transport(transport, settings))
    }

    /// A mailer over a transport of the caller's choosing.
    pub(crate) fn with_transport(transport: Arc<dyn Transport>, settings: &SmtpSettings) -> Self {
        Self {
            with_fields: transport.wants_fields(),
            transport,
            message_id_domain: settings.message_id_domain.clone(),
            slots: Arc::new(Semaphore::new(settings.pool_size as usize)),
            deadline: settings.send_deadline(),
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
    pub(crate) fn message_id(&self, job: &EmailJob) -> String {
        job.key.message_id(&self.message_id_domain)
    }

    /// Builds and formats the email; an error here is permanent (the job can never
    /// be sent).
    pub fn build(&self, job: &EmailJob) -> Result<Email, SendError> {
        let message_id = self.message_id(job);
        let fields = self
            .with_fields
            .then(|| Box::new(message::Fields::of(job, &message_id)));
        message::build(job, message_id).map(|message| Email {
            fields,
            ..Email::new(&message)
        })
    }

    /// The most one send may take: [`SmtpSettings::send_deadline`]. A claim must have
    /// at least this much lease left when its send starts.
    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Sends one email. `smtp.timeout` bounds every SMTP step (the transport's own
    /// timeouts) and [`Mailer::deadline`] the send as a whole: past it the send is
    /// dropped, which is safe because a transport never reuses a connection whose
    /// transaction did not end (so no late reply is ever read as the answer to the
    /// next email's command). Once `clearance` is withdrawn, `DATA` is not started.
    ///
    /// `_slot` is the connection turn the send runs on ([`Mailer::slot`]).
    pub async fn send(
        &self,
        _slot: &Slot,
        email: &Email,
        clearance: &Clearance,
    ) -> Result<(), SendError> {
        let send = self.transport.send(email, clearance);
        tokio::time::timeout(self.deadline, send)
            .await
            .unwrap_or_else(|_| {
                Err(SendError::Unreachable(format!(
                    "the send took longer than its deadline ({})",
                    humantime::format_duration(self.deadline)
                )))
            })
    }

    /// Asks the transport whether it answers, within the send deadline.
    pub(crate) async fn probe(&self) -> bool {
        tokio::time::timeout(self.deadline, self.transport.probe())
            .await
            .unwrap_or(false)
    }
}
