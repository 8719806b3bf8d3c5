//! The unit of work: one delivery in, one named [`Outcome`] out.
//!
//! The worker parses, claims in the inbox, sends, and records the result. It never
//! touches the broker: the consume loop applies each outcome's [`Disposition`], so the
//! rule "no ack before the outcome is durable" lives in one place. What a failure
//! becomes is the [`RetryPolicy`]'s to say.
//!
//! [`Disposition`]: super::Disposition
//!
//! PostgreSQL being down is never the job's fault: every database step is retried
//! with backoff until it answers (the delivery stays unacked meanwhile), and
//! [`Health`] tells the consumer to stop taking new work until then. The same goes
//! for an unreachable SMTP relay once the circuit breaker opens: the claim is given
//! back, the delivery held, and the job sent when the relay answers again.

use std::sync::Arc;
use std::time::Duration;

use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

mod due;
mod lease;
mod throttle;

use super::limiter::Limiter;
use super::policy::{Failure, Next, RetryPolicy};
use super::{now_ms, DeadKind, Outcome};
use crate::broker::Topology;
use crate::config::Settings;
use crate::contract::{self, EmailJob, IdempotencyKey, InvalidJob, ParseRules, Request};
use crate::headers::{header_int, HEADER_ATTEMPT};
use crate::inbox::{Claim, Completion, DbError, Inbox, Scheduled};
use crate::mail::{Clearance, Mailer, SendError, Slot};
use crate::ops::backoff::Backoff;
use crate::ops::health::Health;

/// What [`Worker::follow`] leads to.
enum Followed {
    /// The delivery's outcome.
    Outcome(Outcome),
    /// The dependency answers again: claim and send once more.
    TryAgain,
}

/// Why a unit of work stopped short of an outcome.
enum Stop {
    /// Shutting down: leave the delivery unacked.
    Interrupted,
    /// PostgreSQL refused a statement for what this job carried: dead-letter it.
    Refused(DbError),
}

/// The worker stopped waiting for PostgreSQL because the process is shutting down;
/// the delivery must be left unacked so the broker hands it to someone else.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("interrupted by shutdown while waiting for the database")]
pub struct Interrupted;

/// Everything one unit of work needs.
#[derive(Clone)]
pub struct Worker {
    inbox: Inbox,
    mailer: Mailer,
    topology: Topology,
    policy: RetryPolicy,
    limiter: Limiter,
    settings: Arc<Settings>,
    owner: String,
    health: Health,
    hard_stop: CancellationToken,
}

impl Worker {
    /// Assembles a worker. `hard_stop` ends waits for the database (drain timeout).
    pub fn new(
        settings: Arc<Settings>,
        parts: (Inbox, Mailer, Topology),
        owner: String,
        health: Health,
        hard_stop: CancellationToken,
    ) -> Self {
        let (inbox, mailer, topology) = parts;
        let limiter = Limiter::new(
            &settings.smtp,
            inbox.clone(),
            &settings.topology.prefix,
            health.metrics().clone(),
        );
        Self {
            policy: RetryPolicy::new(topology.retry_steps()),
            limiter,
            inbox,
            mailer,
            topology,
            settings,
            owner,
            health,
            hard_stop,
        }
    }

    /// Ladder mode: records a batch of scheduled jobs in one commit, riding out a database outage. If PostgreSQL refuses the batch for what
    /// one job carried, each is tried alone, so only that one goes unlisted (it is
    /// still relayed).
    pub async fn schedule_many(&self, jobs: &[Scheduled]) -> Result<(), Interrupted> {
        match self.db("schedule", || self.inbox.schedule_many(jobs)).await {
            Ok(()) => Ok(()),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::Refused(_)) => {
                for job in jobs {
                    match self
                        .db("schedule", || {
                            self.inbox.schedule_many(std::slice::from_ref(job))
                        })
                        .await
                    {
                        Ok(()) | Err(Stop::Refused(_)) => {}
                        Err(Stop::Interrupted) => return Err(Interrupted),
                    }
                }
                Ok(())
            }
        }
    }

    /// The inbox (for the pending gauge).
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// The dependency health this worker reports into.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Processes one delivery's body, headers, AMQP timestamp and AMQP `user_id`.
    pub async fn process(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
        user_id: Option<&str>,
    ) -> Result<Outcome, Interrupted> {
        match self
            .process_steps(body, headers, timestamp_s, user_id)
            .await
        {
            Ok(outcome) => Ok(outcome),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::Refused(error)) => Ok(Outcome::DeadLetter {
                key: contract::peek_key(body)
                    .and_then(|(key, _)| self.rules(user_id).namespaced(&key).ok()),
                kind: DeadKind::Invalid,
                reason: format!("the database refused this job: {error}"),
                attempts: 0,
            }),
        }
    }

    async fn process_steps(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
        user_id: Option<&str>,
    ) -> Result<Outcome, Stop> {
        // Our own counter, but a producer can set any header: keep it in range.
        let failed_so_far = header_int(headers, HEADER_ATTEMPT)
            .unwrap_or(0)
            .clamp(0, 1_000) as u32;
        let job = match Request::parse(body, &self.rules(user_id)) {
            Ok(Request::Job(job)) => job,
            Ok(Request::Cancel { key, revision }) => {
                let cancelled = self
                    .db("cancel", || self.inbox.cancel(key.as_str(), revision))
                    .await?;
                return Ok(Outcome::CancelRequest { key, cancelled });
            }
            Err(InvalidJob(reason)) => {
                return Ok(Outcome::DeadLetter {
                    key: None,
                    kind: DeadKind::Invalid,
                    reason,
                    attempts: 0,
                })
            }
        };
        let key = job.key.clone();
        let due_ms = match self.due_ms(headers, timestamp_s) {
            Ok(due) => due,
            Err(InvalidJob(reason)) => {
                return Ok(Outcome::DeadLetter {
                    key: Some(key),
                    kind: DeadKind::Invalid,
                    reason,
                    attempts: 0,
                })
            }
        };
        let early_ms = due_ms.saturating_sub(now_ms());
        if early_ms > 0 {
            if early_ms as u128 > self.hold_limit().as_millis() {
                return Ok(Outcome::Early {
                    key,
                    due_ms,
                    early_ms,
                });
            }
            // Never early: wait out the last sub-unit rest of the ladder.
            tokio::select! {
                _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                _ = tokio::time::sleep(Duration::from_millis(early_ms as u64)) => {}
            }
        }

        loop {
            // The send rate: waited for before the claim, holding nothing. The turn
            // is kept until this iteration's send attempt has ended.
            let _turn = tokio::select! {
                _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                turn = async {
                    self.limiter.pace().await;
                    self.db("rate limit", || self.limiter.fleet_token()).await
                } => turn?,
            };
            // A connection turn, before the claim: a send that had to wait for one
            // after it would be waiting on the lease's time.
            let slot = tokio::select! {
                _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                slot = self.mailer.slot() => slot,
            };
            let asked = std::time::Instant::now();
            let claim = self
                .db("claim", || {
                    self.inbox.claim(
                        key.as_str(),
                        &self.owner,
                        self.settings.worker.lease,
                        job.revision,
                    )
                })
                .await?;
            let (fence, takeover) = match claim {
                Claim::AlreadySent => return Ok(Outcome::Duplicate { key }),
                Claim::Cancelled => return Ok(Outcome::Cancelled { key }),
                Claim::Stale => return Ok(Outcome::Stale { key }),
                Claim::Busy { remaining } => {
                    drop(slot);
                    let next = self
                        .policy
                        .next(Failure::LeaseBusy { remaining }, failed_so_far);
                    let why = "claimed by another instance";
                    match self.follow(next, &key, None, why).await? {
                        Followed::Outcome(outcome) => return Ok(outcome),
                        Followed::TryAgain => continue,
                    }
                }
                Claim::Claimed {
                    fence, takeover, ..
                } => (fence, takeover),
            };
            if takeover {
                tracing::warn!(key = %key, "took over an expired claim: the previous owner may have sent this email");
            }
            if let Some(outcome) = self.throttle(&job, fence, due_ms).await? {
                return Ok(outcome);
            }
            let mut held = lease::Held::new(fence, asked, self.settings.worker.lease);
            let sent = if self.lease_for_send(key.as_str(), &mut held).await? {
                let send = self.send(&slot, &job, &held.clearance);
                tokio::select! {
                    _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                    sent = self.holding(key.as_str(), &held, send) => sent,
                }
            } else {
                held.clearance.check()
            };
            drop(slot);
            let error = match sent {
                Ok(()) => {
                    self.limiter.sent();
                    let record = self.record_sent(key.clone(), fence, takeover, due_ms, &job);
                    return self.holding(key.as_str(), &held, record).await;
                }
                Err(error) => error,
            };
            let failure = match &error {
                SendError::Permanent(_) => Failure::Refused,
                // Another instance holds the key now: it has its own copy of the job.
                SendError::Withdrawn(_) => Failure::LeaseBusy {
                    remaining: self.settings.worker.lease,
                },
                SendError::Transient(_) => Failure::Transient,
                SendError::Throttled(_) => {
                    self.limiter.throttled();
                    Failure::Throttled
                }
                SendError::Unreachable(_) => {
                    if self.health.transport_unreachable() {
                        self.spawn_transport_prober();
                    }
                    Failure::Unreachable {
                        circuit_open: !self.health.transport_up(),
                    }
                }
            };
            let next = self.policy.next(failure, failed_so_far);
            match self.follow(next, &key, Some(fence), error.detail()).await? {
                Followed::Outcome(outcome) => return Ok(outcome),
                Followed::TryAgain => continue,
            }
        }
    }

    /// Carries out what the retry policy decided after `error`: records it under the
    /// claim `fence` (if this instance holds one) and names the outcome, or waits for
    /// the dependency to answer and asks for another try.
    async fn follow(
        &self,
        next: Next,
        key: &IdempotencyKey,
        fence: Option<i64>,
        error: &str,
    ) -> Result<Followed, Stop> {
        Ok(match next {
            Next::Retry { step, attempt } => {
                self.give_back("record retry", key, fence, error).await?;
                Followed::Outcome(Outcome::Retry {
                    key: key.clone(),
                    step,
                    attempt,
                    error: error.to_string(),
                })
            }
            Next::Defer { step } => {
                self.give_back("defer", key, fence, error).await?;
                Followed::Outcome(Outcome::Deferred {
                    key: key.clone(),
                    step,
                })
            }
            Next::Hold => {
                // Not the job's fault: give the claim back, hold the delivery, and
                // start over when the dependency answers.
                self.give_back("release", key, fence, error).await?;
                tokio::select! {
                    _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                    _ = self.health.wait_dependencies_up() => Followed::TryAgain,
                }
            }
            Next::Pause { tried } => {
                // Throttled, or the relay hung or unreachable before the breaker
                // opened: give the claim back without charging the job (the inbox
                // records an SMTP attempt that may have reached the relay), wait a
                // jittered moment (the limiter has cut the rate; the breaker may open
                // meanwhile), and take a turn again once the transport is up.
                match fence {
                    Some(_) if tried => self.give_back("release", key, fence, error).await?,
                    Some(fence) => {
                        self.db("release", || {
                            self.inbox.complete(
                                key.as_str(),
                                fence,
                                Completion::Unclaimed { why: error },
                            )
                        })
                        .await?;
                    }
                    None => {}
                }
                let jitter = uuid::Uuid::new_v4().as_u128() % 750;
                tokio::select! {
                    _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                    _ = async {
                        tokio::time::sleep(Duration::from_millis(250 + jitter as u64)).await;
                        self.health.wait_dependencies_up().await;
                    } => Followed::TryAgain,
                }
            }
            Next::Dead { kind, attempts } => {
                if let Some(fence) = fence {
                    self.db("record dead", || {
                        self.inbox
                            .complete(key.as_str(), fence, Completion::Dead { error })
                    })
                    .await?;
                }
                let reason = match kind {
                    DeadKind::Permanent => format!("SMTP refused the email: {error}"),
                    DeadKind::Exhausted => {
                        format!("gave up after {attempts} attempts; last error: {error}")
                    }
                    DeadKind::Invalid => error.to_string(),
                };
                Followed::Outcome(Outcome::DeadLetter {
                    key: Some(key.clone()),
                    kind,
                    reason,
                    attempts,
                })
            }
        })
    }

    /// Gives the claim `fence` (if this instance holds one) back, recording the
    /// attempt and its error.
    async fn give_back(
        &self,
        what: &str,
        key: &IdempotencyKey,
        fence: Option<i64>,
        error: &str,
    ) -> Result<(), Stop> {
        if let Some(fence) = fence {
            self.db(what, || {
                self.inbox
                    .complete(key.as_str(), fence, Completion::Retrying { error })
            })
            .await?;
        }
        Ok(())
    }

    async fn send(
        &self,
        slot: &Slot,
        job: &EmailJob,
        clearance: &Clearance,
    ) -> Result<(), SendError> {
        let message = self.mailer.build(job)?;
        let started = std::time::Instant::now();
        let sent = self.mailer.send(slot, &message, clearance).await;
        self.health
            .metrics()
            .smtp_send_seconds
            .observe(started.elapsed().as_secs_f64());
        if !matches!(
            sent,
            Err(SendError::Unreachable(_) | SendError::Withdrawn(_))
        ) {
            self.health.transport_reached();
        }
        sent
    }

    /// Asks the relay until it answers, then closes the circuit.
    fn spawn_transport_prober(&self) {
        let (mailer, health) = (self.mailer.clone(), self.health.clone());
        let max = self.settings.worker.outage_backoff_max;
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
    async fn record_sent(
        &self,
        key: IdempotencyKey,
        fence: i64,
        takeover: bool,
        due_ms: i64,
        job: &EmailJob,
    ) -> Result<Outcome, Stop> {
        let message_id = self.mailer.message_id(job);
        let lateness_ms = now_ms() - due_ms;
        let kept = self
            .db_durable("record sent", || {
                let sent = Completion::Sent {
                    message_id: &message_id,
                    due_ms,
                };
                self.inbox.complete(key.as_str(), fence, sent)
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

    /// The contract's rules for a message published by `user_id`.
    fn rules<'a>(&'a self, user_id: Option<&'a str>) -> ParseRules<'a> {
        ParseRules::from_settings(&self.settings).for_user(user_id)
    }

    /// Runs one database step until PostgreSQL answers (an outage is waited out with
    /// [`Backoff`]); a refusal for what the job carried stops it.
    async fn db<T, F, Fut>(&self, what: &str, step: F) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        self.db_until(what, step, DbError::is_outage).await
    }

    /// Like [`Worker::db`], but every error is waited out, a refusal too: for a
    /// record that must be written (a `sent` after the relay's 250) and is never the
    /// job's fault, since it carries only what the claim already took.
    async fn db_durable<T, F, Fut>(&self, what: &str, step: F) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        self.db_until(what, step, |_| true).await
    }

    /// Runs `step` until it succeeds, waiting out every error that `wait_out` says
    /// is not the job's; pauses consumption (readiness false) meanwhile.
    async fn db_until<T, F, Fut>(
        &self,
        what: &str,
        mut step: F,
        wait_out: fn(&DbError) -> bool,
    ) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        let mut backoff = Backoff::new(
            Duration::from_millis(100),
            self.settings.worker.outage_backoff_max,
        );
        loop {
            match step().await {
                Ok(value) => {
                    self.health.set_database_up();
                    return Ok(value);
                }
                Err(error) if !wait_out(&error) => {
                    tracing::error!(%error, step = what, "the database refused a statement for this job");
                    return Err(Stop::Refused(error));
                }
                Err(error) => {
                    tracing::debug!(%error, step = what, "database step failed");
                    self.health
                        .set_database_down(&error.cause(), &error.to_string());
                    if !backoff.wait(&self.hard_stop).await {
                        return Err(Stop::Interrupted);
                    }
                }
            }
        }
    }
}
