//! Send windows (quiet hours, issue 48): a job due outside its window is held until
//! the window next opens, checked when it is admitted and again after its turn at the
//! send rate, just before its claim, so that none starts outside the window (one that
//! starts just before it closes may end after, within the send deadline).

use super::Worker;
use crate::config::LaneSettings;
use crate::contract::{self, EmailJob, Terms};
use crate::topology::LaneId;

impl Worker {
    /// `lane`'s own settings (`topology.lanes.<name>`), if it has any.
    pub(super) fn lane_settings(&self, lane: LaneId) -> Option<&LaneSettings> {
        let name = &self.cx.topology.lane(lane).name;
        self.cx.settings.topology.lanes.get(name)
    }

    /// When `job` may next be sent if it is outside its window at `at_ms` (Unix ms);
    /// `None` when it may go at `at_ms`. The window is the job's own, else its lane's
    /// (unless the job says `null` and the lane allows that); it is read in the job's
    /// `time_zone`, else the lane's, else UTC.
    pub(super) fn window_hold(&self, job: &EmailJob, lane: LaneId, at_ms: i64) -> Option<i64> {
        let terms = Terms::of(
            job.window,
            job.time_zone.as_deref(),
            self.lane_settings(lane),
        );
        let opens = contract::next_open(&terms.window?, at_ms, &terms.zone());
        (opens > at_ms).then_some(opens)
    }
}
