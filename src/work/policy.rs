//! The retry policy: what each kind of failure becomes. One table, read top to
//! bottom, so that a new reply class or a new rule is one arm here and one row in the
//! tests below.
//!
//! | failure | next |
//! |---|---|
//! | the transport refused the email for good (SMTP 5xx) | dead-letter now (`permanent`) |
//! | a transient reply (SMTP 4xx) | retry queue `attempt - 1`, or dead-letter (`retries_exhausted`) once every step is used |
//! | the relay throttles this sender (421/451/454 matching `smtp.throttle_patterns`) | pause: claim given back, tried again within a second, no attempt counted |
//! | the relay unreachable or hung (a step past `transport.timeout`), circuit closed | pause: claim given back (the inbox records the SMTP attempt), tried again within a second, no attempt counted; the failures open the breaker |
//! | the relay unreachable and the circuit open | hold: claim given back, delivery held until it answers, no attempt counted |
//! | another instance holds a live lease | defer to the smallest retry step covering the rest of the lease, no attempt counted |
//! | PostgreSQL unavailable | hold: wait until it answers, no attempt counted |

use std::time::Duration;

use super::DeadKind;

/// A failure on the way from delivery to outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The transport refused this email for good (SMTP 5xx).
    Refused,
    /// A transient reply (SMTP 4xx, or the file transport failed).
    Transient,
    /// The relay could not be reached; `circuit_open` once the breaker has opened.
    Unreachable {
        /// The breaker is open: the relay is down for everyone, not for this job.
        circuit_open: bool,
    },
    /// Another instance holds a live claim on the key for `remaining`.
    LeaseBusy {
        /// Time left on the other claim.
        remaining: Duration,
    },
    /// The relay throttles this sender: not the job's fault.
    Throttled,
    /// Something besides the transport the email needs (an attachment's store) is
    /// down, for the `waits`-th time in a row before this one: not the job's fault.
    Unavailable {
        /// Waits so far.
        waits: u32,
    },
}

/// What happens next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Back through retry queue `step`, with `attempt` failures counted in this cycle.
    Retry {
        /// Retry queue index.
        step: usize,
        /// Failed attempts in this cycle, this one included.
        attempt: u32,
    },
    /// To the dead-letter queue now.
    Dead {
        /// The reason class.
        kind: DeadKind,
        /// Failed attempts in this cycle, this one included.
        attempts: u32,
    },
    /// Park in retry queue `step` without counting an attempt.
    Defer {
        /// Retry queue index.
        step: usize,
    },
    /// Not the job's fault: hold the delivery until the dependency answers, without
    /// counting an attempt.
    Hold,
    /// Not the job's fault, and only this job's: through retry queue `step` (one
    /// longer each time, up to the last) without counting an attempt, carrying
    /// `waits`.
    Wait {
        /// Retry queue index.
        step: usize,
        /// Waits in a row, this one included.
        waits: u32,
    },
    /// Not the job's fault: give the claim back, wait a short jittered moment (the
    /// instance slows down meanwhile) and try again, without counting an attempt.
    Pause {
        /// The email may have reached the relay (it hung or dropped the connection):
        /// the inbox records an SMTP attempt. A throttle reply records none.
        tried: bool,
    },
}

/// The backoff steps and the rules above.
#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    steps: Vec<Duration>,
}

impl RetryPolicy {
    /// A policy over the retry queues' TTLs (`topology.retry_steps`): a job gets
    /// `steps.len() + 1` attempts.
    pub(crate) fn new(steps: &[Duration]) -> Self {
        Self {
            steps: steps.to_vec(),
        }
    }

    /// What `failure` becomes for a job that had failed `failed_so_far` times in this
    /// retry cycle.
    pub(crate) fn next(&self, failure: Failure, failed_so_far: u32) -> Next {
        let attempt = failed_so_far + 1;
        match failure {
            Failure::Refused => Next::Dead {
                kind: DeadKind::Permanent,
                attempts: attempt,
            },
            Failure::Unreachable { circuit_open: true } => Next::Hold,
            Failure::Throttled => Next::Pause { tried: false },
            Failure::Unreachable {
                circuit_open: false,
            } => Next::Pause { tried: true },
            Failure::Transient => {
                if attempt as usize > self.steps.len() {
                    Next::Dead {
                        kind: DeadKind::Exhausted,
                        attempts: attempt,
                    }
                } else {
                    Next::Retry {
                        step: attempt as usize - 1,
                        attempt,
                    }
                }
            }
            Failure::LeaseBusy { remaining } => Next::Defer {
                step: self.step_at_least(remaining),
            },
            Failure::Unavailable { waits } => Next::Wait {
                step: (waits as usize).min(self.steps.len().saturating_sub(1)),
                waits: waits.saturating_add(1),
            },
        }
    }

    /// The smallest retry step that is at least `wait`, or the largest one.
    pub(crate) fn step_at_least(&self, wait: Duration) -> usize {
        self.steps
            .iter()
            .position(|step| *step >= wait)
            .unwrap_or(self.steps.len().saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(steps: &[u64]) -> RetryPolicy {
        RetryPolicy::new(
            &steps
                .iter()
                .map(|s| Duration::from_secs(*s))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn every_failure_maps_to_its_next_step() {
        use DeadKind::*;
        use Failure::*;
        let p = policy(&[5, 30, 120]);
        let secs = Duration::from_secs;
        let closed = Unreachable {
            circuit_open: false,
        };
        let open = Unreachable { circuit_open: true };
        #[rustfmt::skip]
        let table: &[(Failure, u32, Next)] = &[
            // failure,                        failed so far, next
            (Refused,                          0, Next::Dead { kind: Permanent, attempts: 1 }),
            (Refused,                          2, Next::Dead { kind: Permanent, attempts: 3 }),
            (Transient,                        0, Next::Retry { step: 0, attempt: 1 }),
            (Transient,                        2, Next::Retry { step: 2, attempt: 3 }),
            (Transient,                        3, Next::Dead { kind: Exhausted, attempts: 4 }),
            (closed,                           1, Next::Pause { tried: true }),
            (closed,                           3, Next::Pause { tried: true }),
            (open,                             3, Next::Hold),
            (Throttled,                        0, Next::Pause { tried: false }),
            (Throttled,                        4, Next::Pause { tried: false }),
            (LeaseBusy { remaining: secs(4) }, 0, Next::Defer { step: 0 }),
            (LeaseBusy { remaining: secs(31) },2, Next::Defer { step: 2 }),
            (Unavailable { waits: 0 },         3, Next::Wait { step: 0, waits: 1 }),
            (Unavailable { waits: 1 },         0, Next::Wait { step: 1, waits: 2 }),
            (Unavailable { waits: 9 },         3, Next::Wait { step: 2, waits: 10 }),
        ];
        for &(failure, failed, expected) in table {
            assert_eq!(
                p.next(failure, failed),
                expected,
                "{failure:?} after {failed}"
            );
        }
    }

    #[test]
    fn picks_the_smallest_step_covering_a_wait() {
        let t = policy(&[5, 30, 120]);
        assert_eq!(t.step_at_least(Duration::from_secs(1)), 0);
        assert_eq!(t.step_at_least(Duration::from_secs(5)), 0);
        assert_eq!(t.step_at_least(Duration::from_secs(6)), 1);
        assert_eq!(t.step_at_least(Duration::from_secs(1000)), 2);
    }
}
