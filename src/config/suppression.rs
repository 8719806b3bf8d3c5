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
        }
    }
}
