//! Shared state: what was accepted, the fault rules, the quota and the counters.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The four APIs this server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Provider {
    /// Amazon SES v2 `SendEmail`.
    Ses,
    /// SendGrid v3 `mail/send`.
    Sendgrid,
    /// Postmark `/email`.
    Postmark,
    /// Mailgun `messages.mime`.
    Mailgun,
}

/// One accepted request, as `GET /messages` lists it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Accepted {
    /// 1-based arrival order.
    pub(crate) seq: u64,
    /// Which API took it.
    pub(crate) provider: Provider,
    /// The email's Message-ID (from the raw MIME, or the JSON's headers).
    pub(crate) message_id: String,
    /// The id this server answered with.
    pub(crate) provider_id: String,
    /// Recipients, as the request named them.
    pub(crate) to: Vec<String>,
    /// Unix ms when it was accepted.
    pub(crate) received_at_ms: i64,
    /// The raw MIME (SES, Mailgun) or the JSON body (SendGrid, Postmark).
    pub(crate) raw: String,
}

/// What a fault rule does to a matching request (after its body was read and its
/// authentication checked; `SlowReadMs` before its body is read).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Action {
    /// The provider's throttling reply (429 with its headers).
    Throttle(bool),
    /// A server error with this status (500, 502, 503 …).
    Status(u16),
    /// Never answer (the connection stays open until the client drops it).
    Hang(bool),
    /// Hold the reply this long, then go on as without the rule.
    DelayMs(u64),
    /// The provider's "account suspended" permanent rejection.
    Suspended(bool),
    /// The provider's "invalid recipient" permanent rejection.
    Reject(bool),
    /// A 200 whose body never ends (a misbehaving or hostile endpoint): the bytes
    /// written before the client hung up are counted in `reply_bytes`.
    EndlessReply(bool),
    /// Leave the request's body unread this long, then go on as without the rule: a
    /// large body stalls in the socket's buffers meanwhile. Checked before the body
    /// is read, so it matches by `provider` only (never `to_contains`).
    SlowReadMs(u64),
}

/// A fault rule: `{"provider": "ses", "to_contains": "bad", "action": {"status": 503}, "times": 2}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FaultRule {
    /// Only requests to this API (any when absent).
    #[serde(default)]
    pub(crate) provider: Option<Provider>,
    /// Only requests with a recipient containing this text (so never a probe, which
    /// has no recipient).
    #[serde(default)]
    pub(crate) to_contains: Option<String>,
    /// The rule applies to the account endpoints (postie's circuit-breaker probe)
    /// instead of the send endpoints.
    #[serde(default)]
    pub(crate) probe: bool,
    /// What to do.
    pub(crate) action: Action,
    /// How many more times it fires (forever when absent).
    #[serde(default)]
    pub(crate) times: Option<u32>,
}

/// Counters (`GET /stats`), per provider and in all.
#[derive(Debug, Default, Clone, Serialize)]
pub(crate) struct Stats {
    /// Requests that reached a send handler. The other counters are about these
    /// alone, not about probes.
    pub(crate) requests: u64,
    /// Requests accepted and recorded.
    pub(crate) accepted: u64,
    /// 429 replies (quota or rule).
    pub(crate) throttled: u64,
    /// 5xx replies from rules.
    pub(crate) server_errors: u64,
    /// Permanent rejections (suspended, invalid recipient, bad request).
    pub(crate) rejected: u64,
    /// Requests refused for their credentials or signature.
    pub(crate) auth_failed: u64,
    /// Requests never answered.
    pub(crate) hung: u64,
    /// Requests that reached an account endpoint (whatever the answer).
    pub(crate) probes: u64,
    /// Requests answered with an endless body.
    pub(crate) endless: u64,
    /// Bytes of endless bodies written (taken by the client, or its socket).
    pub(crate) reply_bytes: u64,
}

/// At most `per_second` accepted in any second; the rest get the provider's 429.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct QuotaConfig {
    /// The quota; none when absent.
    pub(crate) per_second: Option<u32>,
}

#[derive(Default)]
struct Inner {
    accepted: Vec<Accepted>,
    rules: Vec<FaultRule>,
    quota: QuotaConfig,
    /// Acceptance instants within the last second (quota mode).
    window: VecDeque<Instant>,
    stats: Stats,
}

/// Everything the handlers share.
#[derive(Default)]
pub(crate) struct AppState {
    inner: Mutex<Inner>,
    /// Keep only this many bytes of each request's `raw` (`--keep-bytes`).
    pub(crate) keep_bytes: Option<usize>,
}

/// Which counter a reply bumps.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    Requests,
    Throttled,
    ServerErrors,
    Rejected,
    AuthFailed,
    Hung,
    Probes,
    Endless,
}

impl AppState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn count(&self, what: Count) {
        let stats = &mut self.lock().stats;
        let counter = match what {
            Count::Requests => &mut stats.requests,
            Count::Throttled => &mut stats.throttled,
            Count::ServerErrors => &mut stats.server_errors,
            Count::Rejected => &mut stats.rejected,
            Count::AuthFailed => &mut stats.auth_failed,
            Count::Hung => &mut stats.hung,
            Count::Probes => &mut stats.probes,
            Count::Endless => &mut stats.endless,
        };
        *counter += 1;
    }

    /// `n` more bytes of an endless body written.
    pub(crate) fn add_reply_bytes(&self, n: u64) {
        self.lock().stats.reply_bytes += n;
    }

    /// The first active rule for `provider`'s sends (account requests when `probe`)
    /// matching one of `to`, counted down.
    pub(crate) fn fault(&self, provider: Provider, probe: bool, to: &[String]) -> Option<Action> {
        let mut inner = self.lock();
        let rule = inner.rules.iter_mut().find(|rule| {
            rule.times != Some(0)
                && !matches!(rule.action, Action::SlowReadMs(_))
                && rule.probe == probe
                && rule.provider.is_none_or(|p| p == provider)
                && rule
                    .to_contains
                    .as_deref()
                    .is_none_or(|needle| to.iter().any(|t| t.contains(needle)))
        })?;
        if let Some(times) = rule.times.as_mut() {
            *times -= 1;
        }
        Some(rule.action.clone())
    }

    /// How long to leave a send request's body to `provider` unread: the first live
    /// `slow_read_ms` rule for it (one time of it used), if any.
    pub(crate) fn slow_read(&self, provider: Provider) -> Option<Duration> {
        let mut inner = self.lock();
        let rule = inner.rules.iter_mut().find(|rule| {
            rule.times != Some(0)
                && !rule.probe
                && rule.to_contains.is_none()
                && rule.provider.is_none_or(|p| p == provider)
                && matches!(rule.action, Action::SlowReadMs(_))
        })?;
        if let Some(times) = rule.times.as_mut() {
            *times -= 1;
        }
        match rule.action {
            Action::SlowReadMs(ms) => Some(Duration::from_millis(ms)),
            _ => None,
        }
    }

    /// Records the email unless the quota is spent (then `None`: answer 429).
    pub(crate) fn admit(&self, mut accepted: Accepted) -> Option<Accepted> {
        let mut inner = self.lock();
        let now = Instant::now();
        if let Some(limit) = inner.quota.per_second {
            while inner
                .window
                .front()
                .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(1))
            {
                inner.window.pop_front();
            }
            if inner.window.len() >= limit as usize {
                inner.stats.throttled += 1;
                return None;
            }
            inner.window.push_back(now);
        }
        inner.stats.accepted += 1;
        accepted.seq = inner.accepted.len() as u64 + 1;
        accepted.received_at_ms = chrono::Utc::now().timestamp_millis();
        let mut kept = accepted.clone();
        if let Some(keep) = self.keep_bytes.filter(|keep| kept.raw.len() > *keep) {
            let mut cut = keep;
            while !kept.raw.is_char_boundary(cut) {
                cut -= 1;
            }
            kept.raw.truncate(cut);
            kept.raw.shrink_to_fit();
        }
        inner.accepted.push(kept);
        Some(accepted)
    }

    /// Every accepted request (without `raw` unless asked).
    pub(crate) fn accepted(&self, raw: bool) -> Vec<Accepted> {
        self.lock()
            .accepted
            .iter()
            .map(|a| {
                let mut a = a.clone();
                if !raw {
                    a.raw.clear();
                }
                a
            })
            .collect()
    }

    /// How many emails `provider` accepted in the last 24 hours.
    pub(crate) fn accepted_last_day(&self, provider: Provider) -> u64 {
        let since = chrono::Utc::now().timestamp_millis() - 24 * 3600 * 1000;
        self.lock()
            .accepted
            .iter()
            .filter(|a| a.provider == provider && a.received_at_ms > since)
            .count() as u64
    }

    pub(crate) fn stats(&self) -> Stats {
        self.lock().stats.clone()
    }

    pub(crate) fn rules(&self) -> Vec<FaultRule> {
        self.lock().rules.clone()
    }

    pub(crate) fn set_rules(&self, rules: Vec<FaultRule>) {
        self.lock().rules = rules;
    }

    pub(crate) fn quota(&self) -> QuotaConfig {
        self.lock().quota.clone()
    }

    pub(crate) fn set_quota(&self, quota: QuotaConfig) {
        let mut inner = self.lock();
        inner.quota = quota;
        inner.window.clear();
    }
}
