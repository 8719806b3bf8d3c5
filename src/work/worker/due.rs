//! When a job is due, and how early a delivery may arrive and still be held.

use std::time::Duration;

use lapin::types::FieldTable;

use super::Worker;
use crate::contract::{self, InvalidJob};
use crate::headers::{header_int, HEADER_DUE_AT, HEADER_PUBLISHED_AT};
use crate::topology::DelayLayout;
use crate::work::now_ms;

/// A job that reaches the worker at most this much before its due time is held
/// until due (the ladder rounds down to whole units); earlier ones go back to wait.
const HOLD_SLACK: Duration = Duration::from_secs(2);

impl Worker {
    /// The due time in Unix ms: the later of `x-delay`'s and the body's `send_at`
    /// (`contract::with_send_at`). The ladder stamps `postie-due-at` (both already in
    /// it); the plugin has already waited the `x-delay`, so without a publish time
    /// there, the job is due now, or at its `send_at` (it is then sent back to wait).
    pub(super) fn due_ms(
        &self,
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
        send_at_ms: Option<i64>,
    ) -> Result<i64, InvalidJob> {
        let now = now_ms();
        let max = self.cx.topology.max_delay();
        let due = self.delay_due_ms(headers, timestamp_s, now, max)?;
        contract::with_send_at(due, send_at_ms, now, max)
    }

    fn delay_due_ms(
        &self,
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
        now: i64,
        max: Duration,
    ) -> Result<i64, InvalidJob> {
        match self.cx.topology.delay() {
            DelayLayout::Ladder(_) => contract::due_at(headers, timestamp_s, now, max),
            DelayLayout::Plugin => {
                contract::x_delay(headers, max)?; // refuse a bad x-delay in this mode too
                let known = header_int(headers, HEADER_DUE_AT).is_some()
                    || header_int(headers, HEADER_PUBLISHED_AT).is_some()
                    || timestamp_s.is_some();
                if known {
                    contract::due_at(headers, timestamp_s, now, max)
                } else {
                    Ok(now)
                }
            }
        }
    }

    pub(super) fn hold_limit(&self) -> Duration {
        match self.cx.topology.delay() {
            DelayLayout::Ladder(ladder) => ladder.resolution() + HOLD_SLACK,
            DelayLayout::Plugin => HOLD_SLACK,
        }
    }
}
