//! The byte budget: how many deliveries one instance may hold, derived from
//! `worker.inflight_bytes` and `worker.max_body_bytes`.
//!
//! AMQP's prefetch counts messages, not bytes (RabbitMQ ignores `prefetch_size`), so
//! the bytes an instance holds are bounded by sizing each lane's prefetch: every
//! delivery is counted at the largest body postie accepts. The send lane gets
//! `amqp.prefetch` if the budget allows it; the relay (ladder mode) gets the rest, up
//! to `delay.relay_prefetch` when it is set.

use super::{ConfigError, Settings};

/// The relay's prefetch when `delay.relay_prefetch` is unset and the budget leaves
/// more: the cap the setting's old default (10,000) set, kept so that a budget of
/// small bodies holds no more unacked intake deliveries than before.
const RELAY_PREFETCH_CAP: u16 = 10_000;

/// Each lane's effective prefetch, as the budget allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefetch {
    /// Unacked deliveries on each lane's send queue (`<p>.send`, `<p>.send.<lane>`).
    pub(crate) send: u16,
    /// Unacked deliveries on each lane's intake (ladder mode; 0 otherwise).
    pub(crate) relay: u16,
}

impl Settings {
    /// How many deliveries of the largest accepted size fit in the byte budget.
    fn budget_slots(&self) -> u64 {
        let body = self.worker.max_body_bytes.max(1) as u64;
        self.worker.inflight_bytes / body
    }

    /// Lanes: a send loop each, and in ladder mode a relay loop each (`topology.lanes`,
    /// at least one).
    fn lanes(&self) -> u64 {
        self.topology.lane_list().len() as u64
    }

    /// Each loop's prefetch within the byte budget: every lane's send loop gets
    /// `send`, every lane's relay loop `relay` (`ladder`: when the relay runs).
    /// [`Settings::check_budget`] has made sure each loop gets at least its
    /// concurrency.
    pub(crate) fn prefetch(&self, ladder: bool) -> Prefetch {
        let slots = self.budget_slots();
        let lanes = self.lanes();
        let relay_min = if ladder {
            u64::from(self.delay.relay_concurrency) * lanes
        } else {
            0
        };
        let send = u64::from(self.amqp.prefetch).min(slots.saturating_sub(relay_min) / lanes);
        let relay = if ladder {
            let wanted = self
                .delay
                .relay_prefetch
                .unwrap_or(RELAY_PREFETCH_CAP)
                .max(self.delay.relay_concurrency);
            u64::from(wanted).min((slots - send * lanes) / lanes)
        } else {
            0
        };
        Prefetch {
            send: send as u16,
            relay: relay as u16,
        }
    }

    /// The relay's prefetch in ladder mode, on each lane: `delay.relay_prefetch` (unset:
    /// 10,000) cut to what `worker.inflight_bytes` leaves after the send
    /// loops. 128 with the defaults.
    pub fn relay_prefetch(&self) -> u16 {
        self.prefetch(true).relay
    }

    /// Refuses a budget too small for one delivery per concurrent handler (on both
    /// lanes unless delays are in plugin mode).
    pub(super) fn check_budget(&self) -> Result<(), ConfigError> {
        if self.worker.max_body_bytes == 0 {
            return Err(ConfigError(
                "worker.max_body_bytes must be at least 1".into(),
            ));
        }
        let needed = self.lanes()
            * (self.worker.concurrency as u64
                + match self.delay.mode {
                    super::DelayMode::Plugin => 0,
                    _ => u64::from(self.delay.relay_concurrency),
                });
        let slots = self.budget_slots();
        if slots < needed {
            return Err(ConfigError(format!(
                "worker.inflight_bytes ({}) holds {slots} bodies of worker.max_body_bytes ({}); \
                 it must hold at least {needed} (for each lane, worker.concurrency plus, unless \
                 delay.mode = plugin, delay.relay_concurrency)",
                self.worker.inflight_bytes, self.worker.max_body_bytes
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_sizes_each_lane_and_refuses_too_little() {
        let mut s = Settings::default();
        s.worker.max_body_bytes = 1024;
        s.worker.inflight_bytes = 1024 * 1024;
        // Plenty: the send lane's prefetch, and the relay's up to its own cap.
        s.delay.relay_prefetch = Some(500);
        assert_eq!(
            s.prefetch(true),
            Prefetch {
                send: 128,
                relay: 500
            }
        );
        assert_eq!(
            s.prefetch(false),
            Prefetch {
                send: 128,
                relay: 0
            }
        );
        // Tight: 200 bodies; the relay keeps its concurrency's worth, the send lane
        // takes what is left first.
        s.worker.inflight_bytes = 200 * 1024;
        assert_eq!(
            s.prefetch(true),
            Prefetch {
                send: 128,
                relay: 72
            }
        );
        s.worker.inflight_bytes = 150 * 1024;
        assert_eq!(
            s.prefetch(true),
            Prefetch {
                send: 86,
                relay: 64
            }
        );
        assert!(s.check_budget().is_ok());
        // Below one body per handler on both lanes: refused with one line.
        s.worker.inflight_bytes = 100 * 1024;
        let err = s.check_budget().unwrap_err().to_string();
        assert!(
            err.contains("worker.inflight_bytes") && err.contains("at least 128"),
            "{err}"
        );
        s.delay.mode = crate::config::DelayMode::Plugin;
        assert!(s.check_budget().is_ok());
    }

    #[test]
    fn relay_prefetch_defaults_to_what_the_budget_leaves() {
        let s = Settings::default();
        assert_eq!(s.delay.relay_prefetch, None);
        // 128 MiB ÷ 512 KiB = 256 bodies, 128 of them the send loop's.
        let slots = s.worker.inflight_bytes / s.worker.max_body_bytes as u64;
        let send = u64::from(s.amqp.prefetch);
        assert_eq!(u64::from(s.relay_prefetch()), slots - send);
        assert_eq!(s.relay_prefetch(), 128);
        // Two lanes share it.
        let mut two = Settings::default();
        two.topology.lanes = [("default", 1), ("bulk", 1)]
            .into_iter()
            .map(|(name, weight)| {
                let lane = crate::config::LaneSettings {
                    weight,
                    ..Default::default()
                };
                (name.to_string(), lane)
            })
            .collect();
        assert_eq!(two.relay_prefetch(), 64);
        // Smaller bodies widen it: 64 KiB leaves 1,920.
        let mut small = Settings::default();
        small.worker.max_body_bytes = 64 * 1024;
        assert_eq!(small.relay_prefetch(), 1_920);
        // An explicit value is honoured below the budget and cut above it, as before.
        small.delay.relay_prefetch = Some(300);
        assert_eq!(small.relay_prefetch(), 300);
        small.delay.relay_prefetch = Some(20_000);
        assert_eq!(small.relay_prefetch(), 1_920);
        // Unset with room to spare: at most the old default's 10,000.
        small.worker.max_body_bytes = 1024;
        small.delay.relay_prefetch = None;
        assert_eq!(small.relay_prefetch(), RELAY_PREFETCH_CAP);
    }
}
