//! Ladder mode's arrival marks: a `<p>.send` delivery that a worker has held for
//! [`ARRIVAL_AFTER`] without claiming it (waiting for a slot, the send rate, an open
//! breaker, a slow relay) is marked as arrived in the inbox, so that the reconciler
//! knows it is not lost, only waiting. Marks are written in batches by one task and
//! only for deliveries that wait: a job claimed at once costs nothing here.
//!
//! A mark is a hint. A full queue of marks drops the newest (logged), and a failed
//! write is logged and dropped: the reconciler still checks the send queue before it
//! re-publishes anything, and the claim keeps a needless copy from sending twice.

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::contract::IdempotencyKey;
use crate::inbox::Inbox;

/// How long a delivery waits unclaimed before it is marked as arrived.
pub(super) const ARRIVAL_AFTER: Duration = Duration::from_millis(500);

/// The most keys marked in one statement.
const BATCH_MAX: usize = 512;

/// Keys waiting to be marked, at most.
const QUEUE_MAX: usize = 8_192;

/// The handle consume loops use; cheap to clone. Disabled (a no-op) outside ladder
/// mode or when the reconciler is off.
#[derive(Clone)]
pub(super) struct Arrivals {
    keys: Option<mpsc::Sender<String>>,
}

impl Arrivals {
    /// Starts the writer when `enabled`.
    pub(super) fn start(inbox: Inbox, enabled: bool) -> Self {
        if !enabled {
            return Self { keys: None };
        }
        let (keys, mut incoming) = mpsc::channel::<String>(QUEUE_MAX);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(BATCH_MAX);
            while incoming.recv_many(&mut batch, BATCH_MAX).await > 0 {
                if let Err(error) = inbox.mark_arrived(&batch).await {
                    tracing::warn!(%error, jobs = batch.len(), "could not mark waiting jobs as arrived");
                }
                batch.clear();
            }
        });
        Self { keys: Some(keys) }
    }

    /// Whether marks are written at all.
    pub(super) fn enabled(&self) -> bool {
        self.keys.is_some()
    }

    /// Marks the job `key` as arrived (if it has one).
    pub(super) fn note(&self, key: Option<&IdempotencyKey>) {
        let (Some(keys), Some(key)) = (&self.keys, key) else {
            return;
        };
        if keys.try_send(key.as_str().to_owned()).is_err() {
            tracing::debug!("arrival marks queue full; one mark dropped");
        }
    }

    /// Runs `work` on the delivery of the job `key`; if it is still running at
    /// `mark_at`, marks the job as arrived (`None`: already marked, or marks are off).
    /// The key is read only then: a job claimed at once has its body read once.
    pub(super) async fn watch<F: Future>(
        &self,
        mark_at: Option<Instant>,
        key: impl FnOnce() -> Option<IdempotencyKey>,
        work: F,
    ) -> F::Output {
        let Some(at) = mark_at.filter(|_| self.enabled()) else {
            return work.await;
        };
        tokio::pin!(work);
        tokio::select! {
            output = &mut work => return output,
            _ = tokio::time::sleep_until(at) => self.note(key().as_ref()),
        }
        work.await
    }
}
