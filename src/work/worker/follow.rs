//! What a failure leads to: the [`RetryPolicy`](crate::work::RetryPolicy)'s
//! [`Next`] carried out under the claim (recorded, given back, waited out) and the
//! delivery's outcome named, or another try asked for. Also what a send error is to
//! the policy, and a claim a cancel covers ended `cancelled` with its event.

use std::time::Duration;

use super::{Followed, Stop, Worker};
use crate::contract::EmailJob;
use crate::inbox::Completion;
use crate::mail::{RouteId, SendError};
use crate::work::policy::Failure;
use crate::work::{DeadKind, Next, Outcome};

impl Worker {
    /// A claim a cancel covers: a row that a failed send left `retrying` ends
    /// `cancelled`, with its event (`Inbox::finish_cancelled`).
    pub(super) async fn cancelled(&self, job: &EmailJob) -> Result<Outcome, Stop> {
        let kind = job.kind.as_deref();
        self.db("finish cancelled", || {
            self.cx
                .inbox
                .finish_cancelled(job.key.as_str(), job.revision, kind)
        })
        .await?;
        Ok(Outcome::Cancelled {
            key: job.key.clone(),
        })
    }

    /// Carries out what the retry policy decided after `error`: records it under the
    /// claim `fence` (if this instance holds one) and names the outcome, or waits for
    /// the dependency to answer and asks for another try. A retry of a job `pinned`
    /// to a route carries the route's name (`postie-provider`).
    pub(super) async fn follow(
        &self,
        next: Next,
        job: &EmailJob,
        fence: Option<i64>,
        error: &str,
        pinned: Option<RouteId>,
    ) -> Result<Followed, Stop> {
        let key = &job.key;
        Ok(match next {
            Next::Retry { step, attempt } => {
                self.give_back("record retry", job, fence, error).await?;
                Followed::Outcome(Outcome::Retry {
                    key: key.clone(),
                    step,
                    attempt,
                    error: error.to_string(),
                    provider: pinned.map(|r| self.cx.mailer.routes().get(r).name.clone()),
                })
            }
            Next::Defer { step } => {
                self.give_back("defer", job, fence, error).await?;
                Followed::Outcome(Outcome::Deferred {
                    key: key.clone(),
                    step,
                })
            }
            Next::Wait { step, waits } => {
                // Nothing reached the transport: no SMTP attempt recorded.
                self.hand_back("wait for a store", job, fence, error)
                    .await?;
                Followed::Outcome(Outcome::Waiting {
                    key: key.clone(),
                    step,
                    waits,
                    error: error.to_string(),
                })
            }
            Next::Hold => {
                // Not the job's fault: give the claim back, hold the delivery, and
                // start over when the dependency answers.
                self.give_back("release", job, fence, error).await?;
                tokio::select! {
                    _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                    _ = self.cx.health.wait_dependencies_up() => Followed::TryAgain,
                }
            }
            Next::Pause { tried } => self.pause(job, fence, tried, error).await?,
            Next::Dead {
                kind: dead,
                attempts,
            } => {
                if let Some(fence) = fence {
                    let kind = job.kind.as_deref();
                    self.db("record dead", || {
                        self.cx.inbox.complete(
                            key.as_str(),
                            fence,
                            kind,
                            Completion::Dead { error },
                        )
                    })
                    .await?;
                }
                let reason = match dead {
                    DeadKind::Permanent => format!("the transport refused the email: {error}"),
                    DeadKind::Exhausted => {
                        format!("gave up after {attempts} attempts; last error: {error}")
                    }
                    DeadKind::Invalid => error.to_string(),
                };
                Followed::Outcome(Outcome::DeadLetter {
                    key: Some(key.clone()),
                    kind: dead,
                    reason,
                    attempts,
                })
            }
        })
    }

    /// Throttled, or the relay hung or unreachable before the breaker opened: gives
    /// the claim back without charging the job (the inbox records an SMTP attempt that
    /// may have reached the relay, `tried`), waits a jittered moment (the limiter has
    /// cut the rate; the breaker may open meanwhile), and asks for another turn once
    /// the transport is up.
    async fn pause(
        &self,
        job: &EmailJob,
        fence: Option<i64>,
        tried: bool,
        error: &str,
    ) -> Result<Followed, Stop> {
        if tried {
            self.give_back("release", job, fence, error).await?;
        } else {
            self.hand_back("release", job, fence, error).await?;
        }
        let jitter = uuid::Uuid::new_v4().as_u128() % 750;
        tokio::select! {
            _ = self.cx.hard_stop.cancelled() => Err(Stop::Interrupted),
            _ = async {
                tokio::time::sleep(Duration::from_millis(250 + jitter as u64)).await;
                self.cx.health.wait_dependencies_up().await;
            } => Ok(Followed::TryAgain),
        }
    }

    /// Gives the claim `fence` (if this instance holds one) back, recording the
    /// attempt and its error.
    pub(super) async fn give_back(
        &self,
        what: &str,
        job: &EmailJob,
        fence: Option<i64>,
        error: &str,
    ) -> Result<(), Stop> {
        self.let_go(what, job, fence, Completion::Retrying { error })
            .await
    }

    /// Gives the claim `fence` (if held) back without an SMTP attempt recorded
    /// (`Completion::Unclaimed`): nothing reached the transport.
    async fn hand_back(
        &self,
        what: &str,
        job: &EmailJob,
        fence: Option<i64>,
        why: &str,
    ) -> Result<(), Stop> {
        self.let_go(what, job, fence, Completion::Unclaimed { why })
            .await
    }

    /// Records `completion` under the claim `fence`, if this instance holds one.
    async fn let_go(
        &self,
        what: &str,
        job: &EmailJob,
        fence: Option<i64>,
        completion: Completion<'_>,
    ) -> Result<(), Stop> {
        if let Some(fence) = fence {
            let (key, kind) = (job.key.as_str(), job.kind.as_deref());
            self.db(what, || {
                self.cx.inbox.complete(key, fence, kind, completion)
            })
            .await?;
        }
        Ok(())
    }

    /// What a send error is to the retry policy. An unreachable transport pauses the
    /// job while some route is up (it goes through the next one, or waits for its
    /// pinned one), and holds it once every route's breaker is open.
    pub(super) fn failure(&self, error: &SendError, store_waits: u32) -> Failure {
        match error {
            SendError::Unavailable(_) => Failure::Unavailable { waits: store_waits },
            SendError::Permanent(_) => Failure::Refused,
            // Another instance holds the key now: it has its own copy of the job.
            SendError::Withdrawn(_) => Failure::LeaseBusy {
                remaining: self.cx.settings.worker.lease,
            },
            SendError::Transient(_) => Failure::Transient,
            SendError::Throttled(_) => Failure::Throttled,
            SendError::Unreachable(_) => Failure::Unreachable {
                circuit_open: !self.cx.mailer.routes().any_up(),
            },
        }
    }
}
