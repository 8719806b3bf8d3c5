//! `transport.rate_limit`: a send rate written `14/s`, `600/m` or `50000/h`.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// Emails per unit of time, kept as emails per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SendRate {
    /// How many.
    pub count: u32,
    /// Per how many seconds (1, 60 or 3600).
    pub per_seconds: u32,
}

impl SendRate {
    /// Emails per second.
    pub(crate) fn per_second(self) -> f64 {
        f64::from(self.count) / f64::from(self.per_seconds)
    }

    /// Parses `14/s`, `600/m`, `50000/h` (also `/sec`, `/min`, `/hour`, `/second`…).
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not a rate like 14/s, 600/m or 50000/h");
        let (count, unit) = text.trim().split_once('/').ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let per_seconds = match unit.trim().to_ascii_lowercase().as_str() {
            "s" | "sec" | "second" => 1,
            "m" | "min" | "minute" => 60,
            "h" | "hour" => 3600,
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(format!(
                "{text:?}: a rate must be above zero (unset it to turn the limit off)"
            ));
        }
        Ok(Self { count, per_seconds })
    }
}

impl fmt::Display for SendRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.per_seconds {
            1 => "s",
            60 => "m",
            _ => "h",
        };
        write!(f, "{}/{unit}", self.count)
    }
}

/// `transport.rate_limit`: unset or empty = off.
pub(super) fn optional_rate<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SendRate>, D::Error> {
    let text = Option::<String>::deserialize(d)?.unwrap_or_default();
    if text.trim().is_empty() || text.trim().eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    SendRate::parse(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_per_second_minute_and_hour() {
        let rate = |t: &str| SendRate::parse(t).map(SendRate::per_second);
        assert_eq!(rate("14/s"), Ok(14.0));
        assert_eq!(rate(" 600 / m "), Ok(10.0));
        assert_eq!(rate("50000/h").unwrap(), 50000.0 / 3600.0);
        assert_eq!(rate("1/sec"), Ok(1.0));
        assert_eq!(rate("120/min"), Ok(2.0));
        assert_eq!(SendRate::parse("600/m").unwrap().to_string(), "600/m");
        for bad in ["", "14", "14/d", "x/s", "-1/s", "0/s", "1.5/s"] {
            assert!(SendRate::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
