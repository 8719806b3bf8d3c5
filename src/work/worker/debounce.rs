//! Debounce (issue 48, item 4): the first time postie sees a version of a debounced
//! job, it records it as the pending version (`inbox::machine`'s `debounce`: a new
//! revision, due at its arrival + `wait`, never past the series' first arrival +
//! `max_wait`) and sends it back to wait, stamped with that revision in the sealed
//! `postie-revision` header. Seen again with that header, it is claimed by that
//! revision like any job: every older version, wherever it waits, is stale by then.
//!
//! A version's arrival is its own due time (its publish time, unless it carries an
//! `x-delay` or `send_at`), so a backlog in front of the worker does not push it
//! later, and both delay modes agree.

use std::ops::ControlFlow;

use lapin::types::FieldTable;

use super::{Stop, Worker};
use crate::contract::{Debounce, EmailJob};
use crate::headers::{header_int, HEADER_REVISION};
use crate::inbox::{Debounced, Debouncing};
use crate::topology::LaneId;
use crate::work::{now_ms, DeadKind, Outcome};

impl Worker {
    /// For a debounced `job` due (arrived) at `arrival_ms`: `Continue` with the job's
    /// revision set when this version was recorded already (its header), else the
    /// outcome of recording it now.
    pub(super) async fn debounce(
        &self,
        job: &mut EmailJob,
        debounce: Debounce,
        (lane, arrival_ms): (LaneId, i64),
        (headers, body): (Option<&FieldTable>, &[u8]),
    ) -> Result<ControlFlow<Outcome>, Stop> {
        if let Some(revision) = header_int(headers, HEADER_REVISION) {
            // Sealed: postie stamped it (a producer's was dropped at intake).
            job.revision = revision.clamp(0, i64::from(i32::MAX)) as i32;
            return Ok(ControlFlow::Continue(()));
        }
        let max = self.cx.topology.max_delay();
        if debounce.wait > max || debounce.max_wait.is_some_and(|m| m > max) {
            return Ok(ControlFlow::Break(Outcome::DeadLetter {
                key: Some(job.key.clone()),
                kind: DeadKind::Invalid,
                reason: format!(
                    "\"debounce\" waits longer than delay.max ({})",
                    humantime::format_duration(max)
                ),
                attempts: 0,
            }));
        }
        let version = Debouncing {
            key: job.key.as_str(),
            revision: job.revision,
            arrival_ms,
            wait_ms: debounce.wait.as_millis() as i64,
            max_wait_ms: debounce.max_wait.map(|m| m.as_millis() as i64),
            body: self.cx.settings.delay.reconcile.then_some(body),
            lane: self.cx.topology.lane_column(lane),
        };
        let recorded = self
            .db("debounce", || self.cx.inbox.debounce(&version))
            .await?;
        let key = job.key.clone();
        Ok(ControlFlow::Break(match recorded {
            Debounced::Replaced { revision, due_ms } => Outcome::Debounced {
                key,
                revision,
                due_ms,
                wait_ms: due_ms.saturating_sub(now_ms()).max(0),
            },
            Debounced::AlreadySent => Outcome::Duplicate { key },
            Debounced::Stale => Outcome::Stale { key },
        }))
    }
}
