//! Every message header postie reads or writes, and typed access to AMQP header
//! tables. A leaf: it imports nothing of postie's, so the contract, the broker code
//! and the unit of work can all use it without depending on each other.
//!
//! `seal.rs`: postie's own headers sealed on every copy it publishes, and dropped
//! from a delivery at intake unless their seal holds (a producer's `postie-*`).
//!
//! Among them `postie-provider`, the route a job is pinned to after an uncertain
//! send. `without_broker_death` copies a republished copy's table only if the broker
//! left a death header in it.

mod seal;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

pub use seal::Seal;

/// Header the producer may set (the only `postie-*` one): its own publish time in
/// Unix milliseconds. It wins over the AMQP `timestamp` property, which only has
/// seconds.
pub const HEADER_PUBLISHED_AT: &str = "postie-published-at";
/// Header postie sets when it first sees a job: the due time in Unix milliseconds.
pub(crate) const HEADER_DUE_AT: &str = "postie-due-at";
/// The producers' delay header (milliseconds).
pub(crate) const HEADER_X_DELAY: &str = "x-delay";
/// Header: failed attempts so far in the current retry cycle (postie's own; RabbitMQ
/// 3.13+ drops client-set `x-*` headers, so none of ours start with `x-`).
pub const HEADER_ATTEMPT: &str = "postie-attempt";
/// How many times in a row a job waited for its attachments' store (which sets how
/// long the next wait is); never counted as an attempt.
pub(crate) const HEADER_STORE_WAITS: &str = "postie-store-waits";
/// Header: the transport (`transport.providers`' name) a job must be retried on,
/// because a send through it ended without an answer and may have been accepted.
pub(crate) const HEADER_PROVIDER: &str = "postie-provider";
/// The tenant slot (Unix ms) a job deferred under its tenant's cap was given: it is
/// not deferred again.
pub(crate) const HEADER_TENANT_SLOT: &str = "postie-tenant-slot";
/// Header: the revision postie gave a debounced job's version (`debounce`); the
/// worker claims it by this revision, not the body's.
pub(crate) const HEADER_REVISION: &str = "postie-revision";
/// Header: the error of the last failed attempt.
pub(crate) const HEADER_LAST_ERROR: &str = "postie-last-error";
/// Header on dead letters: why the job was dead-lettered, for a person.
pub const HEADER_DEAD_REASON: &str = "postie-dead-reason";
/// Header on dead letters: a short machine-readable reason class.
pub const HEADER_DEAD_KIND: &str = "postie-dead-kind";
/// Header on dead letters: when (RFC 3339).
pub(crate) const HEADER_DEAD_AT: &str = "postie-dead-at";
/// Header on dead letters: attempts made before dead-lettering.
pub(crate) const HEADER_DEAD_ATTEMPTS: &str = "postie-dead-attempts";

/// A header value as text, if it is a string or a number.
pub fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => header_i64(other).map(|n| n.to_string()),
    }
}

/// Every header of a table by name, its value as text: a string or a number as
/// [`header_text`] reads it, anything else (a table, an array, `x-death`) as AMQP
/// spells it in Rust's debug form. Public for `tests/properties.rs`.
pub fn as_text(headers: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(table) = headers else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .map(|(name, value)| {
            let text = header_text(headers, name.as_str()).unwrap_or_else(|| format!("{value:?}"));
            (name.as_str().to_owned(), text)
        })
        .collect()
}

/// A header value as an integer, if it is an integer, or a string holding one.
/// Public for `tests/properties.rs`.
pub fn header_int(headers: Option<&FieldTable>, name: &str) -> Option<i64> {
    let value = headers?.inner().get(name)?;
    header_i64(value).or_else(|| match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.trim().parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        _ => None,
    })
}

fn header_i64(value: &AMQPValue) -> Option<i64> {
    Some(match *value {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n,
        _ => return None,
    })
}

/// Sets a string header.
pub(crate) fn set_text(headers: &mut FieldTable, name: &str, value: &str) {
    headers.insert(
        ShortString::from(name),
        AMQPValue::LongString(LongString::from(value)),
    );
}

/// Sets an integer header.
pub(crate) fn set_int(headers: &mut FieldTable, name: &str, value: i64) {
    headers.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
}

/// Headers the broker adds when it dead-letters a message. postie drops them when it
/// republishes: RabbitMQ (before 3.13) reads a client-supplied `x-death` for its
/// dead-letter cycle detection, and a job that passes the same TTL queue twice
/// (deferred twice, a second ladder pass, a replay) would be taken for a cycle and
/// dropped or, with at-least-once dead-lettering, stuck in that queue for good.
pub(crate) const BROKER_DEATH_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
];

/// `headers` without the [`BROKER_DEATH_HEADERS`], copied only if it has one of them:
/// a republished copy's headers, which its publisher built and owns.
pub(crate) fn without_broker_death(headers: FieldTable) -> FieldTable {
    let has_any = BROKER_DEATH_HEADERS
        .iter()
        .any(|name| headers.contains_key(name));
    if has_any {
        without(Some(&headers), BROKER_DEATH_HEADERS)
    } else {
        headers
    }
}

/// A copy of `headers` without `names`.
pub(crate) fn without(headers: Option<&FieldTable>, names: &[&str]) -> FieldTable {
    let mut out = FieldTable::default();
    if let Some(headers) = headers {
        for (k, v) in headers.inner() {
            if !names.contains(&k.as_str()) {
                out.insert(k.clone(), v.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_integers_and_numeric_strings() {
        let mut h = FieldTable::default();
        h.insert("a".into(), AMQPValue::LongInt(7));
        h.insert("b".into(), AMQPValue::LongString(" 12 ".into()));
        h.insert("c".into(), AMQPValue::LongString("x".into()));
        assert_eq!(header_int(Some(&h), "a"), Some(7));
        assert_eq!(header_int(Some(&h), "b"), Some(12));
        assert_eq!(header_int(Some(&h), "c"), None);
        assert_eq!(header_int(Some(&h), "missing"), None);
        assert_eq!(header_text(Some(&h), "a").as_deref(), Some("7"));
    }

    #[test]
    fn without_drops_only_the_named_headers() {
        let mut h = FieldTable::default();
        set_int(&mut h, HEADER_ATTEMPT, 3);
        set_text(&mut h, "traceparent", "00-abc");
        let out = without(Some(&h), &[HEADER_ATTEMPT]);
        assert!(!out.contains_key(HEADER_ATTEMPT));
        assert!(out.contains_key("traceparent"));
    }

    #[test]
    fn pc_broker_death_headers_are_dropped_and_a_clean_table_is_kept_as_is() {
        let mut h = FieldTable::default();
        set_text(&mut h, "traceparent", "00-abc");
        set_int(&mut h, HEADER_DUE_AT, 5);
        let clean = without_broker_death(h.clone());
        assert_eq!(clean, h);
        set_int(&mut h, "x-delivery-count", 2);
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        let stripped = without_broker_death(h);
        let names: Vec<&str> = stripped.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, [HEADER_DUE_AT, "traceparent"]);
    }
}
