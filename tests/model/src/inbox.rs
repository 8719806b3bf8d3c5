//! The inbox row of one key and the statements that move it, each a Rust mirror of
//! the SQL it names (`sql/schema.sql`, `src/inbox/*.rs`). Time is the model's clock
//! (`clock_timestamp()`), in steps. Mirrored: `postie_claim` and its batch
//! `CLAIM_MANY`, `postie_cancel`, `COMPLETE`, renew, `schedule_many`,
//! `finish_cancelled`.

/// `postie_inbox.status` (`throttled` and `suppressed` are claimable and terminal like
/// `dead`, and reached only by the throttle and the suppression list, which the model
/// leaves out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    Scheduled,
    Sending,
    Sent,
    Retrying,
    Dead,
    Cancelled,
}

impl Status {
    /// The statuses `postie_claim` step ② may claim.
    pub fn claimable(self) -> bool {
        !matches!(self, Status::Sending | Status::Sent)
    }

    /// Where a job ends: nothing moves the row again but a newer revision.
    pub fn terminal(self) -> bool {
        matches!(self, Status::Sent | Status::Dead | Status::Cancelled)
    }
}

/// One row of `postie_inbox`: the columns the protocol reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    pub status: Status,
    /// `owner`: the worker holding the claim while `sending`.
    pub owner: Option<u8>,
    /// `lease_until` (meaningful while `sending`).
    pub lease_until: u8,
    pub fence: u8,
    pub revision: u8,
    pub cancelled_through: Option<u8>,
    /// `due_at` and `body IS NOT NULL` of a scheduled row (the relay's record).
    pub due: u8,
    pub body: bool,
    /// `rescheduled` (sql/0017): the relay recorded a newer revision while `sending`.
    pub rescheduled: bool,
}

impl Row {
    fn new(status: Status, revision: u8) -> Self {
        Row {
            status,
            owner: None,
            lease_until: 0,
            fence: 1,
            revision,
            cancelled_through: None,
            due: 0,
            body: false,
            rescheduled: false,
        }
    }

    fn covered(&self, revision: u8) -> bool {
        self.cancelled_through.is_some_and(|c| revision <= c)
    }

    fn take(&mut self, owner: u8, lease_until: u8, revision: u8) {
        self.status = Status::Sending;
        self.owner = Some(owner);
        self.lease_until = lease_until;
        self.fence += 1;
        self.revision = revision;
        self.rescheduled = false;
    }
}

/// What `postie_claim` answers (`inbox::Claim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    /// `claimed`; `takeover`: `prior_status = 'sending'` (an expired lease).
    Claimed {
        fence: u8,
        takeover: bool,
    },
    Done,
    Cancelled,
    Stale,
    Busy,
}

/// `postie_claim(key, owner, lease, revision)` at `now`: ① a new key, ② one UPDATE of
/// a claimable row, ③ the rest under the row lock.
pub fn postie_claim(row: &mut Option<Row>, owner: u8, lease: u8, revision: u8, now: u8) -> Answer {
    let until = now + lease;
    let Some(r) = row else {
        // ① INSERT … ON CONFLICT DO NOTHING
        let mut new = Row::new(Status::Sending, revision);
        new.owner = Some(owner);
        new.lease_until = until;
        *row = Some(new);
        return Answer::Claimed {
            fence: 1,
            takeover: false,
        };
    };
    // ② status claimable, revision not older, not covered by a cancel.
    if r.status.claimable() && revision >= r.revision && !r.covered(revision) {
        r.take(owner, until, revision);
        return Answer::Claimed {
            fence: r.fence,
            takeover: false,
        };
    }
    // ③ in the order the function checks.
    let live = r.status == Status::Sending && r.lease_until > now;
    if r.status == Status::Sent {
        Answer::Done
    } else if r.covered(revision) && !live {
        Answer::Cancelled
    } else if revision < r.revision {
        Answer::Stale
    } else if r.status.claimable() || (r.status == Status::Sending && r.lease_until <= now) {
        let takeover = r.status == Status::Sending;
        r.take(owner, until, revision);
        Answer::Claimed {
            fence: r.fence,
            takeover,
        }
    } else {
        r.revision = r.revision.max(revision);
        Answer::Busy
    }
}

/// `postie_cancel(key, revision)`: a tombstone for a new key; `sent` and `sending`
/// keep their status and record `cancelled_through`.
pub fn postie_cancel(row: &mut Option<Row>, revision: u8) {
    let Some(r) = row else {
        let mut new = Row::new(Status::Cancelled, revision);
        new.cancelled_through = Some(revision);
        *row = Some(new);
        return;
    };
    r.cancelled_through = Some(r.cancelled_through.map_or(revision, |c| c.max(revision)));
    if !matches!(r.status, Status::Sent | Status::Sending) {
        r.status = Status::Cancelled;
    }
}

/// The completions of `inbox::Completion` as `COMPLETE` records them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Completion {
    Sent,
    Retrying,
    Dead,
}

/// `COMPLETE` (a batch, or one row): `UPDATE … WHERE key = c.key AND fence = c.fence`, the lease
/// released. A `rescheduled` row that was not sent ends `scheduled` for the newer
/// revision, its body kept (sql/0017). True if a row was recorded.
pub fn complete(row: &mut Option<Row>, fence: u8, completion: Completion) -> bool {
    match row {
        Some(r) if r.fence == fence => {
            let waits = r.rescheduled && completion != Completion::Sent;
            r.status = match completion {
                _ if waits => Status::Scheduled,
                Completion::Sent => Status::Sent,
                Completion::Retrying => Status::Retrying,
                Completion::Dead => Status::Dead,
            };
            if completion != Completion::Retrying && !waits {
                r.body = false;
            }
            r.rescheduled = false;
            r.owner = None;
            r.lease_until = 0;
            true
        }
        _ => false,
    }
}

/// `Inbox::renew`: `UPDATE … SET lease_until = now + lease WHERE key AND fence AND
/// status = 'sending'`. True if the claim is still held.
pub fn renew(row: &mut Option<Row>, fence: u8, lease: u8, now: u8) -> bool {
    match row {
        Some(r) if r.fence == fence && r.status == Status::Sending => {
            r.lease_until = now + lease;
            true
        }
        _ => false,
    }
}

/// `Inbox::schedule_many` for one job: inserted, or a `scheduled`, `cancelled` or
/// `retrying` row replaced by a newer or equal revision a cancel does not cover (a
/// `dead` one by a newer revision only); a
/// `sending` row given a newer one keeps `sending` and is marked `rescheduled`
/// (sql/0017).
pub fn schedule(row: &mut Option<Row>, revision: u8, due: u8) {
    let Some(r) = row else {
        let mut new = Row::new(Status::Scheduled, revision);
        new.due = due;
        new.body = true;
        *row = Some(new);
        return;
    };
    let replaceable = matches!(
        r.status,
        Status::Scheduled | Status::Cancelled | Status::Retrying
    );
    let ended = r.status == Status::Dead && revision > r.revision;
    if (replaceable && revision >= r.revision || ended) && !r.covered(revision) {
        r.status = Status::Scheduled;
        r.revision = revision;
        r.due = due;
        r.body = true;
    } else if r.status == Status::Sending && revision > r.revision && !r.covered(revision) {
        r.rescheduled = true;
        r.revision = revision;
        r.due = due;
        r.body = true;
    }
}

/// `Inbox::finish_cancelled` at `now`: a row a cancel covers ends `cancelled` if it is
/// `retrying`, or `sending` under an expired lease (its holder is gone: the fence
/// moves, so a late completion of that holder is refused).
pub fn finish_cancelled(row: &mut Option<Row>, revision: u8, now: u8) {
    if let Some(r) = row {
        let abandoned = r.status == Status::Sending && r.lease_until <= now;
        if (r.status == Status::Retrying || abandoned)
            && r.cancelled_through.is_some_and(|c| c >= revision)
        {
            if abandoned {
                r.fence += 1;
            }
            r.status = Status::Cancelled;
            r.body = false;
            r.owner = None;
            r.lease_until = 0;
        }
    }
}
