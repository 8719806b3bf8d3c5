//! The `x-delay` contract: reading the header and computing a job's due time, and
//! the body's `send_at` (the later of the two, [`with_send_at`]). How
//! the delay is then honoured (the plugin, or postie's TTL ladder) is the broker's
//! business: see `crate::topology::ladder`.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

use super::InvalidJob;
use crate::headers::{header_int, HEADER_DUE_AT, HEADER_PUBLISHED_AT, HEADER_X_DELAY};

/// The plugin's limit on `x-delay`: 2^32 - 1 ms (about 49.7 days). Also the longest
/// TTL RabbitMQ can hold, so the longest ladder level.
pub(crate) const PLUGIN_MAX_DELAY: Duration = Duration::from_millis(u32::MAX as u64);

/// Reads `x-delay` in milliseconds: an integer or a numeric string; missing, zero or
/// negative means now. Floats, garbage and values over `max` are refused, never
/// truncated. Public for `tests/properties.rs`.
pub fn x_delay(headers: Option<&FieldTable>, max: Duration) -> Result<u64, InvalidJob> {
    let Some(value) = headers.and_then(|h| h.inner().get(HEADER_X_DELAY)) else {
        return Ok(0);
    };
    let ms: i64 = match value {
        AMQPValue::Void => 0,
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => header_int(headers, HEADER_X_DELAY)
            .ok_or_else(|| {
                InvalidJob(format!(
                    "x-delay {} is not an integer number of milliseconds",
                    describe(value)
                ))
            })?,
        other => header_int(headers, HEADER_X_DELAY).ok_or_else(|| {
            InvalidJob(format!(
                "x-delay {} is not an integer number of milliseconds",
                describe(other)
            ))
        })?,
    };
    let ms = ms.max(0) as u64;
    if ms > max.as_millis() as u64 {
        return Err(InvalidJob(format!(
            "x-delay {ms} ms is over the maximum of {} ms ({})",
            max.as_millis(),
            humantime::format_duration(max)
        )));
    }
    Ok(ms)
}

fn describe(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => {
            let text = String::from_utf8_lossy(s.as_bytes());
            format!("{:?}", text.chars().take(40).collect::<String>())
        }
        AMQPValue::ShortString(s) => format!("{:?}", s.as_str()),
        AMQPValue::Float(f) => f.to_string(),
        AMQPValue::Double(f) => f.to_string(),
        other => format!("of type {:?}", other.get_type()),
    }
}

/// When the job was handed over, in Unix ms, as best known without ever placing it
/// later than the truth: `postie-published-at` if given; else the AMQP `timestamp`
/// (seconds, so the latest millisecond of that second); never after `received_ms`.
pub(crate) fn published_at(
    headers: Option<&FieldTable>,
    timestamp_s: Option<u64>,
    received_ms: i64,
) -> Result<i64, InvalidJob> {
    let claimed = match header_int(headers, HEADER_PUBLISHED_AT) {
        Some(ms) => Some((ms, HEADER_PUBLISHED_AT)),
        None => timestamp_s.map(|s| {
            let ms = i64::try_from(s).unwrap_or(i64::MAX).saturating_mul(1000);
            (ms.saturating_add(999), "the AMQP timestamp")
        }),
    };
    match claimed {
        None => Ok(received_ms),
        Some((ms, what)) if ms < received_ms.saturating_sub(PLAUSIBLE_PAST_MS) => Err(InvalidJob(
            format!("{what} ({ms}) is more than ten years before the job was received"),
        )),
        Some((ms, _)) => Ok(ms.min(received_ms)),
    }
}

/// How far in the past a publish time may plausibly be (ten years).
const PLAUSIBLE_PAST_MS: i64 = 3_650 * 86_400_000;

/// The due time in Unix ms: the `postie-due-at` postie stamped earlier, else
/// published-at + `x-delay`. Times that cannot be true are refused, not clamped.
/// Public for `tests/properties.rs`.
pub fn due_at(
    headers: Option<&FieldTable>,
    timestamp_s: Option<u64>,
    received_ms: i64,
    max: Duration,
) -> Result<i64, InvalidJob> {
    if let Some(due) = header_int(headers, HEADER_DUE_AT) {
        // A send window may hold a job up to a week past its due time, whatever the
        // longest delay.
        let horizon = max.max(Duration::from_secs(8 * 86_400));
        let latest = received_ms.saturating_add(horizon.as_millis() as i64 + 86_400_000);
        if due < received_ms.saturating_sub(PLAUSIBLE_PAST_MS) || due > latest {
            return Err(InvalidJob(format!(
                "{HEADER_DUE_AT} ({due}) is not a plausible due time"
            )));
        }
        return Ok(due);
    }
    let delay = x_delay(headers, max)?;
    Ok(published_at(headers, timestamp_s, received_ms)?.saturating_add(delay as i64))
}

/// A job's `send_at`, in Unix ms: an RFC 3339 time with an offset (`Z` allowed),
/// such as `2027-03-28T10:00:00+02:00`. Read without an offset it would name no
/// instant: `send_at_local` with `time_zone` is for that.
pub(crate) fn send_at_ms(text: &str) -> Result<i64, InvalidJob> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|at| at.timestamp_millis())
        .map_err(|error| {
            let shown: String = text.chars().take(60).collect();
            InvalidJob(format!(
                "send_at {shown:?} is not an RFC 3339 time with an offset, such as \
                 2027-03-28T10:00:00+02:00 or 2027-03-28T08:00:00Z ({error})"
            ))
        })
}

/// The due time once `send_at` is known: the later of `due_ms` (published-at +
/// `x-delay`, or the time postie stamped) and `send_at_ms`, so either can only hold a
/// job longer; a `send_at` in the past is due now. One more than `max` after
/// `now_ms` (when postie reads it) is refused, as an `x-delay` over `max` is.
pub(crate) fn with_send_at(
    due_ms: i64,
    send_at_ms: Option<i64>,
    now_ms: i64,
    max: Duration,
) -> Result<i64, InvalidJob> {
    let Some(at) = send_at_ms else {
        return Ok(due_ms);
    };
    let ahead_ms = at.saturating_sub(now_ms);
    let max_ms = i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
    if ahead_ms > max_ms {
        let ahead = Duration::from_secs(u64::try_from(ahead_ms / 1000).unwrap_or(u64::MAX));
        return Err(InvalidJob(format!(
            "send_at is {} ahead, over the maximum delay of {} ms ({})",
            humantime::format_duration(ahead),
            max_ms,
            humantime::format_duration(max)
        )));
    }
    Ok(due_ms.max(at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{LongString, ShortString};

    fn headers(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut h = FieldTable::default();
        for (k, v) in pairs {
            h.insert(ShortString::from(*k), v.clone());
        }
        h
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn x_delay_accepts_integers_and_numeric_strings_and_clamps_negatives() {
        let cases = [
            (AMQPValue::LongInt(1500), 1500),
            (AMQPValue::LongLongInt(-5), 0),
            (AMQPValue::LongString(LongString::from("2500")), 2500),
            (AMQPValue::ShortShortUInt(7), 7),
        ];
        for (value, expected) in cases {
            let h = headers(&[("x-delay", value)]);
            assert_eq!(x_delay(Some(&h), DAY).unwrap(), expected);
        }
        assert_eq!(x_delay(None, DAY).unwrap(), 0);
    }

    #[test]
    fn x_delay_refuses_garbage_floats_and_too_large() {
        for (value, expected) in [
            (
                AMQPValue::LongString(LongString::from("soon")),
                "not an integer",
            ),
            (AMQPValue::Double(1.5), "not an integer"),
            (AMQPValue::Boolean(true), "not an integer"),
            (
                AMQPValue::LongLongInt(DAY.as_millis() as i64 + 1),
                "over the maximum",
            ),
        ] {
            let h = headers(&[("x-delay", value)]);
            let err = x_delay(Some(&h), DAY).unwrap_err();
            assert!(err.0.contains(expected), "{err}");
        }
    }

    #[test]
    fn published_at_prefers_the_ms_header_and_never_exceeds_receipt() {
        let h = headers(&[(HEADER_PUBLISHED_AT, AMQPValue::LongLongInt(1_000_500))]);
        assert_eq!(published_at(Some(&h), Some(999), 2_000_000), Ok(1_000_500));
        // Seconds timestamp: the latest ms of that second.
        assert_eq!(published_at(None, Some(1000), 2_000_000), Ok(1_000_999));
        // A producer clock ahead of ours: receipt wins.
        assert_eq!(published_at(None, Some(5000), 2_000_000), Ok(2_000_000));
        assert_eq!(published_at(None, None, 42), Ok(42));
        // Garbage is refused, and nothing overflows.
        let h = headers(&[(HEADER_PUBLISHED_AT, AMQPValue::LongLongInt(i64::MIN))]);
        assert!(published_at(Some(&h), None, 2_000_000).is_err());
        assert_eq!(published_at(None, Some(u64::MAX), 2_000_000), Ok(2_000_000));
    }

    #[test]
    fn an_implausible_stamped_due_time_is_refused() {
        for due in [i64::MIN, i64::MAX, -9_000_000_000_000_000] {
            let h = headers(&[(HEADER_DUE_AT, AMQPValue::LongLongInt(due))]);
            assert!(
                due_at(Some(&h), None, 1_800_000_000_000, DAY).is_err(),
                "{due}"
            );
        }
    }

    #[test]
    fn send_at_reads_rfc_3339_with_an_offset_only() {
        assert_eq!(send_at_ms("1970-01-01T00:00:01Z").unwrap(), 1_000);
        assert_eq!(send_at_ms("1970-01-01T02:00:01.5+02:00").unwrap(), 1_500);
        for bad in [
            "2027-03-28T10:00:00",
            "2027-03-28",
            "tomorrow",
            "",
            "2027-02-30T10:00:00Z",
        ] {
            let err = send_at_ms(bad).unwrap_err().0;
            assert!(
                err.contains("not an RFC 3339 time with an offset"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn send_at_and_x_delay_the_later_wins_and_the_maximum_holds() {
        let now = 1_000_000;
        assert_eq!(
            with_send_at(now + 5_000, None, now, DAY).unwrap(),
            now + 5_000
        );
        assert_eq!(
            with_send_at(now + 5_000, Some(now + 9_000), now, DAY).unwrap(),
            now + 9_000
        );
        assert_eq!(
            with_send_at(now + 5_000, Some(now + 1_000), now, DAY).unwrap(),
            now + 5_000
        );
        assert_eq!(
            with_send_at(now, Some(now - 86_400_000), now, DAY).unwrap(),
            now,
            "past: now"
        );
        let day_ms = DAY.as_millis() as i64;
        assert_eq!(
            with_send_at(now, Some(now + day_ms), now, DAY).unwrap(),
            now + day_ms
        );
        let err = with_send_at(now, Some(now + day_ms + 1), now, DAY)
            .unwrap_err()
            .0;
        assert!(
            err.contains("over the maximum delay of 86400000 ms (1day)"),
            "{err}"
        );
        assert!(with_send_at(now, Some(i64::MAX), now, DAY).is_err());
        assert_eq!(with_send_at(now, Some(i64::MIN), now, DAY).unwrap(), now);
    }

    proptest::proptest! {
        /// Whatever the three times: the due time is the later of the two, never
        /// earlier than either; a refusal only for a `send_at` past the maximum.
        #[test]
        fn send_at_only_ever_holds_a_job_longer(
            due in -1i64 << 50..1i64 << 50,
            at in -1i64 << 50..1i64 << 50,
            now in -1i64 << 50..1i64 << 50,
        ) {
            let max_ms = DAY.as_millis() as i64;
            match with_send_at(due, Some(at), now, DAY) {
                Ok(got) => {
                    proptest::prop_assert_eq!(got, due.max(at));
                    proptest::prop_assert!(at - now <= max_ms);
                }
                Err(_) => proptest::prop_assert!(at - now > max_ms),
            }
        }
    }

    #[test]
    fn due_at_uses_the_stamped_due_time_first() {
        let h = headers(&[
            (HEADER_DUE_AT, AMQPValue::LongLongInt(777)),
            ("x-delay", AMQPValue::LongInt(5000)),
        ]);
        assert_eq!(due_at(Some(&h), None, 100, DAY).unwrap(), 777);
        let h = headers(&[("x-delay", AMQPValue::LongInt(5000))]);
        assert_eq!(due_at(Some(&h), None, 100, DAY).unwrap(), 5100);
    }
}
