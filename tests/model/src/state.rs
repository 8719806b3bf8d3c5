//! The model's state: the inbox row, the broker's queues, the relay, the workers,
//! the clock, and the ghost records the properties read (what was sent, and how).

use crate::inbox::Row;

/// A job as published: its revision and due time (`x-delay`, stamped once).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Job {
    pub rev: u8,
    pub due: u8,
}

/// What a worker does with its delivery once its outcome is durable
/// (`work::Disposition`, carried out by `consume::send::dispose`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Ack (sent, duplicate, stale, cancelled, a fence lost after the 250).
    Ack,
    /// A confirmed publish of a copy to a retry queue, then the ack (`Outcome::Retry`,
    /// `Outcome::Deferred` for a busy key).
    Republish,
    /// Dead-lettered (a 5xx): the DLQ keeps it; the row is `dead`.
    DeadLetter,
}

/// One worker (an instance's send role, one delivery at a time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    Idle,
    /// A delivery, unacked, waiting for its due time (`Worker::admit`).
    Holding(Job),
    /// `postie_claim` answered `claimed`; `expires` is the lease by the worker's own
    /// clock (`lease::Held`); `serial` numbers the claim (ghost, for the fence property);
    /// `after_cancel`: a cancel covering this revision had committed before the claim.
    Claimed {
        job: Job,
        fence: u8,
        expires: u8,
        serial: u8,
        after_cancel: bool,
    },
    /// The send is under way (`lease_for_send` passed): DATA not yet answered.
    /// `renewed`: `keep_lease` has renewed once (the model allows one renewal a phase,
    /// which bounds a send as its deadline does; a failed renewal is always possible).
    Sending {
        job: Job,
        fence: u8,
        serial: u8,
        after_cancel: bool,
        renewed: bool,
    },
    /// The relay's 250 received; `sent` not yet committed (`record_sent`).
    Accepted {
        job: Job,
        fence: u8,
        serial: u8,
        renewed: bool,
    },
    /// The outcome is durable; the disposition is next.
    Settling(Job, Disposition),
}

/// What became of an accepted email's record (ghost).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fate {
    /// Not recorded yet.
    Pending,
    /// `sent` committed under its fence.
    Committed,
    /// The worker crashed between the 250 and the commit.
    Crashed,
    /// `COMPLETE` found the fence moved (`Outcome::SentFenceLost`).
    FenceLost,
    /// The 250 never arrived: the relay took it, the send looked uncertain.
    ReplyLost,
}

/// One email the relay accepted (ghost).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Accept {
    pub rev: u8,
    pub serial: u8,
    /// The sender's claim was live at the 250: the row's fence and lease were still its.
    pub lease_ok: bool,
    pub fate: Fate,
}

/// Counters of what the properties judge (ghost), each saturating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tally {
    /// A second email of a revision after a 250 on a lease that had run out.
    pub dup_lease_expired: u8,
    /// After a 250 whose `sent` never committed: a crash in between.
    pub dup_crash: u8,
    /// After a 250 that never arrived (an uncertain send retried).
    pub dup_reply_lost: u8,
    /// After a 250 whose record came too late (its fence had moved meanwhile).
    pub dup_record_late: u8,
    /// Any other duplicate: a broken promise.
    pub dup_undocumented: u8,
    /// Completions recorded by a claim that was not the latest.
    pub stale_commits: u8,
    /// Emails accepted before their due time.
    pub early: u8,
    /// Emails of a revision claimed after a cancel covering it committed.
    pub after_cancel: u8,
    /// Emails of a revision whose cancel landed while it was being sent (documented).
    pub cancel_in_flight: u8,
    /// Claims of a revision older than one postie had recorded for the key.
    pub older_claimed: u8,
}

/// The whole system at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub clock: u8,
    pub row: Option<Row>,
    /// `<p>.intake` (the producer's publishes, ladder mode), sorted.
    pub intake: Vec<Job>,
    /// The relay's delivery in hand (recorded scheduled, not yet published and acked).
    pub relay: Option<Job>,
    /// The ladder's queues: a job comes out at its due time, rounded down one step.
    pub ladder: Vec<Job>,
    /// Retry and defer queues: released into `<p>.send` when time passes (their TTL).
    pub retry: Vec<Job>,
    /// `<p>.send`, sorted.
    pub send: Vec<Job>,
    pub workers: Vec<Worker>,
    /// Workers paused (a stop-the-world pause, a frozen VM) while holding a claim, as
    /// a bit set: time passes their lease by. A running worker's lease never runs out
    /// under it: it renews, or its send ends by the deadline first.
    pub paused: u8,
    /// Revisions published by the producer, as a bit set.
    pub published: u8,
    /// The cancel's `covers` once committed.
    pub cancelled: Option<u8>,
    /// The newest revision postie has recorded for the key: given to
    /// `Inbox::schedule_many` by the relay or to `postie_claim` (ghost).
    pub seen: u8,
    /// Faults and failures left to inject.
    pub faults: u8,
    /// Claims so far (the next claim's serial).
    pub claims: u8,
    /// The serial of the latest claim.
    pub latest: u8,
    pub accepts: Vec<Accept>,
    pub tally: Tally,
}

/// Adds `job` to a sorted queue.
pub fn push(queue: &mut Vec<Job>, job: Job) {
    let at = queue.partition_point(|j| *j <= job);
    queue.insert(at, job);
}
