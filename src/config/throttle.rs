//! `worker.throttles`: a job type's limit per recipient and what happens over it.

use std::time::Duration;

use serde::Deserialize;

use super::de::duration;

/// At most `limit` emails of one type per recipient per `window`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottleRule {
    /// Emails allowed per recipient per window.
    pub limit: u32,
    /// The sliding window.
    #[serde(deserialize_with = "duration")]
    pub window: Duration,
    /// What to do with one over the limit.
    pub policy: ThrottlePolicy,
}

/// What happens to a job over its throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThrottlePolicy {
    /// Record it as `throttled` and ack: never sent.
    Drop,
    /// Send it when the window allows (never early).
    Defer,
}
