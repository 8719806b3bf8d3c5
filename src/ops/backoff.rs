//! The one retry idiom of every loop that waits on a dependency (the broker session,
//! a publish, a database step, the SMTP prober): capped exponential backoff with
//! jitter, reset only after a success that held.
//!
//! Each failure waits a random time in `[d/2, d]` (the delay `d` doubles from `first`
//! up to `cap`): the half floor keeps the spacing growing, the random half keeps a
//! fleet that lost the same dependency at the same moment from retrying in step.
//! What counts as a success that held is the loop's to say: a database statement
//! that answered, a confirmed publish, or a broker session that stood for at least
//! the cap ([`Backoff::ran_for`]) — a session that opens and then fails at once (a
//! broker that accepts connections but refuses the declaration) is a failure.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Capped exponential backoff with jitter; one per retry loop.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `first` (at most `cap`) and doubles up to `cap`.
    pub(crate) fn new(first: Duration, cap: Duration) -> Self {
        let first = first.min(cap);
        Self {
            first,
            cap,
            next: first,
        }
    }

    /// A failure: the time to wait before the next attempt (random in `[d/2, d]`),
    /// and `d` doubled for the one after, up to the cap.
    pub(crate) fn failed(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.cap);
        jittered(d)
    }

    /// A success that held: the next failure waits from `first` again.
    pub(crate) fn succeeded(&mut self) {
        self.next = self.first;
    }

    /// Something that was up for `lasted` ended: a success that held if it stood for
    /// at least the cap, otherwise the backoff keeps growing.
    pub(crate) fn ran_for(&mut self, lasted: Duration) {
        if lasted >= self.cap {
            self.succeeded();
        }
    }

    /// The wait the next failure starts from (before jitter).
    #[cfg(test)]
    pub(crate) fn current(&self) -> Duration {
        self.next
    }

    /// Waits out a failure; false if `stop` was cancelled first.
    pub(crate) async fn wait(&mut self, stop: &CancellationToken) -> bool {
        let wait = self.failed();
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(wait) => true,
        }
    }
}

/// A random time in `[d/2, d]`.
fn jittered(d: Duration) -> Duration {
    let half = d / 2;
    let span = (d - half).as_micros() as u64;
    let random = uuid::Uuid::new_v4().as_u128() as u64;
    half + Duration::from_micros(random % (span + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_doubles_to_the_cap_with_jitter_in_the_upper_half() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut expected = Duration::from_millis(100);
        for _ in 0..10 {
            let wait = backoff.failed();
            assert!(
                wait >= expected / 2 && wait <= expected,
                "{wait:?} vs {expected:?}"
            );
            expected = (expected * 2).min(Duration::from_secs(2));
        }
        assert_eq!(backoff.current(), Duration::from_secs(2));
    }

    #[test]
    fn the_waits_differ_between_loops() {
        let waits: std::collections::BTreeSet<_> = (0..20)
            .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).failed())
            .collect();
        assert!(waits.len() > 1, "no jitter: {waits:?}");
    }

    #[test]
    fn only_a_success_that_held_resets_it() {
        let cap = Duration::from_secs(4);
        let mut backoff = Backoff::new(Duration::from_millis(200), cap);
        for _ in 0..5 {
            backoff.failed();
        }
        assert_eq!(backoff.current(), cap);
        backoff.ran_for(Duration::from_millis(50)); // up, then failed at once
        assert_eq!(backoff.current(), cap);
        backoff.ran_for(cap);
        assert_eq!(backoff.current(), Duration::from_millis(200));
        backoff.failed();
        backoff.succeeded();
        assert_eq!(backoff.current(), Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait() {
        let stop = CancellationToken::new();
        let mut backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
        stop.cancel();
        assert!(!backoff.wait(&stop).await);
    }
}
