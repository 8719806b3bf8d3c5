//! Ladder mode's reconciler: PostgreSQL is the schedule of record, the ladder the
//! transport. A job the relay recorded as scheduled that is overdue by more than
//! `delay.reconcile_grace` and has not reached the inbox (RabbitMQ 3.10–4.x can strand
//! expired messages in a lost node's at-least-once dead-letter process) is published
//! again, straight to the send path, stamped with its due time. Never early: only
//! overdue jobs are re-published, and the worker still checks the due time. The inbox
//! claim keeps the later arrival of the original from sending twice.
//!
//! A pass runs on the maintenance instance (one at a time) every half grace period,
//! between 1 and 30 s.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::Connection;

use super::Service;
use crate::broker::{self, DelayLayout, ROUTING_KEY};
use crate::config::KeyNamespace;
use crate::contract;
use crate::headers::{self, HEADER_DUE_AT};
use crate::ops::metrics::Metrics;

/// Jobs re-published per pass at most.
const PASS_LIMIT: i64 = 1_000;

impl Service {
    /// How often the maintenance instance runs a pass.
    pub(super) fn reconcile_every(&self) -> Duration {
        (self.settings.delay.reconcile_grace / 2)
            .clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    /// A pass on the maintenance connection (opened if needed); the connection, if it
    /// still stands.
    pub(super) async fn reconcile(&self, conn: Option<Connection>) -> Option<Connection> {
        if !self.settings.delay.reconcile
            || !self.settings.delay.track_pending
            || !matches!(self.topology.delay(), DelayLayout::Ladder(_))
        {
            return conn;
        }
        let conn = self
            .maintenance_connection(conn, "reconciler pass skipped")
            .await?;
        if let Err(error) = self.reconcile_pass(&conn).await {
            tracing::warn!(error = %crate::describe_error(&error), "reconciler pass failed; trying again next time");
        }
        Some(conn)
    }

    /// One reconciler pass on `conn`; the number of jobs re-published.
    async fn reconcile_pass(&self, conn: &Connection) -> anyhow::Result<usize> {
        let inbox = self.worker.inbox();
        let overdue = inbox
            .overdue(self.settings.delay.reconcile_grace, PASS_LIMIT)
            .await?;
        if overdue.is_empty() {
            return Ok(0);
        }
        // Marked before they are published: a re-published job is claimed and sent
        // within moments, and then no longer `scheduled` for a mark to find. If a
        // publish fails, the rest stay marked and are tried again a grace later.
        let keys: Vec<String> = overdue.iter().map(|job| job.key.clone()).collect();
        inbox.mark_reconciled(&keys).await?;
        let channel = broker::confirm_channel(conn).await?;
        let exchange = self.topology.work_exchange();
        let mut published = 0;
        let mut failed = None;
        for job in &overdue {
            let mut table = FieldTable::default();
            headers::set_int(&mut table, HEADER_DUE_AT, job.due_ms);
            let mut properties = broker::job_properties().with_headers(table);
            // Per-producer keys: the job goes back under the user_id it came with.
            if self.settings.worker.key_namespace == KeyNamespace::UserId {
                if let Some(owner) = contract::key_owner(&job.key) {
                    properties = properties.with_user_id(owner.as_str().into());
                }
            }
            let sent = broker::publish_confirmed(
                &channel,
                &exchange,
                ROUTING_KEY,
                true,
                &job.body,
                properties,
            )
            .await;
            if let Err(error) = sent {
                failed = Some(error);
                break;
            }
            published += 1;
        }
        let _ = channel.close(200, "reconciled".into()).await;
        count(self.worker.health().metrics(), published);
        if let Some(error) = failed {
            return Err(error.into());
        }
        tracing::warn!(
            jobs = published,
            oldest_due_ms = overdue[0].due_ms,
            "re-published scheduled jobs the ladder had not delivered (overdue past the grace)"
        );
        Ok(published)
    }
}

fn count(metrics: &Metrics, n: usize) {
    metrics.reconciled.inc_by(n as u64);
}
