//! A send window (quiet hours, issue 48): the days and the hours of the day in which a
//! job may be sent, `"08:00-21:00"` or `"mon-fri 09:00-17:30"`, read in a time zone
//! elsewhere (`contract::local`). Data only: when a window next opens is the
//! contract's arithmetic.

use serde::{Deserialize, Deserializer};

/// Days, and hours of each of those days, in which sending is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Monday first.
    pub days: [bool; 7],
    /// When the window opens, seconds after midnight.
    pub start: u32,
    /// When it closes, seconds after midnight (at most 24:00). Earlier than `start`:
    /// it closes the next day (`22:00-06:00`), that night belonging to `start`'s day.
    pub end: u32,
}

const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl Window {
    /// Reads `[DAYS ]HH:MM[:SS]-HH:MM[:SS]`: DAYS a comma-separated list of days and
    /// day ranges (`mon-fri`, `sat,sun`, `mon,wed-fri`), every day if none. The end
    /// may be `24:00`. A window whose start is its end never opens, and is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let shown: String = text.chars().take(60).collect();
        let bad = |why: &str| {
            format!("window {shown:?}: {why} (such as \"08:00-21:00\" or \"mon-fri 09:00-17:30\")")
        };
        let (days_text, hours) = match text.rsplit_once(' ') {
            Some((days, hours)) => (Some(days.trim()), hours),
            None => (None, text),
        };
        let days = match days_text {
            None => [true; 7],
            Some(list) => {
                parse_days(list).ok_or_else(|| bad("days are mon..sun, as a list or ranges"))?
            }
        };
        let (start, end) = hours
            .split_once('-')
            .ok_or_else(|| bad("hours are START-END"))?;
        let start = parse_time(start, false).ok_or_else(|| bad("a time is HH:MM or HH:MM:SS"))?;
        let end = parse_time(end, true)
            .ok_or_else(|| bad("a time is HH:MM or HH:MM:SS, the end at most 24:00"))?;
        if start == end || (start == 0 && end == 0) {
            return Err(bad(
                "it never opens: its start is its end (all day is 00:00-24:00)",
            ));
        }
        Ok(Self { days, start, end })
    }

    /// Whether the window is open at `seconds` after midnight of weekday `weekday`
    /// (Monday 0).
    pub fn is_open(&self, weekday: usize, seconds: u32) -> bool {
        let yesterday = (weekday + 6) % 7;
        if self.start < self.end {
            self.days[weekday] && (self.start..self.end).contains(&seconds)
        } else {
            (self.days[weekday] && seconds >= self.start)
                || (self.days[yesterday] && seconds < self.end)
        }
    }
}

/// As [`Window::parse`] reads it: the days (none when every day), then the hours,
/// with seconds only where they are not zero.
impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.days != [true; 7] {
            let days: Vec<&str> = (0..7)
                .filter(|d| self.days[*d])
                .map(|d| DAY_NAMES[d])
                .collect();
            write!(f, "{} ", days.join(","))?;
        }
        let time = |s: u32| match s % 60 {
            0 => format!("{:02}:{:02}", s / 3600, s / 60 % 60),
            sec => format!("{:02}:{:02}:{sec:02}", s / 3600, s / 60 % 60),
        };
        write!(f, "{}-{}", time(self.start), time(self.end))
    }
}

fn parse_days(list: &str) -> Option<[bool; 7]> {
    let day = |name: &str| {
        let name = name.trim().to_ascii_lowercase();
        DAY_NAMES.iter().position(|d| name == *d)
    };
    let mut days = [false; 7];
    for item in list.split(',') {
        match item.split_once('-') {
            Some((from, to)) => {
                let (from, to) = (day(from)?, day(to)?);
                let mut d = from;
                loop {
                    days[d] = true;
                    if d == to {
                        break;
                    }
                    d = (d + 1) % 7;
                }
            }
            None => days[day(item)?] = true,
        }
    }
    Some(days)
}

/// `HH:MM` or `HH:MM:SS` in seconds after midnight; `24:00` only if `end`.
fn parse_time(text: &str, end: bool) -> Option<u32> {
    let mut parts = text.trim().split(':');
    let mut field = |max: u32| -> Option<u32> {
        let part = parts.next()?;
        (part.len() == 2 && part.bytes().all(|b| b.is_ascii_digit()))
            .then(|| part.parse().ok())
            .flatten()
            .filter(|v| *v <= max)
    };
    let (h, m) = (field(24)?, field(59)?);
    let s = match parts.next() {
        None => 0,
        Some(part) if part.len() == 2 && part.bytes().all(|b| b.is_ascii_digit()) => {
            part.parse().ok().filter(|v| *v <= 59)?
        }
        Some(_) => return None,
    };
    let seconds = h * 3600 + m * 60 + s;
    (seconds < 86_400 || (end && seconds == 86_400)).then_some(seconds)
}

/// `topology.lanes.<name>.window`: a window, or none when unset or empty.
pub(super) fn optional_window<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Window>, D::Error> {
    let text = Option::<String>::deserialize(d)?.unwrap_or_default();
    if text.trim().is_empty() {
        return Ok(None);
    }
    Window::parse(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_shown_as_it_is_read() {
        for text in [
            "08:00-21:00",
            "mon,tue,wed,thu,fri 09:00-17:30",
            "sat,sun 22:00:30-06:00",
            "00:00-24:00",
        ] {
            let window = Window::parse(text).unwrap();
            assert_eq!(window.to_string(), text);
            assert_eq!(Window::parse(&window.to_string()).unwrap(), window);
        }
        assert_eq!(
            Window::parse("mon-wed 08:00-09:00").unwrap().to_string(),
            "mon,tue,wed 08:00-09:00"
        );
    }

    #[test]
    fn windows_read_days_and_hours_and_refuse_one_that_never_opens() {
        let w = Window::parse("08:00-21:00").unwrap();
        assert_eq!((w.days, w.start, w.end), ([true; 7], 8 * 3600, 21 * 3600));
        let w = Window::parse("Mon-Fri 09:00-17:30:15").unwrap();
        assert_eq!(w.days, [true, true, true, true, true, false, false]);
        assert_eq!(w.end, 17 * 3600 + 30 * 60 + 15);
        assert_eq!(
            Window::parse("sat,sun 00:00-24:00").unwrap().days,
            [false, false, false, false, false, true, true]
        );
        assert_eq!(
            Window::parse("fri-mon 22:00-06:00").unwrap().days,
            [true, false, false, false, true, true, true]
        );
        for bad in [
            "00:00-00:00",
            "08:00-08:00",
            "8:00-21:00",
            "08:00",
            "25:00-26:00",
            "08:00-24:01",
            "24:00-08:00",
            "someday 08:00-21:00",
            "08:60-09:00",
            "",
        ] {
            assert!(Window::parse(bad).is_err(), "{bad}");
        }
        assert!(Window::parse("00:00-00:00")
            .unwrap_err()
            .contains("never opens"));
    }

    #[test]
    fn open_within_the_hours_of_its_days_overnight_too() {
        let day = Window::parse("mon-fri 08:00-21:00").unwrap();
        assert!(day.is_open(0, 8 * 3600));
        assert!(!day.is_open(0, 21 * 3600), "the end is not in it");
        assert!(!day.is_open(5, 12 * 3600), "saturday");
        let night = Window::parse("fri 22:00-06:00").unwrap();
        assert!(night.is_open(4, 23 * 3600));
        assert!(night.is_open(5, 5 * 3600), "friday's night, on saturday");
        assert!(!night.is_open(4, 5 * 3600), "thursday's night is not one");
    }
}
