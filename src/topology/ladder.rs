//! Ladder mode's delays: the binary decomposition of the remaining delay into a
//! cascade of TTL queues, in the manner of NServiceBus's delayed delivery v2.
//!
//! The ladder has `levels` topic exchanges and quorum queues, `<p>.delay.<k>`; queue
//! `k` holds a message for `resolution × 2^k`. A routing key spells the remaining delay
//! in binary, most significant bit first, then `email`: `1.0.1.email` is 5 units with
//! three levels. Exchange `k` sends bit `k` = 1 to queue `k` (whose TTL then expires
//! it onward to exchange `k-1`), and bit `k` = 0 straight to exchange `k-1`. Below
//! level 0 is the work queue. So a job makes at most `levels` hops, all inside the
//! broker, and only the set bits cost any waiting.
//!
//! The ladder rounds down to whole units; the worker holds the last sub-unit rest
//! (see `HEADER_DUE_AT`) so that no email ever leaves before its due time.
//!
//! RabbitMQ cannot hold a TTL above 2^32-1 ms (Erlang timers), so no level's TTL
//! exceeds it. A delay longer than one pass through the ladder can spell (77 days
//! at the default 100 ms unit) takes several passes: the worker finds the job early,
//! sends it back to the intake, and the relay routes what is left.

use std::time::Duration;

use crate::contract::PLUGIN_MAX_DELAY;

/// Where the relay sends a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// Due within one unit: straight to the work exchange.
    Now,
    /// Into the ladder: `units` whole units, spelled as `routing_key`.
    Ladder {
        /// Whole units of delay.
        units: u64,
        /// Binary routing key, MSB first, ending in `.email`.
        routing_key: String,
    },
}

/// The shape of the cascade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ladder {
    resolution_ms: u64,
    levels: u32,
}

impl Ladder {
    /// Enough levels to spell `max` in units of `resolution` in one pass, but no
    /// level whose TTL RabbitMQ cannot hold (longer delays take several passes).
    pub(crate) fn new(resolution: Duration, max: Duration) -> Self {
        let resolution_ms = resolution.as_millis().max(1) as u64;
        let max_units = (max.as_millis() as u64).div_ceil(resolution_ms).max(1);
        let needed = 64 - max_units.leading_zeros();
        let ttl_limit_units = (PLUGIN_MAX_DELAY.as_millis() as u64 / resolution_ms).max(1);
        let allowed = 64 - ttl_limit_units.leading_zeros(); // top TTL = 2^(allowed-1) units
        Self {
            resolution_ms,
            levels: needed.min(allowed),
        }
    }

    /// Number of levels (queues and exchanges).
    pub fn levels(&self) -> u32 {
        self.levels
    }

    /// The unit.
    pub fn resolution(&self) -> Duration {
        Duration::from_millis(self.resolution_ms)
    }

    /// The longest delay one pass through the ladder can spell.
    pub fn max_delay(&self) -> Duration {
        Duration::from_millis(((1u64 << self.levels) - 1) * self.resolution_ms)
    }

    /// TTL of level `k`'s queue.
    pub fn ttl(&self, k: u32) -> Duration {
        Duration::from_millis(self.resolution_ms << k)
    }

    /// The route for a job due in `remaining_ms` (rounded down to whole units; the
    /// worker waits out the rest).
    pub(crate) fn route(&self, remaining_ms: i64) -> Route {
        let units =
            (remaining_ms.max(0) as u64 / self.resolution_ms).min((1u64 << self.levels) - 1);
        if units == 0 {
            return Route::Now;
        }
        Route::Ladder {
            units,
            routing_key: self.routing_key(units),
        }
    }

    /// `units` in binary over all levels, MSB first, dot-separated, then `.email`.
    pub(crate) fn routing_key(&self, units: u64) -> String {
        let mut key = String::with_capacity(self.levels as usize * 2 + 6);
        for k in (0..self.levels).rev() {
            key.push(if units >> k & 1 == 1 { '1' } else { '0' });
            key.push('.');
        }
        key.push_str(super::ROUTING_KEY);
        key
    }

    /// The topic pattern at exchange `k` matching bit `k` = `bit`.
    pub fn pattern(&self, k: u32, bit: bool) -> String {
        let skip = (self.levels - 1 - k) as usize;
        format!("{}{}.#", "*.".repeat(skip), if bit { '1' } else { '0' })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn levels_cover_the_maximum_but_no_ttl_exceeds_what_rabbitmq_holds() {
        let ladder = Ladder::new(Duration::from_secs(1), Duration::from_secs(30 * 86_400));
        assert_eq!(ladder.levels(), 22); // 2^22 s > 30 days
        assert!(ladder.max_delay() >= Duration::from_secs(30 * 86_400));
        for (resolution_ms, max_days) in [(100, 366), (1000, 366), (1, 10), (5000, 3650)] {
            let ladder = Ladder::new(
                Duration::from_millis(resolution_ms),
                Duration::from_secs(max_days * 86_400),
            );
            let top = ladder.ttl(ladder.levels() - 1);
            assert!(
                top <= PLUGIN_MAX_DELAY,
                "{resolution_ms} ms: top TTL {top:?}"
            );
            // One more level would not fit.
            assert!(
                ladder.max_delay() >= Duration::from_secs(max_days * 86_400)
                    || top * 2 > PLUGIN_MAX_DELAY
            );
        }
        // A year at 100 ms takes several passes of 26 levels (77 days each).
        let ladder = Ladder::new(
            Duration::from_millis(100),
            Duration::from_secs(366 * 86_400),
        );
        assert_eq!(ladder.levels(), 26);
        assert_eq!(
            ladder.route(366 * 86_400_000),
            ladder.route(ladder.max_delay().as_millis() as i64)
        );
    }

    #[test]
    fn routing_keys_and_patterns_line_up() {
        let ladder = Ladder::new(Duration::from_secs(1), Duration::from_secs(7));
        assert_eq!(ladder.levels(), 3);
        assert_eq!(ladder.routing_key(5), "1.0.1.email");
        assert_eq!(ladder.pattern(2, true), "1.#");
        assert_eq!(ladder.pattern(0, false), "*.*.0.#");
        assert_eq!(ladder.route(999), Route::Now);
        assert_eq!(
            ladder.route(5_400),
            Route::Ladder {
                units: 5,
                routing_key: "1.0.1.email".into()
            }
        );
    }

    /// Follows a routing key through the cascade as the broker would: at each level,
    /// a 1 bit waits that level's TTL. Returns (total wait, hops).
    fn walk(ladder: &Ladder, key: &str) -> (Duration, u32) {
        let bits: Vec<&str> = key.split('.').collect();
        let mut waited = Duration::ZERO;
        let mut hops = 0;
        for k in (0..ladder.levels()).rev() {
            let position = (ladder.levels() - 1 - k) as usize;
            if bits[position] == "1" {
                waited += ladder.ttl(k);
                hops += 1;
            }
        }
        (waited, hops)
    }

    proptest! {
        #[test]
        fn the_ladder_waits_the_delay_rounded_down_to_a_unit_and_never_more(
            remaining_ms in 0i64..(365 * 86_400_000),
            resolution_ms in prop::sample::select(vec![100u64, 250, 1000, 5000]),
        ) {
            let ladder = Ladder::new(Duration::from_millis(resolution_ms), Duration::from_secs(365 * 86_400));
            match ladder.route(remaining_ms) {
                Route::Now => prop_assert!((remaining_ms as u64) < resolution_ms),
                Route::Ladder { units, routing_key } => {
                    let (waited, hops) = walk(&ladder, &routing_key);
                    prop_assert_eq!(waited.as_millis() as u64, units * resolution_ms);
                    // Never early, and the worker's rest is under one unit.
                    prop_assert!(waited.as_millis() as i64 <= remaining_ms);
                    // The rest is under one unit, unless the delay needs another pass.
                    prop_assert!(
                        remaining_ms - (waited.as_millis() as i64) < resolution_ms as i64
                            || waited == ladder.max_delay()
                    );
                    prop_assert!(hops <= ladder.levels());
                    // Exactly one pattern per level matches each key.
                    for k in 0..ladder.levels() {
                        let one = topic_matches(&ladder.pattern(k, true), &routing_key);
                        let zero = topic_matches(&ladder.pattern(k, false), &routing_key);
                        prop_assert!(one != zero);
                    }
                }
            }
        }
    }

    /// RabbitMQ topic matching for the patterns used here (`*` one word, `#` the rest).
    fn topic_matches(pattern: &str, key: &str) -> bool {
        let p: Vec<&str> = pattern.split('.').collect();
        let k: Vec<&str> = key.split('.').collect();
        for (i, word) in p.iter().enumerate() {
            match *word {
                "#" => return true,
                "*" => {
                    if i >= k.len() {
                        return false;
                    }
                }
                w => {
                    if k.get(i) != Some(&w) {
                        return false;
                    }
                }
            }
        }
        p.len() == k.len()
    }
}
