//! Handing an [`EmailJob`] to a mail transport: the [`Transport`] seam, the
//! [`Mailer`] that builds the message and sends it through one of its routes
//! (`transport.providers`, or the one transport of `transport.url`;
//! failover between them in [`route`]), and the one classification every
//! transport's failures fall into ([`SendError`]).
//!
//! lettre lives here and nowhere else: the job model is postie's own
//! ([`crate::contract`]), so adding a transport touches this folder and the URL
//! parsing in [`crate::config`], nothing more.
//!
//! The `Transport` trait borrows an `Email` (the envelope and the RFC 5322 text,
//! formatted once in `Mailer::build_for`) and answers the provider's id. The
//! [`Mailer`] holds its routes, its `transport.pool_size` connection slots and the send
//! deadline; a send carries a `Clearance`: no body once the claim is lost, and marked
//! uncertain by a transport that failed after handing the email over without an
//! answer.
//!
//! - `route.rs`: failover between the routes. `message.rs`: job → RFC 5322.
//! - `smtp.rs`: the SMTP relay, `smtp/transaction.rs` one email's transaction.
//! - `api/`: providers' HTTP APIs (`ses.rs`, `sendgrid.rs`, `postmark.rs`,
//!   `mailgun.rs`; `request.rs`), each with its reply reading and unit tests.
//! - `email.rs`: the built [`Email`]. `bounce.rs`: which refusal is a hard bounce.
//!   `file.rs`: `.eml` files.
//! - `unsubscribe.rs`: one-click unsubscribe's headers and the signed token in
//!   their link, made at send time and read by the feedback listener's `/u/`.
//! - `fetch/`: a job's `url` and `s3` attachments fetched into the spool, checked
//!   (the fetcher's attacker table; `address.rs` which addresses are public, `s3.rs`
//!   the S3 store); `stream.rs`: an email with attachments as chunks, the skeleton
//!   lettre formatted spliced with each file's base64 lines; `api/payload.rs` the
//!   providers' streamed request bodies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod api;
pub(crate) mod bounce;
mod email;
mod fetch;
mod file;
mod message;
mod route;
mod smtp;
mod stream;
pub(crate) mod unsubscribe;

pub(crate) use api::{web_client, WebClient};
pub use email::Email;
pub(crate) use route::RouteId;
pub(crate) use route::{Change, Routes};
pub(crate) use stream::Content;

use crate::config::{ProviderPlan, Settings, SmtpTransport};
use crate::contract::EmailJob;
use crate::ops::metrics::Metrics;

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
    /// Something the email needs besides the transport (an attachment's store, or
    /// this instance's spool) failed: not the job's fault, nothing was handed over;
    /// retried with backoff, never counted as an attempt, never a dead letter.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl SendError {
    /// What went wrong, without the class.
    pub(crate) fn detail(&self) -> &str {
        match self {
            Self::Transient(text)
            | Self::Throttled(text)
            | Self::Unreachable(text)
            | Self::Permanent(text)
            | Self::Withdrawn(text)
            | Self::Unavailable(text) => text,
        }
    }
}

/// Whether a send may still hand its email over, and whether a failed one may have.
/// The worker withdraws it when it finds its claim gone; a transport checks it before
/// the envelope and again before the body (and before `DATA` when it sends commands
/// one at a time), and never starts the body once it is withdrawn. A transport that
/// fails after the email left it without a definite answer (no reply after the
/// request was written or the body sent) marks it [`uncertain`](Clearance::uncertain):
/// the email may have been accepted, so the job is tried again on the same route
/// only. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct Clearance(Arc<Flags>);

#[derive(Debug, Default)]
struct Flags {
    withdrawn: AtomicBool,
    uncertain: AtomicBool,
    /// The recipient the relay refused at RCPT TO, with its reply.
    refused: std::sync::Mutex<Option<(String, String)>>,
}

impl Clearance {
    /// A clearance in force.
    pub fn new() -> Self {
        Self::default()
    }

    /// Withdraws it: a send that has not started the body stops.
    pub(crate) fn withdraw(&self) {
        self.0.withdrawn.store(true, Ordering::Relaxed);
    }

    /// `Err(Withdrawn)` once withdrawn.
    pub(crate) fn check(&self) -> Result<(), SendError> {
        if self.0.withdrawn.load(Ordering::Relaxed) {
            return Err(SendError::Withdrawn(
                "the claim was lost before the body; the email was not handed over".into(),
            ));
        }
        Ok(())
    }

    /// Marks a failure after the email was handed over without a definite answer.
    pub(crate) fn mark_uncertain(&self) {
        self.0.uncertain.store(true, Ordering::Relaxed);
    }

    /// The send failed after the email was handed over, with no answer saying it was
    /// refused: it may have been accepted.
    pub(crate) fn uncertain(&self) -> bool {
        self.0.uncertain.load(Ordering::Relaxed)
    }

    /// Notes that the relay refused `recipient` at RCPT TO with `reply`.
    pub(crate) fn refuse(&self, recipient: String, reply: String) {
        *self.0.refused.lock().unwrap_or_else(|e| e.into_inner()) = Some((recipient, reply));
    }

    /// The recipient the relay refused at RCPT TO, with its reply (for the
    /// suppression list's hard bounces).
    pub(crate) fn refused(&self) -> Option<(String, String)> {
        self.0
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Somewhere an email can be handed to: an SMTP relay, a provider's API, a directory
/// of `.eml` files.
pub(crate) trait Transport: Send + Sync {
    /// Hands one email over; every failure classed as a [`SendError`]. The provider's
    /// id for the accepted email when its API answers one. A transport bounds each of
    /// its own steps, and must be safe to cancel at any await (a connection
    /// interrupted mid-transaction is never reused): [`Mailer::send`] puts the whole
    /// send under its deadline. It checks `clearance` before it starts handing the
    /// body over, and marks it uncertain when it fails after the email left it
    /// without a definite answer.
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<Option<String>, SendError>>;
    /// Whether the far end answers now (the circuit breaker's prober asks this),
    /// each step bounded.
    fn probe(&self) -> BoxFuture<'_, bool>;
    /// Whether [`Email`]s for this transport must carry the job's fields besides the
    /// formatted message (an API that takes JSON fields, not MIME).
    fn wants_fields(&self) -> bool {
        false
    }
    /// Whether `error` counts towards this transport's circuit breaker (see
    /// [`route`]): by default, no connection, or no answer in time (an SMTP relay that
    /// hangs is taken for one that is down, as a failed send through it costs the
    /// job nothing).
    fn opens_breaker(&self, error: &SendError, _uncertain: bool) -> bool {
        matches!(error, SendError::Unreachable(_))
    }
}

/// What a send through a route answered.
#[derive(Debug)]
pub struct Sent {
    /// The route that accepted the email.
    pub route: RouteId,
    /// The id the provider's API answered with (none from SMTP or files).
    pub provider_message_id: Option<String>,
}

/// Sends emails through the routes of `transport.providers` (or the one transport);
/// cheap to clone (the transports, their connection pools and breakers are shared).
#[derive(Clone)]
pub struct Mailer {
    routes: Arc<Routes>,
    message_id_domain: String,
    /// `transport.pool_size` turns: at most that many sends at once, so at most that many
    /// connections to any one relay.
    slots: Arc<Semaphore>,
    /// The most one send may take ([`TransportSettings::send_deadline`](crate::config::TransportSettings::send_deadline)).
    deadline: Duration,
    /// One-click unsubscribe links, when `unsubscribe.url` is set.
    links: Option<Arc<unsubscribe::Links>>,
    /// Fetches `url` and `s3` attachments into the spool (and knows, from
    /// `attachments.min_rate`, the time a file's transfer may take).
    fetcher: Arc<fetch::Fetcher>,
}

/// A turn on one of the transport's `transport.pool_size` connections, which a send needs.
/// The worker takes it before the claim: waiting for a connection never eats into a
/// lease.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Mailer {
    /// The one transport `transport` names, as validation parsed it (no connection is
    /// made yet): `file:///dir` writes `.eml` files, a provider's scheme its API,
    /// anything else is an SMTP relay (see
    /// [`smtp_endpoint`](crate::config::smtp_endpoint) for its TLS rules).
    pub fn new(transport: &SmtpTransport, settings: &Settings) -> anyhow::Result<Self> {
        let plan = ProviderPlan {
            name: transport.kind().to_string(),
            transport: transport.clone(),
            rate_limit: settings.transport.rate_limit,
            rate_burst: settings.transport.rate_burst,
        };
        Self::with_routes(&[plan], settings, &Metrics::new())
    }

    /// The routes of `plans`, in order, each transport built; their metrics counted
    /// in `metrics`.
    pub(crate) fn with_routes(
        plans: &[ProviderPlan],
        settings: &Settings,
        metrics: &Metrics,
    ) -> anyhow::Result<Self> {
        let shared = &settings.transport;
        let mut routes = Vec::with_capacity(plans.len());
        for plan in plans {
            let transport: Arc<dyn Transport> = match &plan.transport {
                SmtpTransport::Files(dir) => Arc::new(file::EmlFiles::new(dir)?),
                SmtpTransport::Relay(endpoint) => Arc::new(smtp::SmtpRelay::new(
                    endpoint.clone(),
                    shared,
                    &settings.smtp,
                )?),
                SmtpTransport::Api(endpoint) => Arc::new(api::ApiTransport::new(endpoint, shared)?),
            };
            routes.push(route::RouteSpec {
                name: plan.name.clone(),
                transport,
                rate_limit: plan.rate_limit,
                rate_burst: plan.rate_burst,
            });
        }
        anyhow::ensure!(!routes.is_empty(), "no transport is configured");
        Ok(Self {
            routes: Arc::new(Routes::new(routes, shared.breaker_threshold, metrics)),
            message_id_domain: shared.message_id_domain.clone(),
            slots: Arc::new(Semaphore::new(shared.pool_size as usize)),
            deadline: shared.send_deadline(),
            links: unsubscribe::Links::new(&settings.unsubscribe, &shared.message_id_domain)
                .map(Arc::new),
            fetcher: Arc::new(fetch::Fetcher::new(&settings.attachments)?),
        })
    }

    /// One-click unsubscribe's links, if configured (`unsubscribe.url`).
    pub(crate) fn unsubscribe_links(&self) -> Option<&unsubscribe::Links> {
        self.links.as_deref()
    }

    /// The routes and their breakers.
    pub(crate) fn routes(&self) -> &Routes {
        &self.routes
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

    /// Builds and formats the email for the first route ([`Mailer::build_for`]),
    /// its attachments fetched first.
    pub async fn build(&self, job: &EmailJob) -> Result<Email, SendError> {
        let contents = self.fetch(job).await?;
        self.build_for(job, RouteId(0), &contents)
    }

    /// The job's attachments' bytes, in order: inline ones as they are, `url` and `s3`
    /// ones fetched into the spool and checked against their size and SHA-256 (`fetch/`:
    /// a failure that is the job's fault is permanent, the store's unavailable).
    pub(crate) async fn fetch(&self, job: &EmailJob) -> Result<Vec<Content>, SendError> {
        if job.attachments.is_empty() {
            return Ok(Vec::new());
        }
        self.fetcher.fetch(job).await
    }

    /// Builds and formats the email for `route`, with `contents` as its attachments'
    /// bytes ([`Mailer::fetch`]); an error here is permanent (the job can never be
    /// sent).
    pub(crate) fn build_for(
        &self,
        job: &EmailJob,
        route: RouteId,
        contents: &[Content],
    ) -> Result<Email, SendError> {
        let message_id = self.message_id(job);
        let fields = self
            .routes
            .get(route)
            .with_fields
            .then(|| Box::new(message::Fields::of(job, &message_id)));
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let message = message::build(job, message_id, &nonce)?;
        let mut email = if contents.is_empty() {
            Email::new(&message)
        } else {
            Email::spliced(&message, &nonce, contents)?
        };
        email.transfer = self.fetcher.transfer_time(email.attachments_size());
        email.fields = fields;
        Ok(email)
    }

    /// The most one send may take: [`TransportSettings::send_deadline`](crate::config::TransportSettings::send_deadline). A claim must have
    /// at least this much lease left when its send starts.
    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The most the send of `email` may take: [`Mailer::deadline`], and for an email
    /// with attachments the time their encoded bytes take at `attachments.min_rate`
    /// (20 MiB, 26.7 MiB encoded, at the default 256 KiB/s: 107 s more).
    pub(crate) fn deadline_for(&self, email: &Email) -> Duration {
        self.deadline() + email.transfer_time()
    }

    /// Sends one email through the first route ([`Mailer::send_through`]).
    pub async fn send(
        &self,
        slot: &Slot,
        email: &Email,
        clearance: &Clearance,
    ) -> Result<Sent, SendError> {
        self.send_through(slot, RouteId(0), email, clearance).await
    }

    /// Sends one email through `route`. `transport.timeout` bounds every step (the
    /// transport's own timeouts) and [`Mailer::deadline`] the send as a whole: past it
    /// the send is dropped, which is safe because a transport never reuses a
    /// connection whose transaction did not end (so no late reply is ever read as the
    /// answer to the next email's command); a send dropped at its deadline is
    /// uncertain (the deadline's expiry marks it so: where it stopped is not known).
    /// Once `clearance` is withdrawn, the body is not started.
    ///
    /// `_slot` is the connection turn the send runs on ([`Mailer::slot`]). The result
    /// is not yet counted: the caller hands it to [`Routes::judge`].
    pub(crate) async fn send_through(
        &self,
        _slot: &Slot,
        route: RouteId,
        email: &Email,
        clearance: &Clearance,
    ) -> Result<Sent, SendError> {
        let send = self.routes.get(route).transport.send(email, clearance);
        let deadline = self.deadline_for(email);
        let id = tokio::time::timeout(deadline, send)
            .await
            .unwrap_or_else(|_| {
                // Where it stopped is not known: the body may have gone.
                clearance.mark_uncertain();
                Err(SendError::Unreachable(format!(
                    "the send took longer than its deadline ({})",
                    humantime::format_duration(deadline)
                )))
            })?;
        Ok(Sent {
            route,
            provider_message_id: id,
        })
    }

    /// Asks route `route`'s transport whether it answers, within the send deadline.
    pub(crate) async fn probe(&self, route: RouteId) -> bool {
        let probe = self.routes.get(route).transport.probe();
        tokio::time::timeout(self.deadline, probe)
            .await
            .unwrap_or(false)
    }
}
