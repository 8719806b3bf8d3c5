//! The unit of work (DESIGN §3): one delivery in, one named [`Outcome`] out.
//!
//! The worker parses, claims in the inbox, sends, and records the result. It never
//! touches the broker: the consumer maps each outcome to a publish and an ack, so the
//! rule "no ack before the outcome is durable" lives in one place.
//!
//! PostgreSQL being down is never the job's fault: every database step is retried
//! with backoff until it answers (the delivery stays unacked meanwhile), and
//! [`Health`] tells the consumer to stop taking new work until then. The same goes
//! for an unreachable SMTP relay once the circuit breaker opens: the claim is given
//! back, the delivery held, and the job sent when the relay answers again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::amqp::{header_int, HEADER_ATTEMPT};
use crate::config::{Settings, ThrottlePolicy, ThrottleRule, WorkerSettings};
use crate::delay::{self, HEADER_DUE_AT, HEADER_PUBLISHED_AT};
use crate::health::{next_backoff, Health};
use crate::inbox::{Cancelled, Claim, DbError, Inbox, Throttle};
use crate::job::{EmailJob, IdempotencyKey, InvalidJob, ParseRules, Request};
use crate::mailer::{Mailer, SendError};
use crate::topology::{DelayLayout, Topology};

/// A job that reaches the worker at most this much before its due time is held
/// until due (the ladder rounds down to whole units); earlier ones go back to wait.
const HOLD_SLACK: Duration = Duration::from_secs(2);

/// Why a job is dead-lettered, as a stable label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadKind {
    /// The message can never become an email.
    Invalid,
    /// The SMTP server refused it for good (5xx).
    Permanent,
    /// Transient failures used up every retry step.
    Exhausted,
}

impl DeadKind {
    /// The label used in headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Permanent => "permanent",
            Self::Exhausted => "retries_exhausted",
        }
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Sent and recorded. `takeover` means an expired claim was taken over first, so
    /// the previous owner may have sent it too (the known duplicate window).
    Sent {
        /// The job's key.
        key: IdempotencyKey,
        /// An expired lease was taken over.
        takeover: bool,
        /// Sent minus due, in ms (negative never happens by construction).
        lateness_ms: i64,
    },
    /// Arrived well before its due time (clock skew, or moved in by hand): goes back
    /// to the delayed exchange, stamped with its due time.
    Early {
        /// The job's key.
        key: IdempotencyKey,
        /// Due time, Unix ms.
        due_ms: i64,
        /// How far off, in ms.
        early_ms: i64,
    },
    /// Sent, but meanwhile another instance took the key over (fence moved).
    SentFenceLost {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// Already sent: acked without sending.
    Duplicate {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A cancel covers this job's revision: acked without sending.
    Cancelled {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A newer revision of the key exists: acked without sending.
    Stale {
        /// The job's key.
        key: IdempotencyKey,
    },
    /// A cancel request was recorded.
    CancelRequest {
        /// The key cancelled.
        key: IdempotencyKey,
        /// What the inbox said.
        cancelled: Cancelled,
    },
    /// Over its type's throttle: dropped (`until_ms` None) or deferred until then.
    Throttled {
        /// The job's key.
        key: IdempotencyKey,
        /// Deferred until (Unix ms), or None when dropped.
        until_ms: Option<i64>,
    },
    /// Another instance holds a live claim: park the job in retry queue `step`,
    /// which is at least the remaining lease away, without counting an attempt.
    Deferred {
        /// The job's key.
        key: IdempotencyKey,
        /// Retry queue index.
        step: usize,
    },
    /// A transient failure: retry queue `step`, with `attempt` failures so far.
    Retry {
        /// The job's key.
        key: IdempotencyKey,
        /// Retry queue index.
        step: usize,
        /// Failed attempts in this cycle, this one included.
        attempt: u32,
        /// What went wrong.
        error: String,
    },
    /// To the dead-letter queue with a reason a person can read.
    DeadLetter {
        /// The job's key, when the message had one.
        key: Option<IdempotencyKey>,
        /// The reason class.
        kind: DeadKind,
        /// The reason.
        reason: String,
        /// Failed attempts in this cycle.
        attempts: u32,
    },
}

impl Outcome {
    /// A short label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Sent { .. } => "sent",
            Self::Early { .. } => "early",
            Self::SentFenceLost { .. } => "sent_fence_lost",
            Self::Duplicate { .. } => "duplicate",
            Self::Cancelled { .. } => "cancelled",
            Self::Stale { .. } => "stale",
            Self::CancelRequest { .. } => "cancel_request",
            Self::Throttled { .. } => "throttled",
            Self::Deferred { .. } => "deferred",
            Self::Retry { .. } => "retry",
            Self::DeadLetter { .. } => "dead_letter",
        }
    }
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
#[derive(Debug, thiserror::Error)]
#[error("interrupted by shutdown while waiting for the database")]
pub struct Interrupted;

/// Now, in Unix milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Everything one unit of work needs.
#[derive(Clone)]
pub struct Worker {
    inbox: Inbox,
    mailer: Mailer,
    topology: Topology,
    settings: WorkerSettings,
    default_from: Option<String>,
    throttles: Arc<BTreeMap<String, ThrottleRule>>,
    owner: String,
    health: Health,
    hard_stop: CancellationToken,
}

impl Worker {
    /// Assembles a worker. `hard_stop` ends waits for the database (drain timeout).
    pub fn new(
        settings: &Settings,
        parts: (Inbox, Mailer, Topology),
        owner: String,
        health: Health,
        hard_stop: CancellationToken,
    ) -> Self {
        let (inbox, mailer, topology) = parts;
        Self {
            inbox,
            mailer,
            topology,
            settings: settings.worker.clone(),
            default_from: settings.smtp.default_from.clone(),
            throttles: Arc::new(settings.throttle.clone()),
            owner,
            health,
            hard_stop,
        }
    }

    /// Ladder mode: records a job the relay scheduled, riding out a database outage.
    pub async fn schedule(
        &self,
        key: &IdempotencyKey,
        revision: i32,
        due_ms: i64,
    ) -> Result<(), Interrupted> {
        match self
            .db("schedule", || {
                self.inbox.schedule(key.as_str(), revision, due_ms)
            })
            .await
        {
            Ok(()) | Err(Stop::Refused(_)) => Ok(()), // refused: not listed as pending, still relayed
            Err(Stop::Interrupted) => Err(Interrupted),
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

    /// Processes one delivery's body, headers and AMQP timestamp.
    pub async fn process(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
    ) -> Result<Outcome, Interrupted> {
        match self.process_steps(body, headers, timestamp_s).await {
            Ok(outcome) => Ok(outcome),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::Refused(error)) => Ok(Outcome::DeadLetter {
                key: crate::job::peek_key(body).map(|(key, _)| key),
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
    ) -> Result<Outcome, Stop> {
        // Our own counter, but a producer can set any header: keep it in range.
        let failed_so_far = header_int(headers, HEADER_ATTEMPT)
            .unwrap_or(0)
            .clamp(0, 1_000) as u32;
        let job = match self.parse(body) {
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
            let claim = self
                .db("claim", || {
                    self.inbox
                        .claim(key.as_str(), &self.owner, self.settings.lease, job.revision)
                })
                .await?;
            let (fence, takeover) = match claim {
                Claim::AlreadySent => return Ok(Outcome::Duplicate { key }),
                Claim::Cancelled => return Ok(Outcome::Cancelled { key }),
                Claim::Stale => return Ok(Outcome::Stale { key }),
                Claim::Busy { remaining } => {
                    let step = self.topology.step_at_least(remaining);
                    return Ok(Outcome::Deferred { key, step });
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
            let sent = self.send(&job).await;
            if let Err(SendError::Unreachable(error)) = &sent {
                if self.health.smtp_unreachable() {
                    self.spawn_smtp_prober();
                }
                if !self.health.smtp_up() {
                    // Circuit open: not the job's fault. Give the claim back, hold the
                    // delivery, and start over when the relay answers.
                    self.db("release", || self.inbox.release(key.as_str(), fence, error))
                        .await?;
                    tokio::select! {
                        _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                        _ = self.health.wait_smtp_up() => continue,
                    }
                }
            }
            return self
                .record(key, fence, takeover, due_ms, failed_so_far, &job, sent)
                .await;
        }
    }

    /// Applies the job type's throttle, if any, under the claim: `None` to go on.
    async fn throttle(
        &self,
        job: &EmailJob,
        fence: i64,
        due_ms: i64,
    ) -> Result<Option<Outcome>, Stop> {
        let Some(rule) = job.kind.as_ref().and_then(|kind| self.throttles.get(kind)) else {
            return Ok(None);
        };
        let kind = job.kind.as_deref().unwrap_or_default();
        let recipient = job.throttle_recipient();
        let verdict = self
            .db("throttle", || {
                self.inbox
                    .throttle(kind, &recipient, rule.limit, rule.window)
            })
            .await?;
        let Throttle::Limited { next_ms } = verdict else {
            return Ok(None);
        };
        let key = job.key.clone();
        Ok(Some(match rule.policy {
            ThrottlePolicy::Drop => {
                self.db("record throttled", || {
                    self.inbox.mark_throttled(key.as_str(), fence)
                })
                .await?;
                Outcome::Throttled {
                    key,
                    until_ms: None,
                }
            }
            ThrottlePolicy::Defer => {
                self.db("defer", || {
                    self.inbox
                        .unclaim(key.as_str(), fence, "throttled (defer policy)")
                })
                .await?;
                Outcome::Throttled {
                    key,
                    until_ms: Some(next_ms.max(due_ms)),
                }
            }
        }))
    }

    async fn send(&self, job: &EmailJob) -> Result<(), SendError> {
        let message = self.mailer.build(job)?;
        let started = std::time::Instant::now();
        let sent = self.mailer.send(&message).await;
        self.health
            .metrics()
            .smtp_send_seconds
            .observe(started.elapsed().as_secs_f64());
        if !matches!(sent, Err(SendError::Unreachable(_))) {
            self.health.smtp_reached();
        }
        sent
    }

    /// Asks the relay until it answers, then closes the circuit.
    fn spawn_smtp_prober(&self) {
        let (mailer, health) = (self.mailer.clone(), self.health.clone());
        let max = self.settings.outage_backoff_max;
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(500);
            loop {
                tokio::time::sleep(backoff).await;
                if mailer.probe().await {
                    health.smtp_recovered();
                    return;
                }
                backoff = next_backoff(backoff, max);
            }
        });
    }

    /// Records the result of a send and names the outcome.
    #[allow(clippy::too_many_arguments)]
    async fn record(
        &self,
        key: IdempotencyKey,
        fence: i64,
        takeover: bool,
        due_ms: i64,
        failed_so_far: u32,
        job: &EmailJob,
        sent: Result<(), SendError>,
    ) -> Result<Outcome, Stop> {
        match sent {
            Ok(()) => {
                let message_id = self.mailer.message_id(job);
                let lateness_ms = now_ms() - due_ms;
                let kept = self
                    .db("record sent", || {
                        self.inbox
                            .mark_sent(key.as_str(), fence, &message_id, due_ms)
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
            Err(SendError::Permanent(error)) => {
                self.db("record dead", || {
                    self.inbox.mark_dead(key.as_str(), fence, &error)
                })
                .await?;
                Ok(Outcome::DeadLetter {
                    key: Some(key),
                    kind: DeadKind::Permanent,
                    reason: format!("SMTP refused the email: {error}"),
                    attempts: failed_so_far + 1,
                })
            }
            Err(SendError::Transient(error)) | Err(SendError::Unreachable(error)) => {
                let attempt = failed_so_far + 1;
                let steps = self.topology.retry_steps().len();
                if attempt as usize > steps {
                    self.db("record dead", || {
                        self.inbox.mark_dead(key.as_str(), fence, &error)
                    })
                    .await?;
                    return Ok(Outcome::DeadLetter {
                        key: Some(key),
                        kind: DeadKind::Exhausted,
                        reason: format!("gave up after {attempt} attempts; last error: {error}"),
                        attempts: attempt,
                    });
                }
                self.db("record retry", || {
                    self.inbox.mark_retrying(key.as_str(), fence, &error)
                })
                .await?;
                Ok(Outcome::Retry {
                    key,
                    step: attempt as usize - 1,
                    attempt,
                    error,
                })
            }
        }
    }

    /// The due time in Unix ms. The ladder stamps `postie-due-at`; the plugin has
    /// already waited, so without a publish time there, the job is due now.
    fn due_ms(
        &self,
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
    ) -> Result<i64, InvalidJob> {
        let now = now_ms();
        let max = self.topology.max_delay();
        match self.topology.delay() {
            DelayLayout::Ladder(_) => delay::due_at(headers, timestamp_s, now, max),
            DelayLayout::Plugin => {
                delay::x_delay(headers, max)?; // refuse a bad x-delay in this mode too
                let known = header_int(headers, HEADER_DUE_AT).is_some()
                    || header_int(headers, HEADER_PUBLISHED_AT).is_some()
                    || timestamp_s.is_some();
                if known {
                    delay::due_at(headers, timestamp_s, now, max)
                } else {
                    Ok(now)
                }
            }
        }
    }

    fn hold_limit(&self) -> Duration {
        match self.topology.delay() {
            DelayLayout::Ladder(ladder) => ladder.resolution() + HOLD_SLACK,
            DelayLayout::Plugin => HOLD_SLACK,
        }
    }

    fn parse(&self, body: &[u8]) -> Result<Request, InvalidJob> {
        Request::parse(
            body,
            &ParseRules {
                max_body_bytes: self.settings.max_body_bytes,
                default_from: self.default_from.as_deref(),
            },
        )
    }

    /// Runs one database step until PostgreSQL answers, with capped backoff.
    async fn db<T, F, Fut>(&self, what: &str, mut step: F) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        let mut backoff = Duration::from_millis(100);
        loop {
            match step().await {
                Ok(value) => {
                    self.health.set_database_up(true);
                    return Ok(value);
                }
                Err(error) if !error.is_outage() => {
                    tracing::error!(%error, step = what, "the database refused a statement for this job");
                    return Err(Stop::Refused(error));
                }
                Err(error) => {
                    if self.health.database_up() {
                        tracing::warn!(%error, step = what, "database step failed");
                    }
                    self.health.set_database_up(false);
                    tokio::select! {
                        _ = self.hard_stop.cancelled() => return Err(Stop::Interrupted),
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = next_backoff(backoff, self.settings.outage_backoff_max);
                }
            }
        }
    }
}
