//! The lanes' shares of the send rate (issue 33): jobs of every lane wait here, one
//! at a time goes on to take its turn under the send rate and a connection slot,
//! and the next is chosen by start-time fair queueing over the lanes' weights.
//!
//! Each lane has a virtual clock (`pass`) that a job it sends moves on by
//! `1 / weight`; the waiting lane whose clock is least goes next. Two busy lanes of
//! weights 9 and 1 thus send 9 to 1 however deep either backlog is; a lane with
//! nothing waiting takes no share (work-conserving), and one that starts waiting
//! again starts from the clock of the lane served last, not from its own old one,
//! so an idle lane saves no credit to burst with later. Fairness is per instance:
//! every instance applies the same weights to what it holds, so the fleet does too.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::topology::LaneId;

/// The lanes' queue for turns; cheap to clone.
#[derive(Clone)]
pub(crate) struct FairShare {
    state: Arc<Mutex<State>>,
}

struct State {
    /// A job is taking its turn (between [`FairShare::enter`] and its [`Passage`]'s drop).
    busy: bool,
    /// The pass of the lane served last.
    now: f64,
    lanes: Vec<LaneQueue>,
}

struct LaneQueue {
    /// `1 / weight`.
    step: f64,
    pass: f64,
    waiting: VecDeque<oneshot::Sender<()>>,
}

impl State {
    /// Lane `i` is served: the clock moves to its pass, its pass on by its step.
    fn serve(&mut self, i: usize) {
        let lane = &mut self.lanes[i];
        self.now = lane.pass;
        lane.pass += lane.step;
    }

    /// The waiting lane with the least pass (the earlier lane on a tie).
    fn next(&self) -> Option<usize> {
        (0..self.lanes.len())
            .filter(|&i| !self.lanes[i].waiting.is_empty())
            .min_by(|&a, &b| self.lanes[a].pass.total_cmp(&self.lanes[b].pass))
    }
}

/// The right to take a turn now; the next waiting job goes when it is dropped.
pub(crate) struct Passage {
    share: FairShare,
}

impl Drop for Passage {
    fn drop(&mut self) {
        self.share.hand_over();
    }
}

/// A job waiting for its passage; if it gives up after being handed the passage, it
/// hands it on.
struct Waiting {
    answer: Option<oneshot::Receiver<()>>,
    share: FairShare,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut answer) = self.answer.take() {
            answer.close();
            if answer.try_recv().is_ok() {
                self.share.hand_over();
            }
        }
    }
}

impl FairShare {
    /// A queue over lanes of these weights, in [`LaneId`] order.
    pub(crate) fn new(weights: impl IntoIterator<Item = u32>) -> Self {
        let lanes = weights
            .into_iter()
            .map(|weight| LaneQueue {
                step: 1.0 / f64::from(weight.max(1)),
                pass: 0.0,
                waiting: VecDeque::new(),
            })
            .collect();
        Self {
            state: Arc::new(Mutex::new(State {
                busy: false,
                now: 0.0,
                lanes,
            })),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for `lane`'s turn among the waiting lanes; hold the [`Passage`] until the
    /// job has its send-rate turn and its connection slot.
    pub(crate) async fn enter(&self, lane: LaneId) -> Passage {
        let answer = {
            let mut state = self.state();
            let now = state.now;
            let queue = &mut state.lanes[lane.0];
            if queue.waiting.is_empty() {
                // Back from idle: no credit saved up.
                queue.pass = queue.pass.max(now);
            }
            if !state.busy {
                state.busy = true;
                state.serve(lane.0);
                return Passage {
                    share: self.clone(),
                };
            }
            let (tell, answer) = oneshot::channel();
            state.lanes[lane.0].waiting.push_back(tell);
            answer
        };
        let mut waiting = Waiting {
            answer: Some(answer),
            share: self.clone(),
        };
        let answer = waiting.answer.as_mut().expect("set above");
        // The sender is only dropped after a send or by `hand_over`, which sends.
        let _ = answer.await;
        waiting.answer = None;
        Passage {
            share: self.clone(),
        }
    }

    /// The passage goes to the waiting lane with the least pass, or the queue idles.
    fn hand_over(&self) {
        let mut state = self.state();
        while let Some(i) = state.next() {
            let tell = state.lanes[i].waiting.pop_front().expect("waiting");
            if tell.send(()).is_ok() {
                state.serve(i);
                return;
            }
            // That job gave up waiting: the next one.
        }
        state.busy = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Lanes of `weights`, each with `backlog` jobs waiting; the lanes of the first
    /// `served` passages, in order.
    async fn order(weights: &[u32], backlog: usize, served: usize) -> Vec<usize> {
        let share = FairShare::new(weights.iter().copied());
        let first = share.enter(LaneId(0)).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for lane in 0..weights.len() {
            for _ in 0..backlog {
                let (share, tx) = (share.clone(), tx.clone());
                tokio::spawn(async move {
                    let passage = share.enter(LaneId(lane)).await;
                    tx.send(lane).unwrap();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    drop(passage);
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(first);
        let mut lanes = Vec::new();
        while lanes.len() < served {
            lanes.push(rx.recv().await.unwrap());
        }
        lanes
    }

    #[tokio::test]
    async fn busy_lanes_share_by_weight() {
        let lanes = order(&[9, 1], 120, 100).await;
        let bulk: Vec<usize> = (0..lanes.len()).filter(|&i| lanes[i] == 1).collect();
        assert!((10..=11).contains(&bulk.len()), "{lanes:?}");
        // Never starved: the weight-1 lane goes at least once in every ten.
        assert!(bulk[0] < 10, "{lanes:?}");
        assert!(bulk.windows(2).all(|w| w[1] - w[0] <= 11), "{lanes:?}");
    }

    #[tokio::test]
    async fn an_idle_lane_saves_no_credit_and_takes_no_share() {
        let share = FairShare::new([1, 1]);
        // Lane 0 alone for a while: it gets every passage.
        for _ in 0..50 {
            drop(share.enter(LaneId(0)).await);
        }
        // Lane 1 wakes up: it alternates with lane 0 instead of taking 50 in a row.
        let lanes = {
            let first = share.enter(LaneId(0)).await;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            for lane in [1, 1, 1, 1, 0, 0, 0, 0] {
                let (share, tx) = (share.clone(), tx.clone());
                tokio::spawn(async move {
                    let passage = share.enter(LaneId(lane)).await;
                    tx.send(lane).unwrap();
                    drop(passage);
                });
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            drop(first);
            let mut lanes = Vec::new();
            for _ in 0..8 {
                lanes.push(rx.recv().await.unwrap());
            }
            lanes
        };
        let firsts: Vec<usize> = lanes[..4].to_vec();
        assert!(firsts.contains(&0) && firsts.contains(&1), "{lanes:?}");
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_turn_on() {
        let share = FairShare::new([1]);
        let first = share.enter(LaneId(0)).await;
        let quitter = tokio::spawn({
            let share = share.clone();
            async move { share.enter(LaneId(0)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        quitter.abort();
        let _ = quitter.await;
        drop(first);
        let next = tokio::time::timeout(Duration::from_secs(5), share.enter(LaneId(0))).await;
        assert!(
            next.is_ok(),
            "the queue was left busy by a job that gave up"
        );
    }
}
