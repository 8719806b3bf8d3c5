//! Coalesced acknowledgements for one consuming channel.
//!
//! Every finished delivery used to be acked on its own: one frame from postie, and
//! in a quorum queue one settle command through the Raft log, per email. Here the
//! handlers only report "delivery `tag` is done" and one task per channel acks on
//! their behalf:
//!
//! - the run of consecutive finished tags from the lowest unacked one is acked with
//!   a single `multiple` ack (delivery tags on a channel count up from 1 with every
//!   delivery, so the run covers exactly the deliveries that are finished);
//! - a finished tag behind a gap (an earlier delivery still in work, say a slow SMTP
//!   send) is acked on its own once it has waited [`LINGER`], so one slow delivery
//!   never holds the prefetch window full of finished ones.
//!
//! The rule "no ack before the outcome is durable" is untouched: a tag is reported
//! only after its outcome is recorded (and republished, if it has to be). An ack
//! that is held and then lost with the channel is a redelivery, which the inbox
//! suppresses.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lapin::options::BasicAckOptions;
use lapin::Channel;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a finished tag may wait for the acks before it to finish.
pub(crate) const LINGER: Duration = Duration::from_millis(25);
/// How long a run of finished tags may wait to grow before it is acked.
const BATCH_WAIT: Duration = Duration::from_millis(2);
/// A run this long is acked at once.
const BATCH_MAX: usize = 64;

/// Reports finished deliveries to the channel's ack task.
#[derive(Clone)]
pub(crate) struct Acks {
    done: mpsc::UnboundedSender<u64>,
}

/// The ack task of one channel; [`AckTask::finish`] acks what is left and ends it.
pub(crate) struct AckTask {
    handle: JoinHandle<()>,
}

impl Acks {
    /// Starts the ack task for `channel`.
    pub(crate) fn start(channel: Channel) -> (Self, AckTask) {
        let (done, rx) = mpsc::unbounded_channel();
        let handle = tokio::spawn(run(channel, rx));
        (Self { done }, AckTask { handle })
    }

    /// Delivery `tag` is finished and may be acked.
    pub(crate) fn done(&self, tag: u64) {
        // The task ends only after every sender is gone.
        let _ = self.done.send(tag);
    }
}

impl AckTask {
    /// Waits (at most `limit`) for the acks of every finished delivery to be sent.
    /// Every [`Acks`] handle must have been dropped first.
    pub(crate) async fn finish(self, limit: Duration) {
        let mut handle = self.handle;
        if tokio::time::timeout(limit, &mut handle).await.is_err() {
            handle.abort();
        }
    }
}

/// What the ack task knows: finished tags not yet acked, and tags acked on their own.
#[derive(Debug, Default)]
struct Ledger {
    /// The lowest tag not acked yet (tags start at 1).
    low: u64,
    /// Finished, not acked, with when they were reported.
    finished: BTreeMap<u64, Instant>,
    /// Acked on their own, above `low`.
    singles: BTreeSet<u64>,
}

/// The acks to send now: at most one `multiple` ack, then single ones.
#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    multiple: Option<u64>,
    singles: Vec<u64>,
}

impl Ledger {
    fn new() -> Self {
        Self {
            low: 1,
            ..Self::default()
        }
    }

    fn finish(&mut self, tag: u64, at: Instant) {
        if tag >= self.low && !self.singles.contains(&tag) {
            self.finished.insert(tag, at);
        }
    }

    /// Consecutive finished tags from `low` (none acked yet), ready to go.
    fn run_len(&self) -> usize {
        let mut next = self.low;
        let mut n = 0;
        loop {
            if self.finished.contains_key(&next) {
                n += 1;
            } else if !self.singles.contains(&next) {
                return n;
            }
            next += 1;
        }
    }

    /// The acks due at `now`. A `multiple` ack names the highest finished tag of the
    /// run from `low` that was not acked on its own (acking a tag twice is a channel
    /// error); tags behind a gap go singly once they have lingered.
    fn plan(&mut self, now: Instant, linger: Duration) -> Plan {
        let mut plan = Plan::default();
        loop {
            if self.finished.remove(&self.low).is_some() {
                plan.multiple = Some(self.low);
            } else if !self.singles.remove(&self.low) {
                break;
            }
            self.low += 1;
        }
        let overdue: Vec<u64> = self
            .finished
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= linger)
            .map(|(tag, _)| *tag)
            .collect();
        for tag in overdue {
            self.finished.remove(&tag);
            self.singles.insert(tag);
            plan.singles.push(tag);
        }
        plan
    }

    /// When the oldest tag behind a gap must go, if any is waiting.
    fn next_deadline(&self, linger: Duration) -> Option<Instant> {
        self.finished.values().min().map(|at| *at + linger)
    }
}

async fn run(channel: Channel, mut rx: mpsc::UnboundedReceiver<u64>) {
    let mut ledger = Ledger::new();
    let mut open = true;
    while open {
        // Wait for a report, or for a lingering tag's deadline.
        let deadline = ledger.next_deadline(LINGER);
        tokio::select! {
            tag = rx.recv() => match tag {
                Some(tag) => ledger.finish(tag, Instant::now()),
                None => open = false,
            },
            _ = sleep_until(deadline) => {}
        }
        if open {
            // Let the run grow a little: reports arrive in bursts.
            let until = Instant::now() + BATCH_WAIT;
            while ledger.run_len() < BATCH_MAX {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(tag)) => ledger.finish(tag, Instant::now()),
                    Ok(None) => {
                        open = false;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        // Closing: everything reported goes now.
        let linger = if open { LINGER } else { Duration::ZERO };
        let plan = ledger.plan(Instant::now(), linger);
        if !send(&channel, &plan).await {
            tracing::warn!(
                "acks not delivered (channel gone); the broker will redeliver and the inbox will suppress them"
            );
            return;
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends the planned acks; false if the channel refused them.
async fn send(channel: &Channel, plan: &Plan) -> bool {
    let multiple = plan.multiple.map(|tag| (tag, true));
    let singles = plan.singles.iter().map(|&tag| (tag, false));
    for (tag, multiple) in multiple.into_iter().chain(singles) {
        let options = BasicAckOptions { multiple };
        if channel.basic_ack(tag, options).await.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINGER: Duration = Duration::from_millis(25);

    #[test]
    fn a_run_from_the_lowest_tag_is_one_multiple_ack() {
        let now = Instant::now();
        let mut ledger = Ledger::new();
        for tag in [3, 1, 2] {
            ledger.finish(tag, now);
        }
        assert_eq!(ledger.run_len(), 3);
        assert_eq!(
            ledger.plan(now, LINGER),
            Plan {
                multiple: Some(3),
                singles: vec![]
            }
        );
        assert_eq!(ledger.low, 4);
    }

    #[test]
    fn tags_behind_a_gap_wait_then_go_singly_and_are_never_acked_twice() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new();
        ledger.finish(1, t0);
        ledger.finish(3, t0);
        ledger.finish(4, t0);
        // 2 is still in work: only 1 goes, 3 and 4 wait.
        assert_eq!(
            ledger.plan(t0, LINGER),
            Plan {
                multiple: Some(1),
                singles: vec![]
            }
        );
        // Past the linger, 3 and 4 go on their own.
        let later = t0 + LINGER;
        assert_eq!(
            ledger.plan(later, LINGER),
            Plan {
                multiple: None,
                singles: vec![3, 4]
            }
        );
        // 2 finishes, then 5: the multiple ack names 5, not 4 (already acked).
        ledger.finish(2, later);
        ledger.finish(5, later);
        assert_eq!(
            ledger.plan(later, LINGER),
            Plan {
                multiple: Some(5),
                singles: vec![]
            }
        );
        assert_eq!(ledger.low, 6);
        assert!(ledger.singles.is_empty());
    }

    #[test]
    fn a_run_ending_in_single_acks_names_its_last_unacked_tag() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new();
        ledger.finish(2, t0);
        assert_eq!(ledger.plan(t0 + LINGER, LINGER).singles, vec![2]);
        ledger.finish(1, t0 + LINGER);
        // 1 is the only unacked tag of the run 1..=2.
        assert_eq!(
            ledger.plan(t0 + LINGER, LINGER),
            Plan {
                multiple: Some(1),
                singles: vec![]
            }
        );
        assert_eq!(ledger.low, 3);
    }

    #[test]
    fn a_tag_reported_twice_or_below_low_is_ignored() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new();
        ledger.finish(1, t0);
        assert_eq!(ledger.plan(t0, LINGER).multiple, Some(1));
        ledger.finish(1, t0);
        assert_eq!(ledger.plan(t0, LINGER), Plan::default());
    }

    #[test]
    fn deadline_is_the_oldest_waiting_tag_plus_linger() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new();
        assert_eq!(ledger.next_deadline(LINGER), None);
        ledger.finish(3, t0);
        ledger.finish(4, t0 + Duration::from_millis(5));
        assert_eq!(ledger.next_deadline(LINGER), Some(t0 + LINGER));
    }
}
