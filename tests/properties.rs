//! A standing property suite over the parsers of producers' input and over URL
//! redaction (issue 45, item 7): arbitrary bytes and arbitrary AMQP header tables into
//! the job body parser (`Request::parse`, the key peek), the header readers
//! (`header_text`, `header_int`, `as_text`), `x-delay` and the due time, and the header
//! seal's intake check; arbitrary text and generated addresses into
//! `endpoint::redact_url` and `passwords`. For each input: no panic, the call within a
//! time bound, and the memory it holds at its peak (counted by this binary's own
//! allocator, per thread) within a bound proportional to the input. Besides, what each
//! promises: a due time never beyond `max` (plus the stamped due time's day), no
//! unsealed `postie-*` header through the seal, no password in a redacted address.
//!
//! The counting allocator is this test binary's own: the library forbids `unsafe`, so
//! the few internals it calls are `pub` for it (each says so in its doc).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString, ShortString};
use postie::config::KeyNamespace;
use postie::testing::contract::{self, EmailJob, ParseRules, Request};
use postie::testing::endpoint::{passwords, redact_url};
use postie::testing::headers::{self, Seal};
use proptest::prelude::*;

/// Counts the bytes each thread holds, and its peak, around the system allocator.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is passed to `System` unchanged; only counters are kept beside.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// `f`'s result, the most bytes it held at once beyond what this thread held
/// before, and how long it took.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize, Duration) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(base));
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    let peak = PEAK.with(Cell::get) - base;
    (out, peak.max(0) as usize, took)
}

/// Every call's bound on time: generous (a debug build on a busy machine); what it
/// catches is work that grows faster than the input.
const TIME: Duration = Duration::from_secs(2);

/// Asserts a call's bounds: `TIME`, and `per_byte` × `input` + `fixed` bytes held.
fn within(
    what: &str,
    input: usize,
    (held, took): (usize, Duration),
    per_byte: usize,
    fixed: usize,
) {
    assert!(took < TIME, "{what}: {took:?} for {input} bytes of input");
    let bound = per_byte * input + fixed;
    assert!(
        held <= bound,
        "{what}: held {held} bytes for {input} bytes of input (bound {bound})"
    );
}

const MAX_BODY: usize = 64 * 1024;

fn rules(namespace: KeyNamespace) -> ParseRules<'static> {
    ParseRules {
        max_body_bytes: MAX_BODY,
        default_from: Some("Shop <noreply@shop.example>"),
        key_namespace: namespace,
        user_id: Some("svc"),
        attachments: postie::testing::contract::AttachmentLimits::DEFAULT,
    }
}

/// Bodies: arbitrary bytes, JSON-shaped fragments (deep nesting, escapes, huge
/// numbers, the contract's member names) and valid jobs with bytes changed.
fn bodies() -> impl Strategy<Value = Vec<u8>> {
    let fragment = prop_oneof![
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("\"".to_string()),
        Just("\"key\":".to_string()),
        Just("\"to\":".to_string()),
        Just("\"headers\":".to_string()),
        Just("\"cancel\":".to_string()),
        Just("\"\\ud800\"".to_string()),
        Just("\"\\u0000\\r\\n\"".to_string()),
        Just("1e999999".to_string()),
        Just("-0.0e-7".to_string()),
        Just("null".to_string()),
        "[a-z@.<> ]{0,12}".prop_map(|s| format!("\"{s}\"")),
        "[0-9]{1,40}",
    ];
    let valid = serde_json::json!({
        "key": "k-1", "to": ["a@example.com"], "cc": [], "subject": "s", "text": "t",
        "html": "<p>h</p>", "headers": {"X-A": "b"}, "revision": 2, "lane": "bulk",
        "tenant": "t", "type": "x", "order_id": "1",
    })
    .to_string()
    .into_bytes();
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..4096),
        proptest::collection::vec(fragment, 0..400).prop_map(|v| v.concat().into_bytes()),
        (1usize..20_000).prop_map(|n| "[".repeat(n).into_bytes()),
        (1usize..5_000).prop_map(|n| "{\"a\":".repeat(n).into_bytes()),
        proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8).prop_map(
            move |edits| {
                let mut body = valid.clone();
                for (at, byte) in edits {
                    let i = at.index(body.len());
                    body[i] = byte;
                }
                body
            }
        ),
    ]
}

/// Header names: postie's, a producer's, and anything.
fn names() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("x-delay".to_string()),
        Just("postie-published-at".to_string()),
        Just("postie-due-at".to_string()),
        Just("postie-attempt".to_string()),
        Just("postie-provider".to_string()),
        Just("postie-tenant-slot".to_string()),
        Just("postie-seal".to_string()),
        Just("traceparent".to_string()),
        "[a-z-]{1,16}",
    ]
}

/// Any AMQP value, tables and arrays nested three deep.
fn values() -> impl Strategy<Value = AMQPValue> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<u8>().prop_map(AMQPValue::ShortShortUInt),
        any::<i16>().prop_map(AMQPValue::ShortInt),
        any::<u16>().prop_map(AMQPValue::ShortUInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<u32>().prop_map(AMQPValue::LongUInt),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        any::<f32>().prop_map(AMQPValue::Float),
        any::<f64>().prop_map(AMQPValue::Double),
        (any::<u8>(), any::<u32>())
            .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
        "[ -~]{0,40}".prop_map(|s| AMQPValue::ShortString(ShortString::from(s))),
        proptest::collection::vec(any::<u8>(), 0..256)
            .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        "[ +-]?[0-9]{0,30}[ ]?".prop_map(|s| AMQPValue::LongString(LongString::from(s))),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|b| AMQPValue::ByteArray(b.into())),
        Just(AMQPValue::Void),
    ];
    leaf.prop_recursive(3, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8)
                .prop_map(|v| AMQPValue::FieldArray(v.into())),
            proptest::collection::vec((names(), inner), 0..8)
                .prop_map(|kv| AMQPValue::FieldTable(table(kv))),
        ]
    })
}

fn table(pairs: Vec<(String, AMQPValue)>) -> FieldTable {
    let map: BTreeMap<ShortString, AMQPValue> = pairs
        .into_iter()
        .map(|(k, v)| (ShortString::from(k), v))
        .collect();
    map.into()
}

fn tables() -> impl Strategy<Value = FieldTable> {
    proptest::collection::vec((names(), values()), 0..12).prop_map(table)
}

/// A rough size of a table's input: its debug form (a bound's unit, no more).
fn size_of(table: &FieldTable) -> usize {
    format!("{table:?}").len()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_body_is_parsed_or_refused_within_bounds(body in bodies()) {
        for namespace in [KeyNamespace::Off, KeyNamespace::UserId] {
            let rules = rules(namespace);
            let (parsed, held, took) = measured(|| Request::parse(&body, &rules).map(|_| ()));
            within("Request::parse", body.len(), (held, took), 16, 256 * 1024);
            if let Err(reason) = parsed {
                prop_assert!(!reason.0.is_empty());
            }
            let (_, held, took) = measured(|| EmailJob::parse(&body, &rules).map(|_| ()));
            within("EmailJob::parse", body.len(), (held, took), 16, 256 * 1024);
        }
        let (_, held, took) = measured(|| contract::peek_key_text(&body));
        within("peek_key_text", body.len(), (held, took), 8, 64 * 1024);
    }

    #[test]
    fn any_header_table_is_read_within_bounds(
        table in tables(),
        timestamp in proptest::option::of(any::<u64>()),
        now in 0i64..=4_102_444_800_000,
    ) {
        let input = size_of(&table);
        let h = Some(&table);
        let max = Duration::from_secs(366 * 86_400);
        let ((), held, took) = measured(|| {
            for name in ["x-delay", "postie-due-at", "postie-attempt", "postie-provider", "nope"] {
                let _ = headers::header_text(h, name);
                let _ = headers::header_int(h, name);
            }
        });
        within("header_text/header_int", input, (held, took), 4, 64 * 1024);
        let (text, held, took) = measured(|| headers::as_text(h));
        within("as_text", input, (held, took), 16, 64 * 1024);
        prop_assert_eq!(text.len(), table.inner().len());
        let (delay, held, took) = measured(|| contract::x_delay(h, max));
        within("x_delay", input, (held, took), 4, 64 * 1024);
        if let Ok(ms) = delay {
            prop_assert!(ms <= max.as_millis() as u64);
        }
        let (due, held, took) = measured(|| contract::due_at(h, timestamp, now, max));
        within("due_at", input, (held, took), 4, 64 * 1024);
        if let Ok(due) = due {
            // Never beyond the longest delay (plus a stamped due time's day of slack).
            prop_assert!(due <= now + max.as_millis() as i64 + 86_400_000, "due {due} at {now}");
        }
    }

    #[test]
    fn no_unsealed_postie_header_passes_the_seal(table in tables(), body in bodies()) {
        let seal = Seal::new(&[42; 32], false);
        let input = size_of(&table) + body.len();
        let (admitted, held, took) = measured(|| seal.admit(Some(&table), &body));
        within("Seal::admit", input, (held, took), 8, 64 * 1024);
        let kept = admitted.headers.as_ref().unwrap_or(&table);
        for name in kept.inner().keys() {
            let name = name.as_str();
            prop_assert!(
                !name.starts_with("postie-") || name == "postie-published-at",
                "{name} passed without postie's seal"
            );
        }
        // What postie seals itself passes, whatever else is in the table.
        let mut sealed = admitted.headers.clone().unwrap_or_else(|| table.clone());
        sealed.insert("postie-attempt".into(), AMQPValue::LongLongInt(3));
        seal.seal(&mut sealed, &body);
        let again = seal.admit(Some(&sealed), &body);
        prop_assert_eq!(again.dropped, 0);
        let kept = again.headers.unwrap_or(sealed);
        prop_assert_eq!(headers::header_int(Some(&kept), "postie-attempt"), Some(3));
    }

    #[test]
    fn any_text_is_redacted_within_bounds(raw in prop_oneof![
        ".{0,400}",
        proptest::collection::vec(any::<u8>(), 0..400)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        proptest::collection::vec(
            prop_oneof![
                Just("://"), Just("@"), Just(":"), Just("/"), Just("?"), Just("#"), Just("&"),
                Just("="), Just(","), Just("'"), Just("\\"), Just(" "), Just("["), Just("]"),
                Just("%"), Just("%2"), Just("password"), Just("user"), Just("host"), Just("amqp"),
                Just("postgres"), Just("é"),
            ],
            0..200,
        )
        .prop_map(|v| v.concat()),
    ]) {
        let (redacted, held, took) = measured(|| redact_url(&raw));
        within("redact_url", raw.len(), (held, took), 8, 16 * 1024);
        prop_assert!(redacted.len() <= 4 * raw.len() + 3);
        let (_, held, took) = measured(|| passwords(&raw));
        within("passwords", raw.len(), (held, took), 16, 16 * 1024);
    }

    #[test]
    fn a_password_in_any_address_form_is_hidden_and_found(
        form in 0usize..6,
        scheme in prop::sample::select(vec!["postgres", "postgresql", "amqp", "amqps", "smtp", "smtps", "https"]),
        user in "[a-z][a-z0-9_.-]{0,8}",
        secret in "Zq9[A-Za-z0-9]{5,20}",
        host in "[a-z][a-z0-9-]{0,10}(\\.[a-z]{2,4})?",
        port in proptest::option::of(1u16..),
        path in "(/[a-z0-9_]{0,8}){0,2}",
        key in prop::sample::select(vec!["password", "api_key", "token", "secret", "sslpassword"]),
    ) {
        let port = port.map(|p| format!(":{p}")).unwrap_or_default();
        let raw = match form {
            0 => format!("{scheme}://{user}:{secret}@{host}{port}{path}"),
            1 => format!("{scheme}://{user}:{secret}@{host}{port},{host}2:5433{path}?sslmode=require"),
            2 => format!("{scheme}://{host}{port}{path}?a=b&{key}={secret}"),
            3 => format!("host={host} user={user} {key}={secret} dbname=x"),
            4 => format!("host={host} {key} = '{secret}' user={user}"),
            _ => format!("amqp://{user}:{secret}@{host}{port}/%2f,amqp://{user}:{secret}@{host}2{port}/%2f"),
        };
        let redacted = redact_url(&raw);
        prop_assert!(!redacted.contains(&secret), "{raw} redacted as {redacted}");
        let found = passwords(&raw);
        prop_assert!(found.contains(&secret), "{raw}: found {found:?}");
    }
}
