//! Inputs for the property tests of every reader of untrusted feedback (issue 45,
//! item 7): arbitrary bytes, and JSON built from the names the readers look for, so
//! that the cases reach past the first parse. Each reader is run under [`bounded`]:
//! no panic (proptest reports one), and within a time far above what it needs.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::Value;

/// The most any one case may take: a reader that loops or backtracks on some input
/// takes far longer than this; a linear one, microseconds.
const CASE_TIME: Duration = Duration::from_secs(2);

/// Runs `read` on one input and checks it ends within [`CASE_TIME`].
pub(crate) fn bounded<T>(read: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = read();
    let took = started.elapsed();
    assert!(took < CASE_TIME, "one input took {took:?}");
    out
}

/// Arbitrary bytes, up to `max` of them.
pub(crate) fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

/// A JSON value whose keys are drawn from `names` (and a few others), nested a few
/// levels, its leaves strings (from `names` too, or any), numbers, booleans or null.
pub(crate) fn json(names: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let name = prop_oneof![
        proptest::sample::select(names).prop_map(str::to_string),
        "\\PC{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        name.clone().prop_map(Value::String),
        "\\PC{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 8, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((name.clone(), inner), 0..8)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}
