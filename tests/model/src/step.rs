//! What each action does to the state.

use crate::inbox::{self, Completion};
use crate::protocol::{claim_for, complete, record_accept, Action, Protocol};
use crate::state::{push, Disposition, Fate, Job, State, Worker};

/// Whether an action spends one of the run's faults.
pub fn is_fault(action: Action) -> bool {
    use Action::*;
    matches!(
        action,
        PublishAgain(_)
            | RelayLostConfirm
            | RelayCrash
            | LadderLose(_)
            | ReconcileExtra
            | ReplyLost(_)
            | Fail(_)
            | Refuse(_)
            | SettleLostAck(_)
            | SettleLostConfirm(_)
            | Crash(_)
            | Pause(_)
    )
}

/// Removes one copy of `job` from a queue.
fn take(queue: &mut Vec<Job>, job: Job) {
    let at = queue
        .iter()
        .position(|j| *j == job)
        .expect("the job is queued");
    queue.remove(at);
}

/// Applies `action` to `s`.
pub fn apply(p: &Protocol, s: &mut State, action: Action) {
    step(p, s, action);
    // A pause ends with the claim it was taken under.
    for (w, worker) in s.workers.iter().enumerate() {
        if matches!(
            worker,
            Worker::Idle | Worker::Holding(_) | Worker::Settling(..)
        ) {
            s.paused &= !(1 << w);
        }
    }
}

fn step(p: &Protocol, s: &mut State, action: Action) {
    use Action::*;
    match action {
        Tick => {
            s.clock += 1;
            for job in std::mem::take(&mut s.retry) {
                push(&mut s.send, job);
            }
        }
        Publish(i) | PublishAgain(i) => {
            s.published |= 1 << i;
            push(&mut s.intake, p.jobs[i as usize]);
        }
        Cancel => {
            let through = p.cancel.expect("a cancel is configured");
            inbox::postie_cancel(&mut s.row, through);
            let covers = s.row.and_then(|r| r.cancelled_through);
            s.cancelled = covers;
        }
        RelayRecord(job) => {
            take(&mut s.intake, job);
            inbox::schedule(&mut s.row, job.rev, job.due);
            s.seen = s.seen.max(job.rev);
            s.relay = Some(job);
        }
        RelayPublish | RelayLostConfirm | RelayCrash => relay(s, action),
        LadderDeliver(job) => {
            take(&mut s.ladder, job);
            push(&mut s.send, job);
        }
        LadderLose(job) => take(&mut s.ladder, job),
        Reconcile | ReconcileExtra => {
            let row = s.row.expect("an overdue row");
            push(
                &mut s.send,
                Job {
                    rev: row.revision,
                    due: row.due,
                },
            );
        }
        Deliver(w, job) => {
            take(&mut s.send, job);
            s.workers[w as usize] = Worker::Holding(job);
        }
        Crash(w) => crash(s, w),
        Pause(w) => s.paused |= 1 << w,
        Settle(w) | SettleLostAck(w) | SettleLostConfirm(w) => settle(s, w, action),
        Claim(w) | LeaseForSend(w) | Renew(w) => claim_steps(p, s, w, action),
        Accept(w) | ReplyLost(w) | Fail(w) | Refuse(w) | RecordSent(w) => send_steps(s, w, action),
    }
}

fn relay(s: &mut State, action: Action) {
    let job = s.relay.expect("the relay holds a delivery");
    match action {
        Action::RelayPublish => {
            push(&mut s.ladder, job);
            s.relay = None;
        }
        Action::RelayLostConfirm => push(&mut s.ladder, job),
        _ => {
            push(&mut s.intake, job);
            s.relay = None;
        }
    }
}

fn crash(s: &mut State, w: u8) {
    let worker = s.workers[w as usize];
    if let Worker::Accepted { serial, .. } = worker {
        set_fate(s, serial, Fate::Crashed);
    }
    let job = crate::protocol::held_job(&worker).expect("a busy worker");
    push(&mut s.send, job);
    s.workers[w as usize] = Worker::Idle;
}

fn settle(s: &mut State, w: u8, action: Action) {
    let Worker::Settling(job, disposition) = s.workers[w as usize] else {
        unreachable!("settling")
    };
    if disposition == Disposition::Republish {
        push(&mut s.retry, job);
        if action == Action::SettleLostConfirm(w) {
            push(&mut s.retry, job);
        }
    }
    if action == Action::SettleLostAck(w) {
        push(&mut s.send, job);
    }
    s.workers[w as usize] = Worker::Idle;
}

fn set_fate(s: &mut State, serial: u8, fate: Fate) {
    if let Some(a) = s.accepts.iter_mut().rev().find(|a| a.serial == serial) {
        a.fate = fate;
    }
}

/// The claim, the lease before the send, and its renewals while held.
fn claim_steps(p: &Protocol, s: &mut State, w: u8, action: Action) {
    let worker = s.workers[w as usize];
    let next = match (action, worker) {
        (Action::Claim(_), Worker::Holding(job)) => claim_for(p, s, w, job),
        (
            Action::LeaseForSend(_),
            Worker::Claimed {
                job,
                fence,
                expires,
                serial,
                after_cancel,
            },
        ) => {
            let sending = Worker::Sending {
                job,
                fence,
                serial,
                after_cancel,
                renewed: false,
            };
            if expires >= s.clock + p.send_deadline
                || inbox::renew(&mut s.row, fence, p.lease, s.clock)
            {
                Some(sending)
            } else {
                // The claim is gone: withdrawn, given back (fenced: refused), deferred.
                complete(s, fence, serial, Completion::Retrying);
                Some(Worker::Settling(job, Disposition::Republish))
            }
        }
        (
            Action::Renew(_),
            Worker::Sending {
                job,
                fence,
                serial,
                after_cancel,
                ..
            },
        ) => {
            if inbox::renew(&mut s.row, fence, p.lease, s.clock) {
                Some(Worker::Sending {
                    job,
                    fence,
                    serial,
                    after_cancel,
                    renewed: true,
                })
            } else {
                // Withdrawn before DATA: the send stops, the claim is given back.
                complete(s, fence, serial, Completion::Retrying);
                Some(Worker::Settling(job, Disposition::Republish))
            }
        }
        (
            Action::Renew(_),
            Worker::Accepted {
                job, fence, serial, ..
            },
        ) => {
            // Enabled only while the claim holds (a lost one is only logged here: the
            // record finds the fence moved).
            inbox::renew(&mut s.row, fence, p.lease, s.clock);
            Some(Worker::Accepted {
                job,
                fence,
                serial,
                renewed: true,
            })
        }
        _ => unreachable!("{action:?} for {worker:?}"),
    };
    if let Some(next) = next {
        s.workers[w as usize] = next;
    }
}

/// The send's ends: the 250, a lost 250, a 4xx, a 5xx, and the record of a 250.
fn send_steps(s: &mut State, w: u8, action: Action) {
    let worker = s.workers[w as usize];
    let next = match (action, worker) {
        (
            Action::RecordSent(_),
            Worker::Accepted {
                job, fence, serial, ..
            },
        ) => {
            let kept = complete(s, fence, serial, Completion::Sent);
            set_fate(
                s,
                serial,
                if kept {
                    Fate::Committed
                } else {
                    Fate::FenceLost
                },
            );
            Worker::Settling(job, Disposition::Ack)
        }
        (
            _,
            Worker::Sending {
                job,
                fence,
                serial,
                after_cancel,
                ..
            },
        ) => match action {
            Action::Accept(_) | Action::ReplyLost(_) => {
                let lost = matches!(action, Action::ReplyLost(_));
                let fate = if lost { Fate::ReplyLost } else { Fate::Pending };
                record_accept(s, job, fence, serial, fate);
                let covered = s.cancelled.is_some_and(|c| job.rev <= c);
                let t = &mut s.tally;
                if after_cancel {
                    t.after_cancel = t.after_cancel.saturating_add(1);
                } else if covered {
                    t.cancel_in_flight = t.cancel_in_flight.saturating_add(1);
                }
                if lost {
                    // Uncertain: given back as retrying, another turn on the same delivery.
                    complete(s, fence, serial, Completion::Retrying);
                    Worker::Holding(job)
                } else {
                    Worker::Accepted {
                        job,
                        fence,
                        serial,
                        renewed: false,
                    }
                }
            }
            Action::Fail(_) => {
                complete(s, fence, serial, Completion::Retrying);
                Worker::Settling(job, Disposition::Republish)
            }
            Action::Refuse(_) => {
                complete(s, fence, serial, Completion::Dead);
                Worker::Settling(job, Disposition::DeadLetter)
            }
            _ => unreachable!("{action:?} while sending"),
        },
        _ => unreachable!("{action:?} for {worker:?}"),
    };
    s.workers[w as usize] = next;
}
