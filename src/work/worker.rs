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
//! [`Health`](crate::ops::health::Health) tells the consumer to stop taking new work
//! until then. The same goes for an unreachable SMTP relay once the circuit breaker
//! opens: the claim is given back, the delivery held, and the job sent when the relay
//! answers again.
//!
//! One delivery goes through three steps: [`Worker::admit`] (parse, cancel, due time,
//! a debounced job's first sight (`Outcome::Debounced`), its send window
//! (`Outcome::Held` until it opens), wait out the ladder's last sub-unit rest; a job
//! of another lane than its queue's is `Outcome::Moved` to its lane), then turns ([`Worker::take_turn`]: the route (the
//! job's pin, else the first up) and that route's send rate, a connection slot, the
//! claim) until one ends in an outcome, each claimed turn making one
//! [`Worker::attempt`] (throttle, lease, send, record; an uncertain send pins the job
//! to its route, `Pin`). The rest lives beside it: `db.rs`, `follow.rs`, `send.rs`,
//! `lease.rs`, `limits.rs`, `throttle.rs`, `due.rs`, `route.rs`, `suppress.rs`,
//! `window.rs` (the send window, checked again just before the claim), `debounce.rs`
//! (a debounced job's version recorded, then claimed by the revision postie gave it),
//! `unsubscribe.rs` (one-click unsubscribe's headers, added when the job is admitted).

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use lapin::types::FieldTable;

mod db;
mod debounce;
mod due;
mod follow;
mod lease;
mod limits;
mod route;
mod send;
mod suppress;
mod throttle;
mod unsubscribe;
mod window;

use super::context::SharedContext;
use super::lanes::FairShare;
use super::limiter::Limiter;
use super::policy::{Failure, RetryPolicy};
use super::{now_ms, DeadKind, Outcome};
use crate::contract::{self, EmailJob, InvalidJob, ParseRules, Request};
use crate::headers::{
    header_int, header_text, HEADER_ATTEMPT, HEADER_PROVIDER, HEADER_STORE_WAITS,
};
use crate::inbox::{Claim, DbError};
use crate::mail::{RouteId, SendError, Slot};
use crate::topology::LaneId;

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
pub(crate) struct Interrupted;

/// A job admitted to its turns: parsed, due, how many tries it has failed, and the
/// route it is pinned to, if any.
struct Admitted {
    job: Box<EmailJob>,
    lane: LaneId,
    due_ms: i64,
    failed_so_far: u32,
    /// Times in a row it waited for its attachments' store (`postie-store-waits`).
    store_waits: u32,
    pin: route::Pin,
}

/// A claim taken for one attempt.
struct Claimed {
    fence: i64,
    takeover: bool,
    /// When the claim was asked for (its lease counts from before the statement).
    asked: Instant,
}

/// The unit of work over the instance's [`Context`](super::Context), with its own
/// retry policy and a send-rate limiter per route; cheap to clone.
#[derive(Clone)]
pub(crate) struct Worker {
    cx: SharedContext,
    policy: RetryPolicy,
    /// One per route of the mailer, in its order.
    limiters: std::sync::Arc<[Limiter]>,
    /// The lanes' shares of the send rate; `None` with one lane.
    share: Option<FairShare>,
    /// Each lane's own cap (`topology.lanes.<l>.rate_limit`), in lane order.
    lane_caps: std::sync::Arc<[Option<Limiter>]>,
}

impl Worker {
    /// A worker over `cx`; its `hard_stop` ends waits for the database (drain timeout).
    pub(crate) fn new(cx: SharedContext) -> Self {
        let lanes = cx.topology.lanes();
        Self {
            policy: RetryPolicy::new(cx.topology.retry_steps()),
            limiters: limits::route_limiters(&cx),
            share: (lanes.len() > 1).then(|| FairShare::new(lanes.iter().map(|l| l.weight))),
            lane_caps: limits::lane_caps(&cx),
            cx,
        }
    }

    /// Processes one delivery's body, headers, AMQP timestamp and AMQP `user_id`,
    /// taken from `lane`'s queue.
    pub(crate) async fn process(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        (timestamp_s, user_id): (Option<u64>, Option<&str>),
        lane: LaneId,
    ) -> Result<Outcome, Interrupted> {
        match self
            .process_steps(body, headers, (timestamp_s, user_id), lane)
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

    /// Admits the job, then takes turns until one names its outcome.
    async fn process_steps(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        (timestamp_s, user_id): (Option<u64>, Option<&str>),
        lane: LaneId,
    ) -> Result<Outcome, Stop> {
        let admitted = match self
            .admit(body, headers, (timestamp_s, user_id), lane)
            .await?
        {
            ControlFlow::Continue(admitted) => admitted,
            ControlFlow::Break(outcome) => return Ok(outcome),
        };
        if let Some(deferred) = self.tenant_turn(&admitted, headers).await? {
            return Ok(deferred);
        }
        loop {
            if let Followed::Outcome(outcome) = self.take_turn(&admitted).await? {
                return Ok(outcome);
            }
        }
    }

    /// Parses the delivery and reads its due time: a cancel request, an invalid job,
    /// a job of another lane than `from`'s queue and a job that came too early end
    /// here (`Break`); a job due within the hold limit is held until due (never
    /// early) and goes on to its turns.
    async fn admit(
        &self,
        body: &[u8],
        headers: Option<&FieldTable>,
        (timestamp_s, user_id): (Option<u64>, Option<&str>),
        from: LaneId,
    ) -> Result<ControlFlow<Outcome, Admitted>, Stop> {
        let invalid = |key, reason| {
            ControlFlow::Break(Outcome::DeadLetter {
                key,
                kind: DeadKind::Invalid,
                reason,
                attempts: 0,
            })
        };
        // Our own counter, but a producer can set any header: keep it in range.
        let failed_so_far = header_int(headers, HEADER_ATTEMPT)
            .unwrap_or(0)
            .clamp(0, 1_000) as u32;
        let store_waits = header_int(headers, HEADER_STORE_WAITS)
            .unwrap_or(0)
            .clamp(0, 1_000) as u32;
        let pin = header_text(headers, HEADER_PROVIDER).and_then(|name| {
            let route = self.cx.mailer.routes().named(&name);
            if route.is_none() {
                tracing::warn!(provider = %name, "the job was pinned to a provider that is no longer configured; it goes to the first one up");
            }
            route
        });
        let mut job = match Request::parse(body, &self.rules(user_id)) {
            Ok(Request::Job(job)) => job,
            Ok(Request::Cancel { key, revision }) => {
                let cancelled = self
                    .db("cancel", || self.cx.inbox.cancel(key.as_str(), revision))
                    .await?;
                return Ok(ControlFlow::Break(Outcome::CancelRequest {
                    key,
                    cancelled,
                }));
            }
            Err(InvalidJob(reason)) => return Ok(invalid(None, reason)),
        };
        let lane = self.cx.topology.lane_named(job.lane.as_deref());
        if lane != from {
            let key = job.key;
            return Ok(ControlFlow::Break(Outcome::Moved { key, lane }));
        }
        if let Err(reason) = self.add_unsubscribe(&mut job, lane) {
            return Ok(invalid(Some(job.key), reason));
        }
        let due_ms = match self.due_ms(headers, timestamp_s, job.send_at_ms) {
            Ok(due) => due,
            Err(InvalidJob(reason)) => return Ok(invalid(Some(job.key), reason)),
        };
        if let Some(debounce) = job.debounce {
            let seen = (headers, body);
            if let ControlFlow::Break(outcome) = self
                .debounce(&mut job, debounce, (lane, due_ms), seen)
                .await?
            {
                return Ok(ControlFlow::Break(outcome));
            }
        }
        let now = now_ms();
        let mut due_ms = due_ms;
        if let Some(opens) = self.window_hold(&job, lane, due_ms.max(now)) {
            let wait_ms = opens.saturating_sub(now);
            if wait_ms as u128 > self.hold_limit().as_millis() {
                let (key, until_ms) = (job.key, opens);
                return Ok(ControlFlow::Break(Outcome::Held {
                    key,
                    until_ms,
                    wait_ms,
                }));
            }
            // Opens within the hold: waited out here, as the ladder's last rest is.
            due_ms = opens;
        }
        let early_ms = due_ms.saturating_sub(now);
        if early_ms > 0 {
            if early_ms as u128 > self.hold_limit().as_millis() {
                return Ok(ControlFlow::Break(Outcome::Early {
                    key: job.key,
                    due_ms,
                    early_ms,
                }));
            }
            // Never early: wait out the last sub-unit rest of the ladder.
            tokio::select! {
                _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                _ = tokio::time::sleep(Duration::from_millis(early_ms as u64)) => {}
            }
        }
        Ok(ControlFlow::Continue(Admitted {
            job,
            lane,
            due_ms,
            failed_so_far,
            store_waits,
            pin: route::Pin::new(pin),
        }))
    }

    /// One turn: the route, its send rate, a connection slot, the claim; a claimed
    /// job gets an [`attempt`](Worker::attempt), a busy key what the policy says.
    async fn take_turn(&self, admitted: &Admitted) -> Result<Followed, Stop> {
        let Admitted {
            job, failed_so_far, ..
        } = admitted;
        let key = &job.key;
        let route = self.route(admitted).await?;
        let limiter = &self.limiters[route.0];
        let pinned = admitted.pin.get().is_some();
        // The lane's own cap, then its share among the lanes waiting: both before
        // the send rate, holding nothing.
        let (_lane_turn, passage) = self.lane_turn(admitted.lane).await?;
        // The send rate: waited for before the claim, holding nothing. The turn
        // is kept until this turn's send attempt has ended. A job that may go
        // elsewhere stops waiting for a route whose breaker opens meanwhile.
        let _turn = tokio::select! {
            _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
            _ = self.cx.mailer.routes().get(route).wait_down(), if !pinned => {
                return Ok(Followed::TryAgain);
            }
            turn = async {
                limiter.pace().await;
                self.db("rate limit", || limiter.fleet_token()).await
            } => turn?,
        };
        // A connection turn, before the claim: a send that had to wait for one
        // after it would be waiting on the lease's time.
        let slot = tokio::select! {
            _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
            slot = self.cx.mailer.slot() => slot,
        };
        // The next lane's job may go on to its turn.
        drop(passage);
        // A window may have closed while the job waited for its turn.
        let now = now_ms();
        if let Some(until_ms) = self.window_hold(job, admitted.lane, now) {
            let (key, wait_ms) = (key.clone(), until_ms - now);
            return Ok(Followed::Outcome(Outcome::Held {
                key,
                until_ms,
                wait_ms,
            }));
        }
        let asked = Instant::now();
        let lease = self.cx.settings.worker.lease;
        let claim = self
            .db("claim", || {
                self.cx
                    .inbox
                    .claim(key.as_str(), &self.cx.owner, lease, job.revision)
            })
            .await?;
        let done = |outcome| Ok(Followed::Outcome(outcome));
        match claim {
            Claim::AlreadySent => done(Outcome::Duplicate { key: key.clone() }),
            Claim::Cancelled => done(self.cancelled(job).await?),
            Claim::Stale => done(Outcome::Stale { key: key.clone() }),
            Claim::Busy { remaining } => {
                drop(slot);
                let next = self
                    .policy
                    .next(Failure::LeaseBusy { remaining }, *failed_so_far);
                self.follow(next, job, None, "claimed by another instance", None)
                    .await
            }
            Claim::Claimed {
                fence, takeover, ..
            } => {
                let claimed = Claimed {
                    fence,
                    takeover,
                    asked,
                };
                self.attempt(admitted, route, slot, claimed).await
            }
        }
    }

    /// One attempt under a claim: the suppression list, the job type's throttle, a lease
    /// long enough for the send, the send, and its record (or what the policy makes of
    /// its failure).
    async fn attempt(
        &self,
        admitted: &Admitted,
        route: RouteId,
        slot: Slot,
        claimed: Claimed,
    ) -> Result<Followed, Stop> {
        let (job, due_ms) = (&admitted.job, &admitted.due_ms);
        let (failed_so_far, pin) = (&admitted.failed_so_far, &admitted.pin);
        let Claimed {
            fence,
            takeover,
            asked,
        } = claimed;
        let key = &job.key;
        if takeover {
            tracing::warn!(key = %key, "took over an expired claim: the previous owner may have sent this email");
        }
        // Suppressed recipients left out before anything counts the send.
        let kept;
        let job: &EmailJob = match self.check_suppression(job, fence).await? {
            suppress::Checked::Clear => job,
            suppress::Checked::Some(without) => {
                kept = without;
                &kept
            }
            suppress::Checked::All(outcome) => return Ok(Followed::Outcome(outcome)),
        };
        if let Some(outcome) = self.throttle(job, fence, *due_ms).await? {
            return Ok(Followed::Outcome(outcome));
        }
        let mut held = lease::Held::new(fence, asked, self.cx.settings.worker.lease);
        // The attachments are fetched under the claim, its lease kept meanwhile.
        let prepared = tokio::select! {
            _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
            email = self.holding(key.as_str(), &held, self.prepare(route, job)) => email,
        };
        let sent = match prepared {
            Err(error) => Err(error),
            Ok(email) => {
                let deadline = self.cx.mailer.deadline_for(&email);
                if self
                    .lease_for_send(key.as_str(), &mut held, deadline)
                    .await?
                {
                    let send = self.send(&slot, route, &email, &held.clearance);
                    tokio::select! {
                        _ = self.cx.hard_stop.cancelled() => return Err(Stop::Interrupted),
                        sent = self.holding(key.as_str(), &held, send) => sent,
                    }
                } else {
                    // The claim is gone: its clearance is withdrawn.
                    Err(held.clearance.check().err().unwrap_or_else(|| {
                        SendError::Withdrawn("the claim was lost before the send".into())
                    }))
                }
            }
        };
        drop(slot);
        if held.clearance.uncertain() {
            pin.set(route);
        }
        let limiter = &self.limiters[route.0];
        match sent {
            Ok(sent) => {
                limiter.sent();
                let record = self.record_sent(key.clone(), fence, takeover, *due_ms, job, &sent);
                let outcome = self.holding(key.as_str(), &held, record).await?;
                Ok(Followed::Outcome(outcome))
            }
            Err(error) => {
                if matches!(error, SendError::Throttled(_)) {
                    limiter.throttled();
                }
                let mut failure = self.failure(&error, admitted.store_waits);
                let recipients = job.to.len() + job.cc.len() + job.bcc.len();
                if matches!(error, SendError::Permanent(_))
                    && self.note_bounce(route, &held.clearance, job).await?
                    && recipients > 1
                {
                    // A hard bounce of one recipient: the others may still take it,
                    // and the retry leaves the suppressed one out.
                    failure = Failure::Transient;
                }
                let next = self.policy.next(failure, *failed_so_far);
                self.follow(next, job, Some(fence), error.detail(), pin.get())
                    .await
            }
        }
    }

    /// The contract's rules for a message published by `user_id`.
    fn rules<'a>(&'a self, user_id: Option<&'a str>) -> ParseRules<'a> {
        ParseRules::from_settings(&self.cx.settings).for_user(user_id)
    }
}
