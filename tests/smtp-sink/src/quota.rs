//! Quota mode: at most R messages accepted in any one-second window, the way an email
//! provider enforces an account's sending rate.
//!
//! Amazon SES answers a message over its per-second quota with `454 Throttling
//! failure: Maximum sending rate exceeded` after the message's `DATA` ("How to handle
//! a 'Throttling – Maximum sending rate exceeded' error", AWS Messaging blog). The sink
//! does the same: the quota is checked when the final dot arrives, at the moment the
//! message would be recorded, and a message over it gets [`THROTTLE_REPLY`] instead of
//! `250` and is not recorded. The transaction is over either way; the session goes on.
//!
//! The window slides: a message is admitted if fewer than R messages were admitted in
//! the 1,000 ms before it. Admission and recording happen under one lock and read one
//! clock (Unix milliseconds, the messages' `received_at_ms`), so every wall-clock
//! second of [`QuotaView::accepted_per_second`] holds at most R messages, and so does
//! any 1,000 ms span of `received_at_ms`. The admissions of the last second are
//! tracked whether or not a quota is set, so turning it on mid-run counts them too.
//!
//! The per-second histogram counts every recorded message, with or without a quota,
//! so a test can find the busiest second of a run. These counters are served by
//! `GET /quota`; `GET /stats` keeps its four counters as they were.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// The reply to a message over the quota, as Amazon SES words it.
pub(crate) const THROTTLE_REPLY: &str =
    "454 4.7.0 Throttling failure: Maximum sending rate exceeded.";

/// Length of the quota's window in milliseconds.
const WINDOW_MS: i64 = 1_000;

/// Quota settings: the body of `PUT /quota`, also part of `GET /quota`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuotaConfig {
    /// Messages accepted per one-second window; `null` (or absent) turns quota mode off.
    #[serde(default)]
    pub(crate) per_second: Option<u32>,
    /// The reply to a message over the quota: one line, 4xx or 5xx.
    #[serde(default = "default_reply")]
    pub(crate) reply: String,
}

/// The SES reply, as an owned default for [`QuotaConfig::reply`].
fn default_reply() -> String {
    THROTTLE_REPLY.to_owned()
}

impl QuotaConfig {
    /// Quota mode with `per_second` (or off) and the SES reply.
    pub(crate) fn new(per_second: Option<u32>) -> Self {
        Self {
            per_second,
            reply: default_reply(),
        }
    }

    /// Checks the reply: a single line with a 4xx or 5xx code.
    pub(crate) fn validate(&self) -> Result<(), String> {
        crate::faults::validate_reply(&self.reply)?;
        if !matches!(self.reply.as_bytes()[0], b'4' | b'5') {
            return Err(format!(
                "reply {:?} must be a 4xx or 5xx reply: a message over the quota is refused",
                self.reply
            ));
        }
        Ok(())
    }
}

/// Messages accepted in one wall-clock second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct SecondCount {
    /// Unix time in seconds (the second `[second, second + 1)`).
    pub(crate) second: i64,
    /// Messages recorded in that second.
    pub(crate) accepted: u64,
}

/// What `GET /quota` (and `PUT /quota`) answers: the settings and the counters.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct QuotaView {
    /// The current settings.
    #[serde(flatten)]
    pub(crate) config: QuotaConfig,
    /// Messages recorded, in or out of quota mode (the same count as `GET /stats`).
    pub(crate) accepted: u64,
    /// Messages refused because they were over the quota.
    pub(crate) throttled: u64,
    /// Recorded messages by wall-clock second, oldest first; seconds with none are left out.
    pub(crate) accepted_per_second: Vec<SecondCount>,
}

/// The quota's settings, sliding window and counters.
#[derive(Debug)]
pub(crate) struct Quota {
    config: QuotaConfig,
    /// Admission times (Unix ms) within the last [`WINDOW_MS`], oldest first.
    window: VecDeque<i64>,
    /// Recorded messages per Unix second.
    per_second: BTreeMap<i64, u64>,
    accepted: u64,
    throttled: u64,
}

impl Quota {
    /// Quota mode with these settings and no history.
    pub(crate) fn new(config: QuotaConfig) -> Self {
        Self {
            config,
            window: VecDeque::new(),
            per_second: BTreeMap::new(),
            accepted: 0,
            throttled: 0,
        }
    }

    /// Replaces the settings; the window and the counters carry on.
    pub(crate) fn set_config(&mut self, config: QuotaConfig) {
        self.config = config;
    }

    /// Decides whether a message arriving at `now_ms` may be recorded.
    ///
    /// `Ok(())` counts it as accepted at `now_ms`; `Err(reply)` counts it as throttled
    /// and gives the line to answer with.
    pub(crate) fn admit(&mut self, now_ms: i64) -> Result<(), String> {
        while self
            .window
            .front()
            .is_some_and(|&t| t <= now_ms - WINDOW_MS)
        {
            self.window.pop_front();
        }
        if let Some(limit) = self.config.per_second {
            if self.window.len() >= limit as usize {
                self.throttled += 1;
                return Err(self.config.reply.clone());
            }
        }
        self.window.push_back(now_ms);
        self.accepted += 1;
        *self.per_second.entry(now_ms.div_euclid(1_000)).or_default() += 1;
        Ok(())
    }

    /// A snapshot for the control API.
    pub(crate) fn view(&self) -> QuotaView {
        QuotaView {
            config: self.config.clone(),
            accepted: self.accepted,
            throttled: self.throttled,
            accepted_per_second: self
                .per_second
                .iter()
                .map(|(&second, &accepted)| SecondCount { second, accepted })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(per_second: Option<u32>) -> Quota {
        Quota::new(QuotaConfig::new(per_second))
    }

    #[test]
    fn admits_r_per_sliding_second_then_throttles() {
        let mut q = quota(Some(3));
        for t in [10_000, 10_100, 10_999] {
            assert_eq!(q.admit(t), Ok(()), "at {t}");
        }
        assert_eq!(q.admit(10_999), Err(THROTTLE_REPLY.to_owned()));
        // 11,000 is 1,000 ms after the first admission: that one has left the window.
        assert_eq!(q.admit(11_000), Ok(()));
        assert_eq!(q.admit(11_050), Err(THROTTLE_REPLY.to_owned()));
        assert_eq!(q.admit(11_100), Ok(()));
        let v = q.view();
        assert_eq!((v.accepted, v.throttled), (5, 2));
        assert_eq!(
            v.accepted_per_second,
            [
                SecondCount {
                    second: 10,
                    accepted: 3
                },
                SecondCount {
                    second: 11,
                    accepted: 2
                }
            ]
        );
    }

    #[test]
    fn off_admits_everything_but_still_counts_by_second() {
        let mut q = quota(None);
        for _ in 0..50 {
            assert_eq!(q.admit(5_500), Ok(()));
        }
        // Turning the quota on counts the admissions already in the window.
        q.set_config(QuotaConfig::new(Some(10)));
        assert!(q.admit(5_600).is_err());
        assert_eq!(q.admit(6_500), Ok(()));
        let v = q.view();
        assert_eq!((v.accepted, v.throttled), (51, 1));
        assert_eq!(v.accepted_per_second.len(), 2);
    }

    #[test]
    fn zero_throttles_everything_with_the_configured_reply() {
        let mut q = quota(Some(0));
        q.set_config(QuotaConfig {
            per_second: Some(0),
            reply: "421 4.7.0 slow down".to_owned(),
        });
        assert_eq!(q.admit(1), Err("421 4.7.0 slow down".to_owned()));
        assert_eq!(q.view().accepted, 0);
    }

    #[test]
    fn config_validation() {
        assert!(QuotaConfig::new(Some(5)).validate().is_ok());
        for reply in ["250 2.0.0 fine", "oops", "454 a\r\nb"] {
            let config = QuotaConfig {
                per_second: Some(5),
                reply: reply.to_owned(),
            };
            assert!(config.validate().is_err(), "{reply:?}");
        }
    }
}
