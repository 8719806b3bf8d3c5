//! Lanes (issue 33): `topology.lanes` names the lanes jobs may ask for (`"lane"` in
//! the body), each with its weight in the send rate and an optional cap of its own;
//! `topology.default_lane` is the lane of a job that names none (or one not
//! configured). No lanes configured: one lane, `<p>.send`, as before lanes existed.

use serde::Deserialize;

use super::rate::optional_rate;
use super::window::{optional_window, Window};
use super::{ConfigError, SendRate, TopologySettings};

/// The longest lane name (it ends up in a queue name and a routing key).
const MAX_NAME: usize = 32;

/// One lane's settings (`[topology.lanes.<name>]`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneSettings {
    /// Its share of the send rate while other lanes also wait: `weight` ÷ the sum
    /// of the waiting lanes' weights (default 1). An idle lane's share goes to the
    /// others.
    #[serde(default = "one")]
    pub weight: u32,
    /// A cap of its own across the fleet (`20/s`), within the transport's rate;
    /// unset: none.
    #[serde(default, deserialize_with = "optional_rate")]
    pub rate_limit: Option<SendRate>,
    /// Each tenant's cap inside the lane (`5/s`): a job over it is deferred to its
    /// tenant's next slot, so one tenant's backlog leaves the rest of the lane to the
    /// others. A job naming no tenant counts as tenant `default`. Unset: none.
    #[serde(default, deserialize_with = "optional_rate")]
    pub tenant_rate_limit: Option<SendRate>,
    /// Its send window (quiet hours: `"08:00-21:00"`, `"mon-fri 09:00-17:30"`): a job
    /// that comes due outside it waits until it next opens. Unset: always open.
    #[serde(default, deserialize_with = "optional_window")]
    pub window: Option<Window>,
    /// The zone its window is read in for jobs that name no `time_zone` (an IANA
    /// name). Unset: UTC.
    #[serde(default)]
    pub time_zone: Option<String>,
    /// Whether a job may opt out of the lane's window with `"window": null`.
    #[serde(default)]
    pub window_optional: bool,
    /// Every email of the lane carries a one-click unsubscribe link for its
    /// recipient (RFC 8058; `unsubscribe.*`), scoped to the job's type.
    #[serde(default)]
    pub unsubscribe: bool,
}

fn one() -> u32 {
    1
}

/// A lane name: lower-case ASCII letters, digits, `_` and `-`, at most [`MAX_NAME`].
pub(crate) fn is_lane_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

impl TopologySettings {
    /// The lanes in order, the default first: `(name, settings)`. No lanes
    /// configured: the default lane alone, weight 1, no cap.
    pub fn lane_list(&self) -> Vec<(String, LaneSettings)> {
        let default = self.default_lane.clone();
        let mut lanes = vec![(
            default.clone(),
            self.lanes.get(&default).cloned().unwrap_or(LaneSettings {
                weight: 1,
                ..LaneSettings::default()
            }),
        )];
        lanes.extend(
            self.lanes
                .iter()
                .filter(|(name, _)| **name != default)
                .map(|(name, lane)| (name.clone(), lane.clone())),
        );
        lanes
    }

    /// `topology.lanes` and `topology.default_lane` checked.
    pub(super) fn check_lanes(&self) -> Result<(), ConfigError> {
        let fail = |message: String| Err(ConfigError(message));
        for (name, lane) in &self.lanes {
            if !is_lane_name(name) {
                return fail(format!(
                    "topology.lanes: {name:?} must be 1-{MAX_NAME} lower-case ASCII letters, digits, '_' or '-'"
                ));
            }
            if lane.weight == 0 || lane.weight > 1_000 {
                return fail(format!(
                    "topology.lanes.{name}.weight must be between 1 and 1000"
                ));
            }
            if let Some(zone) = &lane.time_zone {
                if jiff::tz::db().get(zone).is_err() {
                    return fail(format!(
                        "topology.lanes.{name}.time_zone {zone:?} is not a time zone postie knows (an IANA name such as Europe/Berlin)"
                    ));
                }
            }
        }
        if !is_lane_name(&self.default_lane) {
            return fail(format!(
                "topology.default_lane {:?} must be 1-{MAX_NAME} lower-case ASCII letters, digits, '_' or '-'",
                self.default_lane
            ));
        }
        if !self.lanes.is_empty() && !self.lanes.contains_key(&self.default_lane) {
            return fail(format!(
                "topology.default_lane {:?} is not one of topology.lanes ({})",
                self.default_lane,
                self.lanes.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(weight: u32) -> LaneSettings {
        LaneSettings {
            weight,
            ..LaneSettings::default()
        }
    }

    #[test]
    fn the_default_lane_comes_first_and_no_lanes_is_one_lane() {
        let mut t = TopologySettings::default();
        assert_eq!(t.lane_list().len(), 1);
        assert_eq!(t.lane_list()[0].0, "default");
        t.lanes.insert("bulk".into(), lane(1));
        t.lanes.insert("transactional".into(), lane(9));
        t.default_lane = "transactional".into();
        t.check_lanes().unwrap();
        let names: Vec<_> = t
            .lane_list()
            .into_iter()
            .map(|(n, l)| (n, l.weight))
            .collect();
        assert_eq!(names, [("transactional".into(), 9), ("bulk".into(), 1)]);
    }

    #[test]
    fn bad_lanes_are_refused_with_their_name() {
        let mut t = TopologySettings::default();
        t.lanes.insert("bulk".into(), lane(1));
        let error = t.check_lanes().unwrap_err().to_string();
        assert!(error.contains("default_lane \"default\""), "{error}");
        t.default_lane = "bulk".into();
        t.lanes.insert("Big Lane".into(), lane(1));
        assert!(t
            .check_lanes()
            .unwrap_err()
            .to_string()
            .contains("Big Lane"));
        t.lanes.remove("Big Lane");
        t.lanes.insert("zero".into(), lane(0));
        assert!(t
            .check_lanes()
            .unwrap_err()
            .to_string()
            .contains("zero.weight"));
    }
}
