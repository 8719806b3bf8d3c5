//! The terms a job is sent under (issue 48): its send window (its own, else its
//! lane's, unless it opts out where the lane allows that) and the zone the window and
//! its local due time are read in (its `time_zone`, else its lane's, else UTC). One
//! rule for the worker that holds a job and for `postie pending` and the console
//! that show it.

use jiff::tz::TimeZone;
use jiff::Timestamp;

use super::job::JobWindow;
use super::local::zone;
use crate::config::{LaneSettings, TopologySettings, Window};

/// A job's window and zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Terms<'a> {
    /// The window it may be sent in, if any.
    pub(crate) window: Option<Window>,
    /// The zone's name, if the job or its lane names one (else UTC).
    pub(crate) zone_name: Option<&'a str>,
}

impl<'a> Terms<'a> {
    /// The terms of a job asking for `window`, in `time_zone`, on a lane configured
    /// as `lane` (`None`: a lane with no settings of its own).
    pub(crate) fn of(
        window: JobWindow,
        time_zone: Option<&'a str>,
        lane: Option<&'a LaneSettings>,
    ) -> Self {
        let lane_window = lane.and_then(|l| l.window);
        let window = match window {
            JobWindow::Own(window) => Some(window),
            JobWindow::Off if lane.is_some_and(|l| l.window_optional) => None,
            JobWindow::Off | JobWindow::Lane => lane_window,
        };
        let zone_name = time_zone.or(lane.and_then(|l| l.time_zone.as_deref()));
        Self { window, zone_name }
    }

    /// The zone (both names were checked: a job's when it was parsed, a lane's at
    /// start-up; one that no longer reads is UTC).
    pub(crate) fn zone(&self) -> TimeZone {
        self.zone_name
            .and_then(|name| zone(name).ok())
            .unwrap_or(TimeZone::UTC)
    }

    /// For a person: `due_ms` in the job's zone and its window, when it has either
    /// (`"2027-03-27 10:00:00 Europe/Berlin, window 08:00-21:00"`); empty otherwise.
    pub(crate) fn describe(&self, due_ms: i64) -> String {
        let mut parts = Vec::new();
        if let (Some(name), Ok(at)) = (self.zone_name, Timestamp::from_millisecond(due_ms)) {
            let local = at.to_zoned(self.zone()).strftime("%Y-%m-%d %H:%M:%S %a");
            parts.push(format!("{local} {name}"));
        }
        if let Some(window) = &self.window {
            parts.push(format!("window {window}"));
        }
        parts.join(", ")
    }
}

/// For a person: a pending job's due time in its zone and its window, from what its
/// kept body asked for (`time_zone`, the `window` member as JSON text) on `lane`
/// (`None`: the default lane; one configured no more counts as the default).
pub(crate) fn describe_pending(
    topology: &TopologySettings,
    lane: Option<&str>,
    (time_zone, window): (Option<&str>, Option<&str>),
    due_ms: i64,
) -> String {
    let default = topology.lanes.get(&topology.default_lane);
    let settings = lane.map_or(default, |name| topology.lanes.get(name).or(default));
    Terms::of(JobWindow::from_member(window), time_zone, settings).describe(due_ms)
}

impl JobWindow {
    /// The `window` member of a kept body, as JSON text (`None`: absent): what the
    /// job asked for. One that no longer reads is taken as absent.
    pub(crate) fn from_member(json: Option<&str>) -> Self {
        match json.map(serde_json::from_str::<Option<String>>) {
            Some(Ok(None)) => JobWindow::Off,
            Some(Ok(Some(text))) => Window::parse(&text).map_or(JobWindow::Lane, JobWindow::Own),
            None | Some(Err(_)) => JobWindow::Lane,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(window: &str, zone: Option<&str>, optional: bool) -> LaneSettings {
        LaneSettings {
            window: Some(Window::parse(window).unwrap()),
            time_zone: zone.map(str::to_owned),
            window_optional: optional,
            ..LaneSettings::default()
        }
    }

    #[test]
    fn the_job_s_own_terms_win_then_the_lane_s_then_utc() {
        let bulk = lane("08:00-21:00", Some("Europe/Berlin"), true);
        let own = Window::parse("mon-fri 09:00-17:00").unwrap();
        let terms = Terms::of(JobWindow::Own(own), Some("Asia/Tokyo"), Some(&bulk));
        assert_eq!(
            (terms.window, terms.zone_name),
            (Some(own), Some("Asia/Tokyo"))
        );
        let terms = Terms::of(JobWindow::Lane, None, Some(&bulk));
        assert_eq!(terms.window, bulk.window);
        assert_eq!(terms.zone_name, Some("Europe/Berlin"));
        assert_eq!(Terms::of(JobWindow::Off, None, Some(&bulk)).window, None);
        let strict = lane("08:00-21:00", None, false);
        assert_eq!(
            Terms::of(JobWindow::Off, None, Some(&strict)).window,
            strict.window
        );
        let none = Terms::of(JobWindow::Lane, None, None);
        assert_eq!((none.window, none.zone()), (None, TimeZone::UTC));
    }

    #[test]
    fn describes_the_local_time_and_the_window() {
        let bulk = lane("08:00-21:00", None, false);
        // 2027-03-27 09:00:00 UTC is 10:00 in Berlin (winter time, the day before the gap).
        let due = 1_806_138_000_000;
        let terms = Terms::of(JobWindow::Lane, Some("Europe/Berlin"), Some(&bulk));
        assert_eq!(
            terms.describe(due),
            "2027-03-27 10:00:00 Sat Europe/Berlin, window 08:00-21:00"
        );
        assert_eq!(Terms::of(JobWindow::Lane, None, None).describe(due), "");
    }

    #[test]
    fn reads_the_window_member_of_a_kept_body() {
        assert_eq!(JobWindow::from_member(None), JobWindow::Lane);
        assert_eq!(JobWindow::from_member(Some("null")), JobWindow::Off);
        assert_eq!(
            JobWindow::from_member(Some("\"08:00-09:00\"")),
            JobWindow::Own(Window::parse("08:00-09:00").unwrap())
        );
        assert_eq!(JobWindow::from_member(Some("\"never\"")), JobWindow::Lane);
    }
}
