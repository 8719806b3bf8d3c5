//! The send itself, the circuit breaker's prober, and the record of a send.

use std::time::Duration;

use super::{Stop, Worker};
use crate::contract::{EmailJob, IdempotencyKey};
use crate::inbox::Completion;
use crate::mail::{Clearance, SendError, Slot};
use crate::ops::backoff::Backoff;
use crate::work::{now_ms, Outcome};

impl Worker {
    /// Builds and sends the email on `slot` while `clearance` holds; a reached relay
    /// (any answer) closes the breaker's count.
    pub(super) async fn send(
        &self,
        slot: &Slot,
        job: &EmailJob,
        clearance: &Clearance,
    ) -> Result<(), SendError> {
        let message = self.cx.mailer.build(job)?;
        let started = std::time::Instant::now();
        let sent = self.cx.mailer.send(slot, &message, clearance).await;
        self.cx
            .metrics()
            .smtp_send_seconds
            .observe(started.elapsed().as_secs_f64());
        if !matches!(
            sent,
            Err(SendError::Unreachable(_) | SendError::Withdrawn(_))
        ) {
            self.cx.health.transport_reached();
        }
        sent
    }

    /// Asks the relay until it answers, then closes the circuit.
    pub(super) fn spawn_transport_prober(&self) {
        let (mailer, health) = (self.cx.mailer.clone(), self.cx.health.clone());
        let max = self.cx.settings.worker.outage_backoff_max;
        tokio::spawn(async move {
            let mut backoff = Backoff::new(Duration::from_millis(500), max);
            loop {
                tokio::time::sleep(backoff.failed()).await;
                if mailer.probe().await {
                    health.transport_recovered();
                    return;
                }
            }
        });
    }

    /// Records a send and names the outcome.
    pub(super) async fn record_sent(
        &self,
        key: IdempotencyKey,
        fence: i64,
        takeover: bool,
        due_ms: i64,
        job: &EmailJob,
    ) -> Result<Outcome, Stop> {
        let message_id = self.cx.mailer.message_id(job);
        let lateness_ms = now_ms() - due_ms;
        let kept = self
            .db_durable("record sent", || {
                let sent = Completion::Sent {
                    message_id: &message_id,
                    due_ms,
                };
                self.cx.inbox.complete(key.as_str(), fence, sent)
            })
            .await?;
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
