//! The protocol as a stateright [`Model`]: every action one step of one actor, named
//! after the code (and SQL statement) it stands for.

use stateright::{Model, Property};

use crate::inbox::{self, Answer, Completion, Status};
use crate::state::{Accept, Disposition, Fate, Job, State, Tally, Worker};

/// One configuration of the model.
#[derive(Clone, Debug)]
pub struct Protocol {
    /// Workers (instances' send roles), 2 or 3.
    pub workers: u8,
    /// The jobs the producer publishes, in order: revision 0, then any reschedule.
    pub jobs: Vec<Job>,
    /// The producer may cancel through this revision (`postie cancel KEY --revision`).
    pub cancel: Option<u8>,
    /// Faults and failures the run may inject, in all: a crash, a lost ack, a lost
    /// publish confirm, a duplicate publish, a job the broker loses, a lost 250, an
    /// SMTP 4xx or 5xx, a re-publish by the reconciler of a job still in flight.
    pub faults: u8,
    /// `worker.lease`, in clock steps.
    pub lease: u8,
    /// The send deadline: `lease_for_send` renews first when less is left.
    pub send_deadline: u8,
    /// `delay.reconcile_grace`.
    pub grace: u8,
    /// The clock stops here (a property checks it is never reached).
    pub horizon: u8,
}

/// Every step of every actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Time passes; the retry queues' TTLs release their copies into `<p>.send`.
    Tick,
    /// The producer publishes job `i` to `<p>.delayed` (the ladder's intake).
    Publish(u8),
    /// Fault: the producer publishes job `i` again (its confirm was lost).
    PublishAgain(u8),
    /// `postie_cancel` (`Inbox::cancel`, from `postie cancel` or a cancel request).
    Cancel,
    /// The relay takes a delivery and records it: `Inbox::schedule_many`.
    RelayRecord(Job),
    /// The relay publishes into the ladder (confirmed) and acks.
    RelayPublish,
    /// Fault: the relay's publish confirm is lost: the copy is in, and it publishes again.
    RelayLostConfirm,
    /// Fault: the relay crashes; its delivery goes back to the intake.
    RelayCrash,
    /// The ladder hands a job to `<p>.send` (its due time, rounded down one step).
    LadderDeliver(Job),
    /// Fault: the broker loses a job in the ladder.
    LadderLose(Job),
    /// `consume::reconcile`: an overdue scheduled row no copy of which is left is
    /// published again to `<p>.send` (`Inbox::overdue`, `Inbox::mark_reconciled`).
    Reconcile,
    /// Fault: the reconciler re-publishes an overdue job that is still somewhere.
    ReconcileExtra,
    /// The broker delivers a job of `<p>.send` to a worker.
    Deliver(u8, Job),
    /// `Worker::take_turn`: `postie_claim`, once the job is due (`Worker::admit`).
    Claim(u8),
    /// `lease::lease_for_send`: `Inbox::renew` if less than the send deadline is left.
    LeaseForSend(u8),
    /// `lease::keep_lease`: `Inbox::renew` while the send or its record runs.
    Renew(u8),
    /// The relay's 250 to DATA.
    Accept(u8),
    /// Fault: the relay takes the email but its 250 never arrives (uncertain send):
    /// `COMPLETE` retrying, another turn (`Next::Pause { tried: true }`).
    ReplyLost(u8),
    /// Fault: a 4xx: `COMPLETE` retrying, a copy to the retry queue (`Next::Retry`).
    Fail(u8),
    /// Fault: a 5xx: `COMPLETE` dead, dead-lettered (`Next::Dead`).
    Refuse(u8),
    /// `record_sent`: `COMPLETE` sent, fenced.
    RecordSent(u8),
    /// `consume::send::dispose`: a confirmed publish if any, then the ack.
    Settle(u8),
    /// Fault: the ack is lost with the connection: the broker redelivers.
    SettleLostAck(u8),
    /// Fault: the republish's confirm is lost: two copies.
    SettleLostConfirm(u8),
    /// Fault: the worker's process dies; its delivery is redelivered.
    Crash(u8),
    /// Fault: the worker stops for longer than its lease while it holds a claim.
    Pause(u8),
}

impl Protocol {
    fn has_fault(&self, s: &State) -> bool {
        s.faults > 0
    }

    /// Whether some job is anywhere in the broker, the relay or a worker.
    fn in_flight(&self, s: &State, job: Job) -> bool {
        let held = s.workers.iter().any(|w| held_job(w) == Some(job));
        [&s.intake, &s.ladder, &s.retry, &s.send]
            .iter()
            .any(|q| q.contains(&job))
            || s.relay == Some(job)
            || held
    }

    /// The reconciler's candidate: the scheduled row's job, overdue by the grace.
    fn overdue(&self, s: &State) -> Option<Job> {
        let row = s.row?;
        (reconcilable(&row, s.clock) && s.clock >= row.due + self.grace).then_some(Job {
            rev: row.revision,
            due: row.due,
        })
    }

    /// Whether time has a reason to pass: something waits on the clock.
    fn waiting_on_time(&self, s: &State) -> bool {
        let holding = s
            .workers
            .iter()
            .any(|w| matches!(w, Worker::Holding(j) if s.clock < j.due));
        let ladder = s.ladder.iter().any(|j| s.clock + 1 < j.due);
        let lease = s
            .row
            .is_some_and(|r| r.status == Status::Sending && r.lease_until > s.clock);
        let reconcile = s.row.is_some_and(|r| {
            let job = Job {
                rev: r.revision,
                due: r.due,
            };
            let early = s.clock < r.due + self.grace;
            let waits =
                r.status == Status::Scheduled || r.status == Status::Sending && r.rescheduled;
            waits && r.body && early && !self.in_flight(s, job)
        });
        holding || ladder || lease || reconcile || !s.retry.is_empty()
    }

    /// Whether a running worker's lease would run out with the next step of the
    /// clock: it renews or ends its send first (`keep_lease`, the send deadline).
    fn lease_runs_out(&self, s: &State) -> bool {
        s.workers.iter().enumerate().any(|(w, worker)| {
            let fence = match *worker {
                Worker::Claimed { fence, .. }
                | Worker::Sending { fence, .. }
                | Worker::Accepted { fence, .. } => fence,
                _ => return false,
            };
            s.paused & (1 << w) == 0
                && self.holds(s, fence)
                && s.row.is_some_and(|r| r.lease_until <= s.clock + 1)
        })
    }

    /// All published, and nothing left anywhere: no copy in the broker, the relay or
    /// a worker.
    pub fn quiet(&self, s: &State) -> bool {
        s.published.count_ones() as usize == self.jobs.len()
            && s.intake.is_empty()
            && s.relay.is_none()
            && s.ladder.is_empty()
            && s.retry.is_empty()
            && s.send.is_empty()
            && s.workers.iter().all(|w| *w == Worker::Idle)
    }

    /// Quiet, and the newest revision ended: the key sent, or the row terminal at
    /// that revision, or a cancel through it.
    pub fn finished(&self, s: &State) -> bool {
        let newest = self.jobs.iter().map(|j| j.rev).max().unwrap_or(0);
        let ended = s.row.is_some_and(|r| {
            r.status == Status::Sent
                || (r.status.terminal() && r.revision >= newest)
                || r.cancelled_through.is_some_and(|c| c >= newest)
        });
        self.quiet(s) && ended
    }

    fn producer_actions(&self, s: &State, actions: &mut Vec<Action>) {
        for i in 0..self.jobs.len() as u8 {
            let published = s.published & (1 << i) != 0;
            if !published && s.published == (1 << i) - 1 {
                actions.push(Action::Publish(i));
            }
            if published && self.has_fault(s) {
                actions.push(Action::PublishAgain(i));
            }
        }
        if self.cancel.is_some() && s.cancelled.is_none() {
            actions.push(Action::Cancel);
        }
    }

    fn broker_actions(&self, s: &State, actions: &mut Vec<Action>) {
        let fault = self.has_fault(s);
        match s.relay {
            None => distinct(&s.intake, |j| actions.push(Action::RelayRecord(j))),
            Some(_) => {
                actions.push(Action::RelayPublish);
                if fault {
                    actions.extend([Action::RelayLostConfirm, Action::RelayCrash]);
                }
            }
        }
        distinct(&s.ladder, |j| {
            if s.clock + 1 >= j.due {
                actions.push(Action::LadderDeliver(j));
            }
            if fault {
                actions.push(Action::LadderLose(j));
            }
        });
        if let Some(job) = self.overdue(s) {
            if !self.in_flight(s, job) {
                actions.push(Action::Reconcile);
            } else if fault {
                actions.push(Action::ReconcileExtra);
            }
        }
        if s.clock < self.horizon && self.waiting_on_time(s) && !self.lease_runs_out(s) {
            actions.push(Action::Tick);
        }
    }

    fn worker_actions(&self, s: &State, w: u8, actions: &mut Vec<Action>) {
        use Action::*;
        let fault = self.has_fault(s);
        match s.workers[w as usize] {
            Worker::Idle => distinct(&s.send, |j| actions.push(Deliver(w, j))),
            Worker::Holding(job) if s.clock >= job.due => actions.push(Claim(w)),
            Worker::Holding(_) => {}
            Worker::Claimed { .. } => actions.push(LeaseForSend(w)),
            Worker::Sending { fence, renewed, .. } => {
                actions.push(Accept(w));
                if !self.holds(s, fence) || (!renewed && self.renewal_moves(s)) {
                    actions.push(Renew(w));
                }
                if fault {
                    actions.extend([ReplyLost(w), Fail(w), Refuse(w)]);
                }
            }
            Worker::Accepted { fence, renewed, .. } => {
                actions.push(RecordSent(w));
                if !renewed && self.holds(s, fence) && self.renewal_moves(s) {
                    actions.push(Renew(w));
                }
            }
            Worker::Settling(_, disposition) => {
                actions.push(Settle(w));
                if fault {
                    actions.push(SettleLostAck(w));
                }
                if fault && disposition == Disposition::Republish {
                    actions.push(SettleLostConfirm(w));
                }
            }
        }
        let worker = s.workers[w as usize];
        if fault && worker != Worker::Idle {
            actions.push(Crash(w));
        }
        let claiming = matches!(
            worker,
            Worker::Claimed { .. } | Worker::Sending { .. } | Worker::Accepted { .. }
        );
        if fault && claiming && s.paused & (1 << w) == 0 {
            actions.push(Pause(w));
        }
    }

    /// Whether the claim `fence` still holds the row (`Inbox::renew` would succeed).
    fn holds(&self, s: &State, fence: u8) -> bool {
        s.row
            .is_some_and(|r| r.fence == fence && r.status == Status::Sending)
    }

    /// Whether a renewal now would move the lease (one that changes nothing is left
    /// out: a step to the same state would hide a terminal state from the checker).
    fn renewal_moves(&self, s: &State) -> bool {
        s.row.is_some_and(|r| r.lease_until != s.clock + self.lease)
    }
}

/// The job a worker holds a delivery of.
pub fn held_job(w: &Worker) -> Option<Job> {
    match *w {
        Worker::Idle => None,
        Worker::Holding(job) | Worker::Settling(job, _) => Some(job),
        Worker::Claimed { job, .. }
        | Worker::Sending { job, .. }
        | Worker::Accepted { job, .. } => Some(job),
    }
}

/// Calls `f` once per distinct job of a sorted queue.
fn distinct(queue: &[Job], mut f: impl FnMut(Job)) {
    let mut last = None;
    for &job in queue {
        if last != Some(job) {
            f(job);
            last = Some(job);
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            clock: 0,
            row: None,
            intake: vec![],
            relay: None,
            ladder: vec![],
            retry: vec![],
            send: vec![],
            workers: vec![Worker::Idle; self.workers as usize],
            paused: 0,
            published: 0,
            cancelled: None,
            seen: 0,
            faults: self.faults,
            claims: 0,
            latest: 0,
            accepts: vec![],
            tally: Tally::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        self.producer_actions(s, actions);
        self.broker_actions(s, actions);
        for w in 0..self.workers {
            self.worker_actions(s, w, actions);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        if crate::step::is_fault(action) {
            n.faults -= 1;
        }
        crate::step::apply(self, &mut n, action);
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::properties::all()
    }
}

pub(crate) use inbox::postie_claim as claim;

/// The ghost record of a 250 (or a lost one), classifying it against earlier ones of
/// the same revision.
pub(crate) fn record_accept(s: &mut State, job: Job, fence: u8, serial: u8, fate: Fate) {
    let lease_ok = s.row.is_some_and(|r| {
        r.fence == fence && r.status == Status::Sending && r.lease_until > s.clock
    });
    let t = &mut s.tally;
    for p in s.accepts.iter().filter(|p| p.rev == job.rev) {
        let counter = if !p.lease_ok || !lease_ok {
            &mut t.dup_lease_expired
        } else {
            match p.fate {
                Fate::Crashed => &mut t.dup_crash,
                Fate::ReplyLost => &mut t.dup_reply_lost,
                Fate::Pending | Fate::FenceLost => &mut t.dup_record_late,
                Fate::Committed => &mut t.dup_undocumented,
            }
        };
        *counter = counter.saturating_add(1);
    }
    if s.clock < job.due {
        t.early = t.early.saturating_add(1);
    }
    s.accepts.push(Accept {
        rev: job.rev,
        serial,
        lease_ok,
        fate,
    });
}

/// A completion under the claim `serial`: `COMPLETE`, and the stale-fence ghost.
pub(crate) fn complete(s: &mut State, fence: u8, serial: u8, completion: Completion) -> bool {
    let kept = inbox::complete(&mut s.row, fence, completion);
    if kept && serial != s.latest {
        s.tally.stale_commits = s.tally.stale_commits.saturating_add(1);
    }
    kept
}

/// `postie_claim` for worker `w`'s job, with the ghosts: the claim's serial, and
/// whether a cancel covering it had committed.
pub(crate) fn claim_for(p: &Protocol, s: &mut State, w: u8, job: Job) -> Option<Worker> {
    let seen = s.seen;
    s.seen = seen.max(job.rev);
    match claim(&mut s.row, w, p.lease, job.rev, s.clock) {
        Answer::Claimed { fence, .. } => {
            if job.rev < seen {
                s.tally.older_claimed = s.tally.older_claimed.saturating_add(1);
            }
            s.claims += 1;
            s.latest = s.claims;
            Some(Worker::Claimed {
                job,
                fence,
                expires: s.clock + p.lease,
                serial: s.claims,
                after_cancel: s.cancelled.is_some_and(|c| job.rev <= c),
            })
        }
        Answer::Done | Answer::Stale => Some(Worker::Settling(job, Disposition::Ack)),
        Answer::Cancelled => {
            inbox::finish_cancelled(&mut s.row, job.rev, s.clock);
            Some(Worker::Settling(job, Disposition::Ack))
        }
        Answer::Busy => Some(Worker::Settling(job, Disposition::Republish)),
    }
}

/// What `Inbox::overdue` reads: a scheduled row with its body, or a row rescheduled
/// while `sending` whose sender is gone (its lease ran out; sql/0017, finding 3).
pub fn reconcilable(row: &crate::inbox::Row, clock: u8) -> bool {
    row.body
        && (row.status == Status::Scheduled
            || row.status == Status::Sending && row.rescheduled && row.lease_until <= clock)
}
