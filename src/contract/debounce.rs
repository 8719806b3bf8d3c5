//! `debounce` (issue 48, item 4): `{"wait": "30m", "max_wait": "4h"}`, read into a
//! [`Debounce`]. A later job with the same key replaces the pending one and moves its
//! due time to its own arrival + `wait`, never past the first arrival + `max_wait`
//! (the worker's `debounce.rs`, the inbox's `machine/debounce.rs`).

use std::time::Duration;

use serde::Deserialize;

use super::{invalid, InvalidJob};

/// A job's debounce: how long to wait for a later version, and for how long at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Debounce {
    /// Due this long after the latest version arrived.
    pub wait: Duration,
    /// But never later than this long after the first version of the series arrived
    /// (`None`: no cap but `delay.max` per version).
    pub max_wait: Option<Duration>,
}

/// The member as producers write it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDebounce {
    wait: String,
    #[serde(default)]
    max_wait: Option<String>,
}

/// A duration as `humantime` reads it (`"30m"`, `"1h 30m"`, `"500ms"`).
fn duration(field: &str, text: &str) -> Result<Duration, InvalidJob> {
    let parsed = humantime::parse_duration(text.trim()).map_err(|_| {
        InvalidJob(format!(
            "\"debounce.{field}\" {:?} is not a duration like \"30m\" or \"4h\"",
            text.chars().take(40).collect::<String>()
        ))
    })?;
    if parsed.is_zero() {
        return invalid(format!("\"debounce.{field}\" must be more than zero"));
    }
    Ok(parsed)
}

impl RawDebounce {
    /// The debounce, its durations checked: both more than zero, `max_wait` no less
    /// than `wait`. Their bound (`delay.max`) is the worker's to check: it is
    /// configuration, not contract.
    pub(super) fn read(&self) -> Result<Debounce, InvalidJob> {
        let wait = duration("wait", &self.wait)?;
        let max_wait = self
            .max_wait
            .as_deref()
            .map(|text| duration("max_wait", text))
            .transpose()?;
        if max_wait.is_some_and(|max| max < wait) {
            return invalid("\"debounce.max_wait\" must not be less than \"debounce.wait\"");
        }
        Ok(Debounce { wait, max_wait })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<Debounce, InvalidJob> {
        serde_json::from_str::<RawDebounce>(json).unwrap().read()
    }

    #[test]
    fn reads_wait_and_max_wait() {
        assert_eq!(
            read(r#"{"wait": "30m", "max_wait": "4h"}"#).unwrap(),
            Debounce {
                wait: Duration::from_secs(1_800),
                max_wait: Some(Duration::from_secs(14_400)),
            }
        );
        assert_eq!(read(r#"{"wait": "3s"}"#).unwrap().max_wait, None);
    }

    #[test]
    fn refuses_what_cannot_be_meant() {
        for (json, says) in [
            (r#"{"wait": "soon"}"#, "not a duration"),
            (r#"{"wait": "0s"}"#, "more than zero"),
            (r#"{"wait": "5s", "max_wait": "0s"}"#, "more than zero"),
            (r#"{"wait": "5s", "max_wait": "3s"}"#, "must not be less"),
        ] {
            let reason = read(json).unwrap_err().0;
            assert!(reason.contains(says), "{json}: {reason}");
        }
        assert!(serde_json::from_str::<RawDebounce>(r#"{"wait": "1s", "max": "2s"}"#).is_err());
        assert!(serde_json::from_str::<RawDebounce>(r#"{"max_wait": "2s"}"#).is_err());
    }
}
