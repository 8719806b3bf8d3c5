//! The send itself, the circuit breaker's prober, and the record of a send.
//!
//! A send's result is counted on its route's breaker. A route whose breaker opens
//! gets a prober of its own, which also writes the breaker's state for the console
//! (`Inbox::record_breaker`); when no route is left closed, the transport circuit
//! opens (`ops::health`). A send is recorded with the provider and its id.

use std::time::Duration;

use super::{Stop, Worker};
use crate::contract::{EmailJob, IdempotencyKey};
use crate::inbox::{normalise, Completion};
use crate::mail::{Change, Clearance, Email, RouteId, SendError, Sent, Slot};
use crate::ops::backoff::Backoff;
use crate::work::{now_ms, Outcome};

impl Worker {
    /// The job's email for `route`: its attachments fetched (`url` and `s3` ones into
    /// the spool, checked), then built. A failure is the job's (permanent) or the
    /// store's or the spool's (unavailable); it never counts on the route's breaker.
    pub(super) async fn prepare(&self, route: RouteId, job: &EmailJob) -> Result<Email, SendError> {
        let mailer = &self.cx.mailer;
        let contents = mailer.fetch(job).await?;
        mailer.build_for(job, route, &contents)
    }

    /// Sends the email through `route` while `clearance` holds, and counts
    /// the result on the route's breaker: when it opens, its prober starts, and when
    /// no route is left, consumption pauses.
    pub(super) async fn send(
        &self,
        slot: &Slot,
        route: RouteId,
        message: &Email,
        clearance: &Clearance,
    ) -> Result<Sent, SendError> {
        let mailer = &self.cx.mailer;
        let started = std::time::Instant::now();
        let sent = mailer.send_through(slot, route, message, clearance).await;
        self.cx
            .metrics()
            .smtp_send_seconds
            .observe(started.elapsed().as_secs_f64());
        let change = mailer
            .routes()
            .judge(route, sent.as_ref().err(), clearance.uncertain());
        if let Change::Opened { all_open } = change {
            self.spawn_transport_prober(route);
            if all_open {
                self.cx.health.transport_down();
            }
        }
        sent
    }

    /// Asks `route`'s transport until it answers, then closes its breaker (and the
    /// transport circuit: a route is up again). The breaker's state, open and then
    /// closed, is written for the console (`Inbox::record_breaker`).
    pub(super) fn spawn_transport_prober(&self, route: RouteId) {
        let (mailer, health) = (self.cx.mailer.clone(), self.cx.health.clone());
        let max = self.cx.settings.worker.outage_backoff_max;
        let note = self.breaker_note(route);
        tokio::spawn(async move {
            note.write(true).await;
            let mut backoff = Backoff::new(Duration::from_millis(500), max);
            loop {
                tokio::time::sleep(backoff.failed()).await;
                if mailer.probe(route).await {
                    mailer.routes().recovered(route);
                    health.transport_recovered();
                    note.write(false).await;
                    return;
                }
            }
        });
    }

    /// What the prober of `route` needs to write its breaker's state.
    fn breaker_note(&self, route: RouteId) -> BreakerNote {
        BreakerNote {
            inbox: self.cx.inbox.clone(),
            owner: self.cx.owner.clone(),
            provider: self.cx.mailer.routes().get(route).name.clone(),
            deadline: self.cx.settings.database.statement_timeout,
        }
    }

    /// Records a send and names the outcome.
    pub(super) async fn record_sent(
        &self,
        key: IdempotencyKey,
        fence: i64,
        takeover: bool,
        due_ms: i64,
        job: &EmailJob,
        sent: &Sent,
    ) -> Result<Outcome, Stop> {
        let message_id = self.cx.mailer.message_id(job);
        let provider = &self.cx.mailer.routes().get(sent.route).name;
        tracing::debug!(
            %provider,
            provider_message_id = sent.provider_message_id.as_deref().unwrap_or(""),
            "the transport accepted the email"
        );
        let lateness_ms = now_ms() - due_ms;
        // Who it went to (the job as sent: suppressed recipients left out), for the
        // feedback that may name one of them later.
        let recipients: Vec<String> = job
            .to
            .iter()
            .chain(&job.cc)
            .chain(&job.bcc)
            .map(|a| normalise(&a.email))
            .collect();
        let kept = self
            .db_durable("record sent", || {
                let sent = Completion::Sent {
                    message_id: &message_id,
                    due_ms,
                    provider,
                    provider_message_id: sent.provider_message_id.as_deref(),
                };
                let kind = job.kind.as_deref();
                (self.cx.inbox).complete_to(key.as_str(), fence, kind, sent, &recipients)
            })
            .await?;
        if kept {
            self.cx.inbox.count_sent(job.kind.as_deref().unwrap_or(""));
        }
        Ok(if kept {
            Outcome::Sent {
                key,
                takeover,
                lateness_ms,
            }
        } else {
            Outcome::SentFenceLost { key }
        })
    }
}

/// One breaker's row in `postie_breakers`, written by its prober.
struct BreakerNote {
    inbox: crate::inbox::Inbox,
    owner: String,
    provider: String,
    deadline: Duration,
}

impl BreakerNote {
    /// Writes the breaker's state, once and under the statement deadline: it is for
    /// the console's eyes, so a database that does not answer costs a log line, not
    /// the prober's work.
    async fn write(&self, open: bool) {
        let write = self.inbox.record_breaker(&self.owner, &self.provider, open);
        match tokio::time::timeout(self.deadline, write).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(provider = %self.provider, open, cause = %error.cause(), "breaker state not written")
            }
            Err(_) => {
                tracing::debug!(provider = %self.provider, open, "breaker state not written in time")
            }
        }
    }
}
