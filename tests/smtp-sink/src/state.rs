//! Shared state: recorded messages, fault rules, the quota and counters.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::Serialize;

use crate::faults::{Action, FaultRule, Stage};
use crate::quota::{Quota, QuotaConfig, QuotaView};

/// Message metadata, as listed by `GET /messages`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MessageMeta {
    /// Global 1-based sequence number.
    pub(crate) seq: u64,
    /// Trimmed value of the `Message-ID` header, or `""`.
    pub(crate) message_id: String,
    /// Reverse path given in `MAIL FROM`.
    pub(crate) mail_from: String,
    /// Forward paths given in `RCPT TO`, in order.
    pub(crate) rcpt_to: Vec<String>,
    /// Unfolded, trimmed, undecoded value of the `Subject` header, or `""`.
    pub(crate) subject: String,
    /// Unix time in milliseconds when the final dot was received (set by
    /// [`AppState::record`], on the quota's clock).
    pub(crate) received_at_ms: i64,
    /// Size of the message in bytes after dot-unstuffing.
    pub(crate) size: usize,
    /// The message came in `BDAT` chunks (CHUNKING), not after `DATA`.
    pub(crate) chunked: bool,
}

/// A recorded message: metadata plus the raw content.
#[derive(Debug)]
pub(crate) struct Recorded {
    /// Metadata shown in listings.
    pub(crate) meta: MessageMeta,
    /// The message after dot-unstuffing, decoded as lossy UTF-8.
    pub(crate) raw: String,
}

/// Serialization view of a message including its raw content.
#[derive(Serialize)]
struct WithRaw<'a> {
    #[serde(flatten)]
    meta: &'a MessageMeta,
    raw: &'a str,
}

/// Counters reported by `GET /stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Messages recorded (including drop-with-deliver).
    pub(crate) accepted: AtomicU64,
    /// TCP connections accepted on the SMTP port.
    pub(crate) connections: AtomicU64,
    /// Fault rule firings.
    pub(crate) faults_applied: AtomicU64,
    /// Connections closed by a `drop` fault.
    pub(crate) dropped: AtomicU64,
    /// Sessions hung by a `hang` fault (they never answer again).
    pub(crate) hung: AtomicU64,
}

/// Snapshot of [`Counters`].
#[derive(Debug, Serialize)]
pub(crate) struct Stats {
    accepted: u64,
    connections: u64,
    faults_applied: u64,
    dropped: u64,
    hung: u64,
}

/// Recorded messages and the next sequence number.
#[derive(Debug, Default)]
struct Store {
    next_seq: u64,
    messages: Vec<Recorded>,
}

/// Everything shared between SMTP sessions and the control API.
#[derive(Debug)]
pub(crate) struct AppState {
    store: Mutex<Store>,
    rules: Mutex<Vec<FaultRule>>,
    /// Quota mode and the per-second counts; locked before `store` when both are.
    quota: Mutex<Quota>,
    /// Event counters.
    pub(crate) counters: Counters,
    /// Optional directory receiving `<seq>.eml` copies.
    pub(crate) maildir: Option<PathBuf>,
    /// Whether EHLO advertises PIPELINING.
    pub(crate) pipelining: bool,
    /// Whether EHLO advertises CHUNKING (and `BDAT` is taken).
    pub(crate) chunking: bool,
    /// Keep only this many bytes of each message (`--keep-bytes`).
    pub(crate) keep_bytes: Option<usize>,
    /// The largest message taken, advertised as `SIZE` (`--size`).
    pub(crate) max_size: usize,
}

/// Locks a mutex, recovering the data if another thread panicked while holding it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AppState {
    /// Creates empty state with these quota settings.
    pub(crate) fn new(maildir: Option<PathBuf>, quota: QuotaConfig) -> Self {
        Self {
            store: Mutex::new(Store {
                next_seq: 1,
                messages: Vec::new(),
            }),
            rules: Mutex::new(Vec::new()),
            quota: Mutex::new(Quota::new(quota)),
            counters: Counters::default(),
            pipelining: true,
            chunking: false,
            keep_bytes: None,
            max_size: crate::smtp::MAX_MESSAGE_SIZE,
            maildir,
        }
    }

    /// Records a message unless it is over the quota, assigning its sequence number
    /// and arrival time; returns that number, or the reply for a throttled message.
    ///
    /// The quota's decision and the recording happen under the quota's lock, at one
    /// instant, so the per-second counts never exceed the quota.
    pub(crate) fn record(&self, mut meta: MessageMeta, raw: String) -> Result<u64, String> {
        let mut quota = lock(&self.quota);
        let now_ms = chrono::Utc::now().timestamp_millis();
        quota.admit(now_ms)?;
        meta.received_at_ms = now_ms;
        let mut store = lock(&self.store);
        let seq = store.next_seq;
        store.next_seq += 1;
        meta.seq = seq;
        store.messages.push(Recorded { meta, raw });
        drop(store);
        drop(quota);
        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(seq)
    }

    /// The quota's settings and counters.
    pub(crate) fn quota(&self) -> QuotaView {
        lock(&self.quota).view()
    }

    /// Replaces the quota's settings (the counters carry on).
    pub(crate) fn set_quota(&self, config: QuotaConfig) {
        lock(&self.quota).set_config(config);
    }

    /// Serializes all recorded messages as a JSON array.
    pub(crate) fn messages_json(&self, with_raw: bool) -> serde_json::Result<Vec<u8>> {
        let store = lock(&self.store);
        if with_raw {
            let view: Vec<WithRaw<'_>> = store
                .messages
                .iter()
                .map(|m| WithRaw {
                    meta: &m.meta,
                    raw: &m.raw,
                })
                .collect();
            serde_json::to_vec(&view)
        } else {
            let view: Vec<&MessageMeta> = store.messages.iter().map(|m| &m.meta).collect();
            serde_json::to_vec(&view)
        }
    }

    /// Forgets all recorded messages (sequence numbers keep counting); returns how many.
    pub(crate) fn clear_messages(&self) -> usize {
        std::mem::take(&mut lock(&self.store).messages).len()
    }

    /// Returns a snapshot of the counters.
    pub(crate) fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            accepted: c.accepted.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
            faults_applied: c.faults_applied.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            hung: c.hung.load(Ordering::Relaxed),
        }
    }

    /// Returns the current fault rules with their remaining counts.
    pub(crate) fn rules(&self) -> Vec<FaultRule> {
        lock(&self.rules).clone()
    }

    /// Replaces the fault rules; returns how many rules were there before.
    pub(crate) fn set_rules(&self, rules: Vec<FaultRule>) -> usize {
        std::mem::replace(&mut *lock(&self.rules), rules).len()
    }

    /// Fires the first active rule matching `stage` and the recipients, if any.
    ///
    /// `rcpts` are the recipients accepted so far in the transaction; `candidate`
    /// is the address being given at the `rcpt` stage.
    pub(crate) fn fire(
        &self,
        stage: Stage,
        rcpts: &[String],
        candidate: Option<&str>,
    ) -> Option<Action> {
        let mut rules = lock(&self.rules);
        let rule = rules
            .iter_mut()
            .find(|r| r.is_active() && r.matches(stage, rcpts, candidate))?;
        rule.consume();
        let action = rule.action.clone();
        drop(rules);
        self.counters.faults_applied.fetch_add(1, Ordering::Relaxed);
        Some(action)
    }
}
