//! Keeping a claim alive while it is held. A send starts only with at least its send
//! deadline ([`crate::mail::Mailer::deadline_for`]) left on its lease, renewing it first if
//! not; while the send runs, and while its outcome is recorded, the lease is renewed
//! every third of `worker.lease`. An email whose attachments make its deadline longer
//! than `worker.lease` has its lease renewed for that deadline instead, every third
//! of it: the send still ends before the lease it started with, renewed or not. A
//! renewal that finds the claim gone withdraws the send's [`Clearance`]: a send that
//! has not started `DATA` stops there.
//!
//! So a lease cannot run out under a send unnoticed: the send ends (deadline) before
//! the lease it started with, renewed or not, and the one duplicate window stays
//! "the relay's 250 received, `sent` not committed" (a renewal that cannot reach
//! PostgreSQL while the record waits on it is that window).

use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, Instant};

use super::{Stop, Worker};
use crate::mail::Clearance;

/// Longest pause between tries when a renewal fails for want of PostgreSQL.
const RENEW_RETRY: Duration = Duration::from_secs(1);

/// A claim this instance holds.
pub(super) struct Held {
    /// Its fencing token.
    pub(super) fence: i64,
    /// When its lease runs out by this instance's clock, measured from before the
    /// statement that set it (so never later than the database's).
    expires: Instant,
    /// Withdrawn once a renewal finds the claim gone.
    pub(super) clearance: Clearance,
    /// How long each renewal makes it: `worker.lease`, or a longer send's deadline.
    lease: Duration,
}

impl Held {
    /// A claim taken under `fence` by a statement sent at `asked`, for `lease`.
    pub(super) fn new(fence: i64, asked: Instant, lease: Duration) -> Self {
        Self {
            fence,
            expires: asked + lease,
            clearance: Clearance::new(),
            lease,
        }
    }
}

impl Worker {
    /// Renews the lease now if less than `deadline` (the send's) is left on it, for
    /// `worker.lease` or, if the deadline is longer, for the deadline (and so every
    /// renewal after). `false`: the claim is gone (and the clearance withdrawn).
    pub(super) async fn lease_for_send(
        &self,
        key: &str,
        held: &mut Held,
        deadline: Duration,
    ) -> Result<bool, Stop> {
        held.lease = held.lease.max(deadline);
        let left = held.expires.saturating_duration_since(Instant::now());
        if left >= deadline {
            return Ok(true);
        }
        let lease = held.lease;
        let asked = Instant::now();
        let kept = self
            .db("renew lease", || {
                self.cx.inbox.renew(key, held.fence, lease)
            })
            .await?;
        if kept {
            held.expires = asked + lease;
        } else {
            held.clearance.withdraw();
        }
        Ok(kept)
    }

    /// Runs `work` while the claim `held` is renewed every third of the lease.
    pub(super) async fn holding<T>(
        &self,
        key: &str,
        held: &Held,
        work: impl Future<Output = T>,
    ) -> T {
        tokio::select! {
            done = work => done,
            never = self.keep_lease(key, held) => match never {},
        }
    }

    /// Renews the claim every third of the lease, forever; withdraws its clearance
    /// once a renewal finds it gone.
    async fn keep_lease(&self, key: &str, held: &Held) -> Infallible {
        let lease = held.lease;
        let mut wait = lease / 3;
        loop {
            tokio::time::sleep(wait).await;
            wait = lease / 3;
            match self.cx.inbox.renew(key, held.fence, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(
                        key,
                        fence = held.fence,
                        "the claim was lost while held: the send stops before DATA"
                    );
                    held.clearance.withdraw();
                    return std::future::pending().await;
                }
                Err(error) => {
                    tracing::warn!(%error, key, "could not renew the claim's lease; trying again");
                    wait = wait.min(RENEW_RETRY);
                }
            }
        }
    }
}
