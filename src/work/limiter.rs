//! The send rate: a fleet-wide limit shared through PostgreSQL (`transport.rate_limit`)
//! and a per-instance adaptive cap (AIMD) driven by the relay's throttle replies.
//!
//! A job takes its turn here before its claim, never after: a waiting job holds no
//! lease and no SMTP connection.
//!
//! - **Fleet limit.** One GCRA row per topology prefix (`inbox::rate`). An instance
//!   reserves a slice of `max(1, rate × 100 ms)` tokens (at most 1,000, at most the
//!   burst) with one statement, waits for the slice's turn, and spends its tokens
//!   one `1 / rate` apart; leftovers expire shortly after their turn, so no
//!   instance saves tokens up. An instance that dies strands at most the one slice
//!   it holds.
//! - **Adaptive cap.** Uncapped until the relay throttles. The first throttle caps
//!   the instance at [`DECREASE`] × the rate it achieved over the last second; each
//!   later throttle multiplies the cap by [`DECREASE`] (at most once per
//!   [`CUT_EVERY`], so one burst of replies counts once); each success adds
//!   `1 / cap`, i.e. about one email per second per second of sending (TCP's AIMD).
//! - **Warm-up.** Under a fleet limit, an instance's first job goes alone: the others
//!   wait (at most [`WARM_UP_MAX`], before taking a token) until its send attempt has
//!   ended. A cold instance's first claim and SMTP connection are slow, and tokens
//!   paced from its first lease would otherwise bunch up behind them at the relay.
//! - **Payback.** Tokens are paced, but a job's claim and SMTP exchange come after
//!   its token: a stall there (a slow commit, a paused process) holds the jobs whose
//!   turns came meanwhile, and they reach the relay together when it ends, on top of
//!   the next second's paced sends. A turn that took longer than the recent
//!   quickest one by more than a step was pushed late; when late turns end within a
//!   step of each other (a bunch, not one slow send), the instance leaves one of its
//!   next tokens unused for each but the first ([`Payback`]), so the relay sees the
//!   limit over any second, not only the tokens.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::SendRate;
use crate::inbox::{DbError, Inbox};
use crate::ops::metrics::SharedMetrics;

/// Multiplicative decrease on a throttle.
pub(crate) const DECREASE: f64 = 0.7;
/// One decrease per this much time at most.
pub(crate) const CUT_EVERY: Duration = Duration::from_millis(1_000);
/// The cap never goes below this (emails per second).
pub(crate) const FLOOR: f64 = 0.5;
/// A slice covers this much of the limit's time.
const SLICE_TIME: f64 = 0.1;
/// Largest slice.
const SLICE_MAX: u32 = 1_000;
/// The longest the jobs after an instance's first wait for its send attempt.
pub(crate) const WARM_UP_MAX: Duration = Duration::from_secs(1);

/// The fleet limit's numbers, from `transport.rate_limit` and `transport.rate_burst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FleetRate {
    /// Emails per second.
    pub(crate) per_second: f64,
    /// Tokens reserved per statement.
    pub(crate) slice: u32,
    /// How far ahead of the steady pace an idle fleet may send (the burst).
    pub(crate) tolerance: Duration,
}

impl FleetRate {
    /// The slice and burst for `per_second` with at most `burst` emails in one second
    /// (default one second's worth: no burst beyond the pace).
    pub(crate) fn new(per_second: f64, burst: Option<u32>) -> Self {
        let one_second = per_second.ceil().max(1.0);
        let burst = burst.map(f64::from).unwrap_or(one_second).max(1.0);
        let slice = (per_second * SLICE_TIME)
            .round()
            .clamp(1.0, f64::from(SLICE_MAX));
        let slice = slice.min(burst) as u32;
        let tolerance = ((burst - one_second).max(0.0) / per_second).min(86_400.0);
        Self {
            per_second,
            slice,
            tolerance: Duration::from_secs_f64(tolerance),
        }
    }
}

/// The tokens of the slice an instance leased last, pure (the clock is passed in):
/// each token's turn one step after the last one's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Slice {
    /// Tokens left.
    left: u32,
    /// The next token's turn.
    next: Option<Instant>,
}

impl Slice {
    /// The next token's turn, if the slice holds one still good at `now`: leftovers
    /// stay good a little after their turn ([`grace`]), not longer, so that an idle
    /// instance does not save tokens up, nor bunch them. `None`: lease a new slice.
    pub(crate) fn take(&mut self, now: Instant, step: Duration) -> Option<Instant> {
        let next = self
            .next
            .filter(|next| self.left > 0 && now <= *next + grace(step))?;
        self.left -= 1;
        self.next = Some(next + step);
        Some(next)
    }

    /// A new slice of `tokens` whose first turn is `start`: that first token taken,
    /// its turn returned.
    pub(crate) fn lease(&mut self, start: Instant, tokens: u32, step: Duration) -> Instant {
        self.left = tokens.saturating_sub(1);
        self.next = Some(start + step);
        start
    }
}

/// How long a leftover token stays good after its turn: one step, at least 20 ms (a
/// job may come late, at 2,000/s by more than a step).
pub(crate) fn grace(step: Duration) -> Duration {
    step.max(Duration::from_millis(20))
}

/// The adaptive cap (AIMD), pure: fed throttles and successes, asked for the cap.
#[derive(Debug, Default)]
pub(crate) struct Aimd {
    cap: Option<f64>,
    last_cut: Option<Instant>,
    recent: VecDeque<Instant>,
}

impl Aimd {
    /// The cap in emails per second, or None while uncapped.
    pub(crate) fn cap(&self) -> Option<f64> {
        self.cap
    }

    /// A send succeeded at `now`.
    pub(crate) fn on_success(&mut self, now: Instant) {
        self.recent.push_back(now);
        self.forget(now);
        if let Some(cap) = self.cap {
            self.cap = Some(cap + 1.0 / cap);
        }
    }

    /// The relay throttled a send at `now`: true if the cap was cut.
    pub(crate) fn on_throttle(&mut self, now: Instant) -> bool {
        if self
            .last_cut
            .is_some_and(|at| now.duration_since(at) < CUT_EVERY)
        {
            return false;
        }
        self.forget(now);
        let base = self.cap.unwrap_or(self.recent.len() as f64);
        self.cap = Some((base * DECREASE).max(FLOOR));
        self.last_cut = Some(now);
        true
    }

    fn forget(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|at| now.duration_since(*at) > Duration::from_secs(1))
        {
            self.recent.pop_front();
        }
    }
}

/// How many recent turns the quickest one is taken from.
const RECENT_TURNS: usize = 16;

/// The sends pushed late, to pay back with unused tokens; pure.
#[derive(Debug, Default)]
pub(crate) struct Payback {
    /// How long the last few turns took, from their token's turn to the end of the
    /// send attempt.
    recent: VecDeque<Duration>,
    /// Tokens still to leave unused.
    debt: u32,
    /// When the last late turn ended.
    last_late: Option<Instant>,
}

impl Payback {
    /// A turn ended at `now`, `took` after its token's turn, under a limit of one
    /// token per `step`; at most `cap` tokens are ever owed.
    pub(crate) fn ended(&mut self, now: Instant, took: Duration, step: Duration, cap: u32) {
        let quickest = self.recent.iter().min().copied();
        if self.recent.len() == RECENT_TURNS {
            self.recent.pop_front();
        }
        self.recent.push_back(took);
        let slack = step.max(Duration::from_millis(20));
        if quickest.is_none_or(|q| took <= q + slack) {
            return;
        }
        if self
            .last_late
            .is_some_and(|at| now.saturating_duration_since(at) <= slack)
        {
            self.debt = (self.debt + 1).min(cap);
        }
        self.last_late = Some(now);
    }

    /// True (and one less owed) if the next token must go unused.
    pub(crate) fn owe(&mut self) -> bool {
        let owed = self.debt > 0;
        self.debt = self.debt.saturating_sub(u32::from(owed));
        owed
    }
}

struct Fleet {
    inbox: Inbox,
    name: String,
    rate: FleetRate,
    /// The tokens left of the slice this instance leased last.
    left: tokio::sync::Mutex<Slice>,
    payback: Mutex<Payback>,
}

struct Inner {
    fleet: Option<Fleet>,
    /// Set when the first fleet token is handed out.
    first_taken: AtomicBool,
    /// True once the first token's job is past its send attempt.
    warm: tokio::sync::watch::Sender<bool>,
    aimd: Mutex<Aimd>,
    /// The next time the adaptive cap lets a send go (a fair queue: tokio's Mutex).
    pace: tokio::sync::Mutex<Instant>,
    metrics: SharedMetrics,
}

/// A fleet token in use, to keep until the job's send attempt has ended: dropped,
/// it tells the limiter how long the turn took (see "Payback"), and the
/// instance's first one ends the warm-up.
#[must_use = "keep the turn until the send attempt has ended"]
pub struct Turn(Option<TurnOf>);

struct TurnOf {
    inner: Arc<Inner>,
    /// The token's turn.
    at: Instant,
    /// The instance's first token.
    first: bool,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(turn) = self.0.take() else {
            return;
        };
        if let Some(fleet) = &turn.inner.fleet {
            let step = Duration::from_secs_f64(1.0 / fleet.rate.per_second);
            let cap = fleet.rate.per_second.ceil() as u32;
            let now = Instant::now();
            fleet.payback().ended(
                now,
                now.saturating_duration_since(turn.at),
                step,
                cap.max(1),
            );
        }
        if turn.first {
            turn.inner.warm.send_replace(true);
        }
    }
}

impl Fleet {
    fn payback(&self) -> std::sync::MutexGuard<'_, Payback> {
        self.payback.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The send-rate gate; cheap to clone.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl Limiter {
    /// The limiter of one transport: `rate` (with `burst`) fleet-wide, shared as the
    /// fleet limit `name` (the topology prefix, or `prefix/provider` with several
    /// transports) through `inbox`. The primary's limit is the one the
    /// `rate_limit_per_second` gauge shows.
    pub fn new(
        rate: Option<SendRate>,
        burst: Option<u32>,
        inbox: Inbox,
        name: &str,
        metrics: SharedMetrics,
        primary: bool,
    ) -> Self {
        let fleet = rate.map(|rate| Fleet {
            inbox,
            name: name.to_string(),
            rate: FleetRate::new(rate.per_second(), burst),
            left: tokio::sync::Mutex::new(Slice::default()),
            payback: Mutex::new(Payback::default()),
        });
        if primary {
            metrics
                .rate
                .limit
                .set(fleet.as_ref().map_or(0.0, |f| f.rate.per_second));
        }
        Self {
            inner: Arc::new(Inner {
                fleet,
                first_taken: AtomicBool::new(false),
                warm: tokio::sync::watch::Sender::new(false),
                aimd: Mutex::new(Aimd::default()),
                pace: tokio::sync::Mutex::new(Instant::now()),
                metrics,
            }),
        }
    }

    /// Waits for this instance's adaptive cap to let one send go.
    pub async fn pace(&self) {
        let started = Instant::now();
        let mut next = self.inner.pace.lock().await;
        loop {
            let now = Instant::now();
            let Some(cap) = self.aimd().cap() else {
                *next = now;
                break;
            };
            if now >= *next {
                *next = now + Duration::from_secs_f64(1.0 / cap);
                break;
            }
            let at = *next;
            tokio::time::sleep_until(at.into()).await;
        }
        drop(next);
        self.observe_wait(started);
    }

    /// Takes one token of the fleet limit (if one is set), leasing a new slice from
    /// PostgreSQL when this instance's is used up, and waiting for its turn. The
    /// tokens of a slice are spread over its span, so the fleet sends at an even pace.
    /// Keep the [`Turn`] until the job's send attempt has ended (see "Warm-up").
    pub async fn fleet_token(&self) -> Result<Turn, DbError> {
        let Some(fleet) = &self.inner.fleet else {
            return Ok(Turn(None));
        };
        let started = Instant::now();
        let first = !self.inner.first_taken.swap(true, Ordering::AcqRel);
        if !first {
            let mut warm = self.inner.warm.subscribe();
            let _ = tokio::time::timeout(WARM_UP_MAX, warm.wait_for(|w| *w)).await;
        }
        let rate = fleet.rate;
        let step = Duration::from_secs_f64(1.0 / rate.per_second);
        let mut slice = fleet.left.lock().await;
        let turn = loop {
            let turn = match slice.take(Instant::now(), step) {
                Some(turn) => turn,
                None => {
                    let wait = fleet
                        .inbox
                        .lease_tokens(&fleet.name, rate.slice, rate.per_second, rate.tolerance)
                        .await?;
                    let metrics = &self.inner.metrics.rate;
                    metrics.leases.inc();
                    metrics.tokens.inc_by(u64::from(rate.slice));
                    slice.lease(Instant::now() + wait, rate.slice, step)
                }
            };
            tokio::time::sleep_until(turn.into()).await;
            if !fleet.payback().owe() {
                break turn;
            }
            self.inner.metrics.rate.tokens_paid_back.inc();
        };
        drop(slice);
        self.observe_wait(started);
        Ok(Turn(Some(TurnOf {
            inner: self.inner.clone(),
            at: turn,
            first,
        })))
    }

    /// A send succeeded.
    pub(crate) fn sent(&self) {
        let mut aimd = self.aimd();
        aimd.on_success(Instant::now());
        self.publish(aimd.cap());
    }

    /// The relay throttled a send.
    pub(crate) fn throttled(&self) {
        self.inner.metrics.rate.throttle_replies.inc();
        let mut aimd = self.aimd();
        if aimd.on_throttle(Instant::now()) {
            let cap = aimd.cap();
            tracing::info!(cap = ?cap, "the relay throttles: send rate cut");
            self.publish(cap);
        }
    }

    fn publish(&self, cap: Option<f64>) {
        self.inner.metrics.rate.adaptive.set(cap.unwrap_or(0.0));
    }

    fn observe_wait(&self, started: Instant) {
        self.inner
            .metrics
            .rate
            .wait_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    fn aimd(&self) -> std::sync::MutexGuard<'_, Aimd> {
        self.inner.aimd.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_a_tenth_of_a_second_within_bounds() {
        let r = FleetRate::new(30.0, None);
        assert_eq!((r.slice, r.tolerance), (3, Duration::ZERO));
        assert_eq!(FleetRate::new(2_000.0, None).slice, 200);
        assert_eq!(FleetRate::new(100_000.0, None).slice, SLICE_MAX);
        assert_eq!(FleetRate::new(1.0, None).slice, 1);
        assert_eq!(FleetRate::new(10.0 / 60.0, None).slice, 1);
        // The slice never exceeds the burst.
        assert_eq!(FleetRate::new(2_000.0, Some(50)).slice, 50);
        // A burst above one second's worth lets an idle fleet run ahead by the rest.
        let b = FleetRate::new(10.0, Some(30));
        assert_eq!(b.tolerance, Duration::from_secs(2));
        // Below 1/s: one email in any second, no run-ahead.
        assert_eq!(FleetRate::new(0.25, None).tolerance, Duration::ZERO);
    }

    #[test]
    fn sends_pushed_together_by_a_stall_are_paid_back_one_token_each() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let step = ms(33);
        let owed = |p: &mut Payback| std::iter::from_fn(|| p.owe().then_some(())).count();
        let mut p = Payback::default();
        // Turns of 10-40 ms, one per step: the usual jitter, nothing owed.
        for (i, took) in [10, 25, 12, 30, 11, 40].into_iter().enumerate() {
            p.ended(t0 + ms(33 * i as u64), ms(took), step, 30);
        }
        assert_eq!(owed(&mut p), 0, "within a step of the quickest turn");
        // Slow turns far apart (one slow send each time) bunch nothing up.
        for i in 0..5 {
            p.ended(t0 + ms(1_000 + 500 * i), ms(120), step, 30);
        }
        assert_eq!(owed(&mut p), 0, "isolated slow turns");
        // A 200 ms stall: the six turns caught in it end together when it ends; the
        // first is one send, the five after it are the bunch.
        let end = t0 + ms(5_000);
        for (i, took) in [210, 180, 150, 115, 80, 50].into_iter().enumerate() {
            p.ended(end + ms(i as u64), ms(took), step, 30);
        }
        assert_eq!(owed(&mut p), 5);
        assert!(!p.owe());
        // Never more than `cap` owed.
        for i in 0..10 {
            p.ended(end + ms(1_000 + i), ms(500), step, 4);
        }
        assert_eq!(owed(&mut p), 4);
        // The quickest turn is a recent one: a relay that became slower for good
        // stops counting as late once the fast turns are forgotten.
        let mut slow = Payback::default();
        for i in 0..(RECENT_TURNS as u64 + 10) {
            slow.ended(t0 + ms(i), ms(300 + i), step, 30);
        }
        assert_eq!(owed(&mut slow), 0);
    }

    #[test]
    fn aimd_cuts_from_the_achieved_rate_then_adds_one_per_second() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut a = Aimd::default();
        // 20 sends in the last second, uncapped.
        for i in 0..20 {
            a.on_success(ms(i * 50));
        }
        assert_eq!(a.cap(), None, "no cap until the relay throttles");
        assert!(a.on_throttle(ms(1_000)));
        assert_eq!(a.cap(), Some(20.0 * DECREASE));
        // A burst of throttles counts once.
        assert!(!a.on_throttle(ms(1_100)));
        assert_eq!(a.cap(), Some(14.0));
        // One second of successes at the cap adds about one per second.
        for i in 0..14 {
            a.on_success(ms(1_100 + i * 70));
        }
        let cap = a.cap().unwrap();
        assert!((14.9..15.1).contains(&cap), "{cap}");
        // The next throttle cuts the cap itself.
        assert!(a.on_throttle(ms(2_200)));
        assert!((cap * DECREASE - a.cap().unwrap()).abs() < 1e-9);
        // Never below the floor.
        for i in 0..40 {
            a.on_throttle(ms(3_000 + i * 1_000));
        }
        assert_eq!(a.cap(), Some(FLOOR));
    }

    #[test]
    fn a_slice_spreads_its_tokens_one_step_apart_and_expires_leftovers() {
        let t0 = Instant::now();
        let step = Duration::from_millis(100);
        let ms = Duration::from_millis;
        let mut slice = Slice::default();
        assert_eq!(slice.take(t0, step), None, "nothing leased yet");
        // A slice of 3 whose turn starts 50 ms from now: the first token's turn is
        // the start, the next two one step apart, whenever they are asked for.
        assert_eq!(slice.lease(t0 + ms(50), 3, step), t0 + ms(50));
        assert_eq!(slice.take(t0 + ms(60), step), Some(t0 + ms(150)));
        assert_eq!(slice.take(t0 + ms(61), step), Some(t0 + ms(250)));
        assert_eq!(slice.take(t0 + ms(62), step), None, "used up");
        // Leftovers are good until a grace after their turn, then gone.
        let mut slice = Slice::default();
        slice.lease(t0, 5, step);
        assert_eq!(slice.take(t0 + ms(200), step), Some(t0 + ms(100)));
        assert_eq!(
            slice.take(t0 + ms(301), step),
            None,
            "a turn at 200 ms, good to 300 ms"
        );
        // At 2,000/s a step is half a millisecond; the grace is still 20 ms.
        let fast = Duration::from_micros(500);
        assert_eq!(grace(fast), ms(20));
        let mut slice = Slice::default();
        slice.lease(t0, 2, fast);
        assert_eq!(slice.take(t0 + ms(20), fast), Some(t0 + fast));
    }
}
