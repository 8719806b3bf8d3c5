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
    /// The due time in Unix ms. The ladder stamps `postie-due-at`; the plugin has
    /// already waited, so without a publish time there, the job is due now.
    pub(super) fn due_ms(
        &self,
        headers: Option<&FieldTable>,
        timestamp_s: Option<u64>,
    ) -> Result<i64, InvalidJob> {
        let now = now_ms();
        let max = self.cx.topology.max_delay();
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
