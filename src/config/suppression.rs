//! `suppression.*`: the suppression list's settings (issue 30).

use std::time::Duration;

use serde::Deserialize;

use super::de::duration;

/// The suppression list (issue 30): what postie does not send to, and which replies
/// put an address on it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SuppressionSettings {
    /// Check each job's recipients against the list after its claim, before the send
    /// (one indexed lookup), and add hard bounces to it.
    pub enabled: bool,
    /// Enhanced status codes (RFC 3463) of a 5xx reply to RCPT TO that suppress the
    /// address at once: the mailbox does not exist or is disabled. Never a 4xx, and
    /// never policy or reputation (5.7.x), a full mailbox (5.2.2), size (5.3.4) or a
    /// syntax error of postie's own (5.5.x).
    pub hard_bounce_codes: Vec<String>,
    /// A 5xx to RCPT TO without an enhanced status counts as a strike; this many
    /// within `strike_window` suppress the address.
    pub strikes: u32,
    /// How long a strike counts.
    #[serde(deserialize_with = "duration")]
    pub strike_window: Duration,
    /// Bounces per email sent, over the last hour or day for one job type, above
    /// which the maintenance instance logs a warning (SES reviews an account at 5 %).
    pub bounce_rate_warning: f64,
    /// Complaints per email sent above which it warns (SES reviews at 0.1 %; Gmail
    /// and Yahoo want senders under 0.3 %).
    pub complaint_rate_warning: f64,
    /// A rate warns only once its window holds at least this many sends (one bounce
    /// of the day's first email is not a 100 % rate).
    pub rate_min_sends: i64,
}

impl SuppressionSettings {
    /// The rate thresholds are fractions (0.05 is 5 %).
    pub(super) fn check(&self) -> Result<(), String> {
        for (name, value) in [
            ("bounce_rate_warning", self.bounce_rate_warning),
            ("complaint_rate_warning", self.complaint_rate_warning),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(format!(
                    "suppression.{name} = {value}: a fraction of the emails sent, above 0 and at most 1 (0.05 is 5 %)"
                ));
            }
        }
        if self.rate_min_sends < 1 {
            return Err("suppression.rate_min_sends must be at least 1".into());
        }
        Ok(())
    }
}

impl Default for SuppressionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            hard_bounce_codes: ["5.1.1", "5.1.2", "5.1.3", "5.1.6", "5.1.10", "5.2.1"]
                .map(String::from)
                .to_vec(),
            strikes: 2,
            strike_window: Duration::from_secs(24 * 3600),
            bounce_rate_warning: 0.05,
            complaint_rate_warning: 0.001,
            rate_min_sends: 100,
        }
    }
}
