//! What `/readyz` reports and what pauses consumption: is the broker session up and
//! consuming, does PostgreSQL answer, is the SMTP circuit closed, are we draining.
//!
//! The transport circuit is here too: open while every transport's own breaker is
//! open (`mail::route` keeps one per provider: after `transport.breaker_threshold`
//! consecutive failures to reach it, it opens and traffic moves to the next).
//! While it is open consumption pauses instead of pushing every job through the
//! retry ladder to the DLQ, and the probers ask the providers until one answers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

use super::metrics::SharedMetrics;

/// Shared health state; cheap to clone.
#[derive(Clone)]
pub(crate) struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    database_up: watch::Sender<bool>,
    /// Why PostgreSQL is unavailable, in words (empty while it answers).
    database_cause: std::sync::Mutex<String>,
    smtp_up: watch::Sender<bool>,
    broker_up: AtomicBool,
    broker_address: std::sync::Mutex<String>,
    draining: AtomicBool,
    /// Each outbox source by name: whether this instance reaches it (`/readyz`'s
    /// detail; a source down does not make the instance unready).
    outbox: std::sync::Mutex<std::collections::BTreeMap<String, bool>>,
    metrics: SharedMetrics,
}

impl Health {
    /// Everything up.
    pub(crate) fn new(metrics: SharedMetrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                database_up: watch::channel(true).0,
                database_cause: std::sync::Mutex::new(String::new()),
                smtp_up: watch::channel(true).0,
                broker_up: AtomicBool::new(false),
                broker_address: std::sync::Mutex::new(String::new()),
                draining: AtomicBool::new(false),
                outbox: Default::default(),
                metrics,
            }),
        }
    }

    /// The metrics this health reports into.
    pub(crate) fn metrics(&self) -> &SharedMetrics {
        &self.inner.metrics
    }

    /// True while PostgreSQL answers.
    pub(crate) fn database_up(&self) -> bool {
        *self.inner.database_up.borrow()
    }

    /// PostgreSQL answered: logs and counts the way back from an outage.
    pub(crate) fn set_database_up(&self) {
        if self.database_changes_to(true) {
            self.database_cause().clear();
            tracing::info!("PostgreSQL answers again");
            self.inner
                .metrics
                .reconnected(super::metrics::Dependency::Postgresql);
        }
    }

    /// PostgreSQL is unavailable for `cause` (words an operator reads, e.g. "the
    /// database is read-only (25006) — a failover to a standby?") and `error` (the
    /// server's words): pauses consumption and logs one line when the outage starts
    /// and when its cause changes (a restart that comes back read-only).
    pub(crate) fn set_database_down(&self, cause: &str, error: &str) {
        let new_cause = {
            let mut current = self.database_cause();
            let new = *current != cause;
            if new {
                cause.clone_into(&mut current);
            }
            new
        };
        if self.database_changes_to(false) || new_cause {
            tracing::error!(
                %error,
                "PostgreSQL unavailable: {cause}; pausing consumption, holding in-flight deliveries"
            );
        }
    }

    fn database_cause(&self) -> std::sync::MutexGuard<'_, String> {
        self.inner
            .database_cause
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Records whether PostgreSQL is up; true if that changed it.
    fn database_changes_to(&self, up: bool) -> bool {
        let changed = self.inner.database_up.send_if_modified(|current| {
            let changed = *current != up;
            *current = up;
            changed
        });
        if changed {
            self.update_paused();
        }
        changed
    }

    /// True while the transport circuit is closed (some transport's breaker is).
    pub(crate) fn transport_up(&self) -> bool {
        *self.inner.smtp_up.borrow()
    }

    /// Every transport's breaker is open: opens the circuit and pauses consumption.
    pub(crate) fn transport_down(&self) {
        if self
            .inner
            .smtp_up
            .send_if_modified(|up| std::mem::replace(up, false))
        {
            tracing::error!("no transport can be reached: circuit open, pausing consumption");
            self.inner.metrics.smtp_breaker_open.set(1);
            self.update_paused();
        }
    }

    /// A transport answers again: closes the circuit.
    pub(crate) fn transport_recovered(&self) {
        if self
            .inner
            .smtp_up
            .send_if_modified(|up| !std::mem::replace(up, true))
        {
            tracing::info!("a transport answers again: circuit closed, resuming");
            self.inner.metrics.smtp_breaker_open.set(0);
            self.inner
                .metrics
                .reconnected(super::metrics::Dependency::Smtp);
            self.update_paused();
        }
    }

    /// Resolves once PostgreSQL answers and the SMTP circuit is closed.
    pub(crate) async fn wait_dependencies_up(&self) {
        let mut db = self.inner.database_up.subscribe();
        let mut smtp = self.inner.smtp_up.subscribe();
        loop {
            let _ = db.wait_for(|up| *up).await;
            let _ = smtp.wait_for(|up| *up).await;
            if self.database_up() && self.transport_up() {
                return;
            }
        }
    }

    /// True while the send consumer must not take new work.
    pub(crate) fn paused(&self) -> bool {
        !self.database_up() || !self.transport_up()
    }

    fn update_paused(&self) {
        self.inner
            .metrics
            .consumer_paused
            .set(i64::from(self.paused()));
    }

    /// Records whether a broker session is up with its consumers running.
    pub(crate) fn set_broker_up(&self, up: bool) {
        self.inner.broker_up.store(up, Ordering::Relaxed);
    }

    /// Records the (redacted) address of the broker node the session uses.
    pub(crate) fn set_broker_address(&self, address: &str) {
        *self
            .inner
            .broker_address
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = address.into();
    }

    /// The (redacted) address of the broker node in use or last used; empty before
    /// the first connection.
    pub(crate) fn broker_address(&self) -> String {
        self.inner
            .broker_address
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records whether the outbox source `name` is reached (its gauge too); true if
    /// that changed what was known (the first report is a change).
    pub(crate) fn set_outbox_source(&self, name: &str, up: bool) -> bool {
        let label = super::metrics::SourceLabel {
            source: name.to_owned(),
        };
        self.inner
            .metrics
            .outbox_source_up
            .get_or_create(&label)
            .set(i64::from(up));
        let mut sources = self.inner.outbox.lock().unwrap_or_else(|e| e.into_inner());
        sources.insert(name.to_owned(), up) != Some(up)
    }

    /// A line per outbox source for `/readyz`: `outbox <name>: up` (or `down`).
    pub(crate) fn outbox_lines(&self) -> String {
        let sources = self.inner.outbox.lock().unwrap_or_else(|e| e.into_inner());
        sources
            .iter()
            .map(|(name, up)| format!("outbox {name}: {}\n", if *up { "up" } else { "down" }))
            .collect()
    }

    /// Marks the start of a drain: not ready from now on.
    pub(crate) fn set_draining(&self) {
        self.inner.draining.store(true, Ordering::Relaxed);
    }

    /// Reasons the instance is not ready; empty when ready.
    pub(crate) fn not_ready(&self) -> Vec<&'static str> {
        let mut reasons = Vec::new();
        if self.inner.draining.load(Ordering::Relaxed) {
            reasons.push("draining");
        }
        if !self.inner.broker_up.load(Ordering::Relaxed) {
            reasons.push("broker session down");
        }
        if !self.database_up() {
            reasons.push("database unreachable");
        }
        if !self.transport_up() {
            reasons.push("smtp circuit open");
        }
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_circuit_pauses_consumption_until_a_transport_recovers() {
        let metrics = Arc::new(crate::ops::metrics::Metrics::new());
        let health = Health::new(metrics.clone());
        health.set_broker_up(true);
        assert!(!health.paused());
        health.transport_down();
        health.transport_down(); // once is enough: still one outage
        assert!(health.paused());
        assert_eq!(metrics.smtp_breaker_open.get(), 1);
        assert_eq!(health.not_ready(), ["smtp circuit open"]);
        health.transport_recovered();
        assert!(!health.paused());
        assert!(health.not_ready().is_empty());
        health.set_draining();
        assert_eq!(health.not_ready(), ["draining"]);
    }

    #[test]
    fn a_database_outage_pauses_until_it_answers_whatever_its_cause() {
        let health = Health::new(Arc::new(crate::ops::metrics::Metrics::new()));
        health.set_broker_up(true);
        health.set_database_down("the database is read-only (25006)", "25006: read-only");
        // A new cause while down (a restart that comes back read-only) keeps it down.
        health.set_database_down("the database server ended the session (57P01)", "57P01");
        assert!(health.paused());
        assert_eq!(health.not_ready(), ["database unreachable"]);
        health.set_database_up();
        assert!(!health.paused());
        assert!(health.not_ready().is_empty());
        assert!(health.database_cause().is_empty());
    }
}
