//! Deserializers for the settings' own notations: durations as humantime
//! (`"30s"`, `"2m"`), lists of them, and an optional listen address (empty: none).

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub(super) fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text)
        .map_err(|e| serde::de::Error::custom(format!("{text:?} is not a duration like 5s: {e}")))
}

pub(super) fn optional_duration<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    match Option::<String>::deserialize(d)?.filter(|t| !t.trim().is_empty()) {
        None => Ok(None),
        Some(text) => humantime::parse_duration(text.trim())
            .map(Some)
            .map_err(|e| {
                serde::de::Error::custom(format!("{text:?} is not a duration like 5s: {e}"))
            }),
    }
}

pub(super) fn optional_addr<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<SocketAddr>, D::Error> {
    let text = Option::<String>::deserialize(d)?.unwrap_or_default();
    if text.trim().is_empty() {
        return Ok(None);
    }
    text.trim().parse().map(Some).map_err(|e| {
        serde::de::Error::custom(format!(
            "{text:?} is not an address like 127.0.0.1:9090: {e}"
        ))
    })
}

pub(super) fn durations<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|text| {
            humantime::parse_duration(text).map_err(|e| {
                serde::de::Error::custom(format!("{text:?} is not a duration like 5s: {e}"))
            })
        })
        .collect()
}
