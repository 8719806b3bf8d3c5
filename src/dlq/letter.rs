//! One dead letter as an operator sees it: its key, kind, attempts, time and reason,
//! read from postie's headers or the broker's `x-death` (its key by
//! `contract::peek_key_text`, the contract's key rule); the table `postie dlq list`
//! prints; the headers a replayed copy keeps.

use std::fmt::Write as _;

use lapin::types::{AMQPValue, FieldTable};

use crate::contract::{self, IdempotencyKey, ParseRules};
use crate::headers::{self, header_int, header_text};

/// One dead letter as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterSummary {
    /// The job's idempotency key by the contract's rule (`key`, else `order_id:type`),
    /// else `-`.
    pub key: String,
    /// `postie-dead-kind` (`invalid`, `permanent`, `retries_exhausted`), or `broker`
    /// for a message the broker dead-lettered by itself (delivery limit), or `-`.
    pub kind: String,
    /// Why it is here: `postie-dead-reason`, else what the broker's `x-death` header
    /// says, else `-`.
    pub reason: String,
    /// `postie-dead-attempts`: SMTP attempts made before it was dead-lettered.
    pub attempts: Option<i64>,
    /// When it was dead-lettered (RFC 3339).
    pub dead_at: Option<String>,
}

/// Headers a replayed job loses: postie's dead-letter headers and its retry counter
/// (a replay starts a fresh retry cycle), and the broker's own delivery counter.
const REPLAY_DROPPED_HEADERS: &[&str] = &[
    headers::HEADER_DEAD_REASON,
    headers::HEADER_DEAD_KIND,
    headers::HEADER_DEAD_AT,
    headers::HEADER_DEAD_ATTEMPTS,
    headers::HEADER_ATTEMPT,
    "x-delivery-count",
];

/// The dead letters as a plain-text table, one line each, reason last.
pub fn table(letters: &[DeadLetterSummary]) -> String {
    const KEY_WIDTH: usize = 48;
    let rows: Vec<[String; 5]> = letters
        .iter()
        .map(|l| {
            [
                shorten(&printable(&l.key), KEY_WIDTH),
                printable(&l.kind),
                l.attempts.map_or_else(|| "-".into(), |n| n.to_string()),
                l.dead_at.as_deref().map_or_else(|| "-".into(), short_time),
                printable(&l.reason),
            ]
        })
        .collect();
    let header = ["KEY", "KIND", "ATTEMPTS", "DEAD AT", "REASON"];
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(header.map(String::from)).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// What an operator needs to know about one dead letter, from its body and headers.
pub(crate) fn summarize(
    body: &[u8],
    headers: Option<&FieldTable>,
    rules: &ParseRules<'_>,
) -> DeadLetterSummary {
    // A blank key names nothing an operator could look for.
    let key = key_of(body, rules)
        .filter(|key| !key.trim().is_empty())
        .unwrap_or_else(|| "-".into());
    let postie_reason = header_text(headers, headers::HEADER_DEAD_REASON);
    let postie_at = header_text(headers, headers::HEADER_DEAD_AT);
    let broker = last_death(headers);
    // postie's headers say why, unless the broker dead-lettered the message after
    // postie did (say a replay by shovel that then hit the delivery limit).
    let broker_is_newer = match (&broker, postie_at.as_deref().and_then(rfc3339_secs)) {
        (Some(death), Some(postie_secs)) => death.time.is_some_and(|t| t > postie_secs),
        (Some(_), None) => postie_reason.is_none(),
        (None, _) => false,
    };
    if let (Some(death), true) = (&broker, broker_is_newer) {
        return DeadLetterSummary {
            key,
            kind: "broker".into(),
            reason: format!(
                "dead-lettered by the broker ({}) from {}",
                death.reason, death.queue
            ),
            attempts: None,
            dead_at: death
                .time
                .and_then(|t| chrono::DateTime::from_timestamp(t as i64, 0))
                .map(|t| t.to_rfc3339()),
        };
    }
    let reason = postie_reason
        .or_else(|| {
            header_text(headers, "x-first-death-reason")
                .map(|r| format!("dead-lettered by the broker ({r})"))
        })
        .unwrap_or_else(|| "-".into());
    DeadLetterSummary {
        key,
        kind: header_text(headers, headers::HEADER_DEAD_KIND).unwrap_or_else(|| "-".into()),
        reason,
        attempts: header_int(headers, headers::HEADER_DEAD_ATTEMPTS),
        dead_at: postie_at,
    }
}

/// The headers a replayed copy carries: the original ones minus
/// [`REPLAY_DROPPED_HEADERS`].
pub(crate) fn replay_headers(original: Option<&FieldTable>) -> FieldTable {
    headers::without(original, REPLAY_DROPPED_HEADERS)
}

/// The idempotency key of a body by the contract's one key rule
/// ([`contract::peek_key_text`]), read in one pass without validating the job, so that
/// invalid jobs can still be told apart: a valid key in the key space the inbox knows
/// it by (its producer's, when keys have one), any other as published.
fn key_of(body: &[u8], rules: &ParseRules<'_>) -> Option<String> {
    let text = contract::peek_key_text(body)?;
    match IdempotencyKey::parse(&text) {
        Ok(key) => Some(rules.namespaced(&key).unwrap_or(key).to_string()),
        Err(_) => Some(text),
    }
}

/// The most recent entry of the broker's `x-death` header.
struct Death {
    reason: String,
    queue: String,
    /// Unix seconds.
    time: Option<u64>,
}

fn last_death(headers: Option<&FieldTable>) -> Option<Death> {
    let AMQPValue::FieldArray(deaths) = headers?.inner().get("x-death")? else {
        return None;
    };
    // The broker keeps the most recent event first.
    let AMQPValue::FieldTable(entry) = deaths.as_slice().first()? else {
        return None;
    };
    let text = |name: &str| header_text(Some(entry), name).unwrap_or_else(|| "?".into());
    let time = match entry.inner().get("time") {
        Some(AMQPValue::Timestamp(t)) => Some(*t),
        _ => None,
    };
    Some(Death {
        reason: text("reason"),
        queue: text("queue"),
        time,
    })
}

fn rfc3339_secs(text: &str) -> Option<u64> {
    let secs = chrono::DateTime::parse_from_rfc3339(text).ok()?.timestamp();
    u64::try_from(secs).ok()
}

/// `2024-05-01 12:00:00Z` from RFC 3339, or the text as given.
fn short_time(text: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| {
            t.with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%SZ")
                .to_string()
        })
        .unwrap_or_else(|_| printable(text))
}

/// Control characters escaped, so that one dead letter stays on one line.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn shorten(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(width - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::ReplayFilter;
    use lapin::types::{FieldArray, LongString, ShortString};

    const RULES: ParseRules<'static> = ParseRules {
        max_body_bytes: 1 << 20,
        default_from: None,
        key_namespace: crate::config::KeyNamespace::Off,
        user_id: None,
        attachments: crate::contract::AttachmentLimits::DEFAULT,
    };

    fn table_of(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    fn x_death(reason: &str, queue: &str, time: u64) -> AMQPValue {
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table_of(&[
            ("reason", text(reason)),
            ("queue", text(queue)),
            ("time", AMQPValue::Timestamp(time)),
            ("count", AMQPValue::LongLongInt(1)),
        ]))]))
    }

    fn valid_job(key: &str) -> Vec<u8> {
        serde_json::json!({
            "key": key, "from": "a@example.com", "to": ["b@example.com"],
            "subject": "s", "text": "t",
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_letter_shows_the_key_in_its_producers_namespace() {
        let rules = ParseRules {
            key_namespace: crate::config::KeyNamespace::UserId,
            ..RULES
        };
        let body = valid_job("k-9");
        assert_eq!(
            key_of(&body, &rules.for_user(Some("svc-a"))).as_deref(),
            Some("svc-a:k-9")
        );
        // Without user_id (the reason it was dead-lettered), the key as published.
        assert_eq!(key_of(&body, &rules).as_deref(), Some("k-9"));
        assert_eq!(
            key_of(&body, &RULES.for_user(Some("svc-a"))).as_deref(),
            Some("k-9")
        );
    }

    #[test]
    fn the_key_comes_from_a_valid_job_else_the_raw_json_else_a_dash() {
        assert_eq!(key_of(&valid_job("k-1"), &RULES).as_deref(), Some("k-1"));
        let bad_address = br#"{"key": "k-2", "to": ["not an address"], "text": "t"}"#;
        assert_eq!(key_of(bad_address, &RULES).as_deref(), Some("k-2"));
        let derived = br#"{"order_id": "42", "type": "shipped", "to": []}"#;
        assert_eq!(key_of(derived, &RULES).as_deref(), Some("42:shipped"));
        assert_eq!(key_of(b"{\"key\": \"k-3\", ", &RULES), None);
        assert_eq!(key_of(br#"{"key": 7}"#, &RULES), None);
    }

    #[test]
    fn pc_the_letter_shows_the_key_by_the_contracts_one_rule() {
        // A blank key is the job's key (refused as empty), not a reason to show
        // order_id:type; the table shows it as `-`.
        let blank = br#"{"key": " ", "order_id": "42", "type": "shipped"}"#;
        assert_eq!(key_of(blank, &RULES).as_deref(), Some(" "));
        assert_eq!(summarize(blank, None, &RULES).key, "-");
        // `null` is absent.
        let null = br#"{"key": null, "order_id": "42", "type": "shipped"}"#;
        assert_eq!(key_of(null, &RULES).as_deref(), Some("42:shipped"));
        // A cancel request names no job.
        assert_eq!(key_of(br#"{"cancel": "k"}"#, &RULES), None);
    }

    #[test]
    fn postie_headers_give_kind_reason_attempts_and_time() {
        let h = table_of(&[
            (headers::HEADER_DEAD_REASON, text("550 5.1.1 no such user")),
            (headers::HEADER_DEAD_KIND, text("permanent")),
            (headers::HEADER_DEAD_AT, text("2024-05-01T12:00:00.5+00:00")),
            (headers::HEADER_DEAD_ATTEMPTS, AMQPValue::LongLongInt(1)),
            // An older broker event (a retry queue's TTL) does not win.
            ("x-death", x_death("expired", "p.retry.0", 1_714_564_000)),
        ]);
        let s = summarize(&valid_job("k"), Some(&h), &RULES);
        assert_eq!(s.key, "k");
        assert_eq!(s.kind, "permanent");
        assert_eq!(s.reason, "550 5.1.1 no such user");
        assert_eq!(s.attempts, Some(1));
        assert_eq!(s.dead_at.as_deref(), Some("2024-05-01T12:00:00.5+00:00"));
    }

    #[test]
    fn broker_dead_letters_fall_back_to_x_death_then_x_first_death_reason() {
        let h = table_of(&[(
            "x-death",
            x_death("delivery_limit", "p.send", 1_714_564_800),
        )]);
        let s = summarize(b"junk", Some(&h), &RULES);
        assert_eq!(s.key, "-");
        assert_eq!(s.kind, "broker");
        assert!(
            s.reason.contains("delivery_limit") && s.reason.contains("p.send"),
            "{}",
            s.reason
        );
        assert_eq!(s.attempts, None);
        assert!(s.dead_at.unwrap().starts_with("2024-05-01T12:00:00"));

        // Replayed by shovel with stale postie headers, then dead-lettered by the broker.
        let h = table_of(&[
            (headers::HEADER_DEAD_REASON, text("old reason")),
            (headers::HEADER_DEAD_AT, text("2024-05-01T11:00:00+00:00")),
            (
                "x-death",
                x_death("delivery_limit", "p.send", 1_714_564_800),
            ),
        ]);
        assert_eq!(summarize(b"", Some(&h), &RULES).kind, "broker");

        let h = table_of(&[("x-first-death-reason", text("delivery_limit"))]);
        let s = summarize(b"", Some(&h), &RULES);
        assert!(s.reason.contains("delivery_limit"), "{}", s.reason);

        let s = summarize(b"", None, &RULES);
        assert_eq!((s.kind.as_str(), s.reason.as_str()), ("-", "-"));
    }

    #[test]
    fn a_replayed_copy_loses_the_dead_letter_headers_and_the_retry_counter() {
        let h = table_of(&[
            (headers::HEADER_DEAD_REASON, text("r")),
            (headers::HEADER_DEAD_KIND, text("permanent")),
            (headers::HEADER_DEAD_AT, text("2024-05-01T12:00:00Z")),
            (headers::HEADER_DEAD_ATTEMPTS, AMQPValue::LongLongInt(4)),
            (headers::HEADER_ATTEMPT, AMQPValue::LongLongInt(3)),
            ("x-delivery-count", AMQPValue::LongLongInt(2)),
            ("traceparent", text("00-abc")),
            ("x-delay", AMQPValue::LongLongInt(5000)),
        ]);
        let out = replay_headers(Some(&h));
        let names: Vec<&str> = out.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, ["traceparent", "x-delay"]);
    }

    #[test]
    fn the_filter_matches_reason_or_kind_case_insensitively_and_the_exact_key() {
        let letter = DeadLetterSummary {
            key: "k-1".into(),
            kind: "permanent".into(),
            reason: "SMTP 550 No such user".into(),
            attempts: Some(1),
            dead_at: None,
        };
        let filter = |reason: Option<&str>, key: Option<&str>| ReplayFilter {
            reason_contains: reason.map(Into::into),
            key: key.map(Into::into),
            limit: None,
        };
        assert!(filter(None, None).matches(&letter));
        assert!(filter(Some("no such"), None).matches(&letter));
        assert!(filter(Some("PERMANENT"), Some("k-1")).matches(&letter));
        assert!(!filter(Some("421"), None).matches(&letter));
        assert!(!filter(None, Some("k-")).matches(&letter));
    }

    #[test]
    fn the_table_aligns_columns_and_keeps_each_letter_on_one_line() {
        let letters = [
            DeadLetterSummary {
                key: "k\n1".into(),
                kind: "invalid".into(),
                reason: "bad\r\nthing".into(),
                attempts: Some(0),
                dead_at: Some("2024-05-01T12:00:00.123+00:00".into()),
            },
            DeadLetterSummary {
                key: "x".repeat(60),
                kind: "-".into(),
                reason: "-".into(),
                attempts: None,
                dead_at: None,
            },
        ];
        let out = table(&letters);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[0].starts_with("KEY"));
        assert!(lines[1].starts_with("k\\n1 "), "{out}");
        assert!(lines[1].contains("2024-05-01 12:00:00Z") && lines[1].ends_with("bad\\r\\nthing"));
        assert!(lines[2].contains('…'));
        let kind_column = lines[0].find("KIND").unwrap();
        assert_eq!(lines[1].chars().position(|c| c == 'i'), Some(kind_column));
    }
}
