//! `outbox.*`: the producers' databases whose transactional outbox `postie serve`
//! relays (issue 31; `postie outbox install` creates the outbox in each).
//!
//! An entry of `outbox.sources` is a PostgreSQL URL (`postgres://…`, TLS by `sslmode`
//! as `database.url`, under `database.allow_plaintext` and `database.ca_file`), with
//! one more query parameter that postie reads and removes: `name=`, the source's
//! name in logs, metrics, `/readyz` and `postie status` (default `source1`,
//! `source2`, … by position). The URL itself is never shown but redacted.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::de::duration;
use super::{database_plan, ConfigError, DatabaseSettings, DbPlan};
use crate::endpoint::redact_url;

/// The relay of the producers' outboxes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxSettings {
    /// The producers' databases to relay (`postie outbox install` in each), one task
    /// each; empty: no relay.
    pub sources: Vec<SecretString>,
    /// The most rows one pass takes from a source (one transaction, their confirms
    /// awaited together); 1 to 10,000. Also bounds what a relay holds.
    pub batch_size: u32,
    /// How often a relay looks for rows when no notification woke it (a full batch
    /// is followed at once); 10 ms to 1 h.
    #[serde(deserialize_with = "duration")]
    pub poll_interval: Duration,
    /// LISTEN for the enqueue's notification on a connection of its own, to start a
    /// pass at once; off: polling only.
    pub listen: bool,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            sources: Vec::new(),
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            listen: true,
        }
    }
}

/// One source as validation parsed it.
pub struct OutboxSource {
    /// `name=`, else `source<n>` (1-based): unique.
    pub name: String,
    /// The URL without its secrets (`name=` removed), for log lines.
    pub shown: String,
    /// The connection settings and the TLS decision.
    pub plan: DbPlan,
}

impl std::fmt::Debug for OutboxSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxSource")
            .field("name", &self.name)
            .field("shown", &self.shown)
            .field("tls", &self.plan.tls)
            .finish()
    }
}

impl OutboxSettings {
    /// Checks the bounds and parses every source (a refusal names the key and shows
    /// the URL redacted).
    pub(crate) fn parse_sources(
        &self,
        db: &DatabaseSettings,
    ) -> Result<Vec<OutboxSource>, ConfigError> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError(format!(
                "outbox.batch_size is {}: give 1 to 10000",
                self.batch_size
            )));
        }
        let poll = self.poll_interval;
        if poll < Duration::from_millis(10) || poll > Duration::from_secs(3600) {
            return Err(ConfigError(format!(
                "outbox.poll_interval is {}: give 10ms to 1h",
                humantime::format_duration(poll)
            )));
        }
        let mut sources: Vec<OutboxSource> = Vec::with_capacity(self.sources.len());
        for (i, raw) in self.sources.iter().enumerate() {
            let key = format!("outbox.sources[{i}]");
            let source = source(&key, raw.expose_secret(), i + 1, db)?;
            if sources.iter().any(|s| s.name == source.name) {
                return Err(ConfigError(format!(
                    "{key}: the name {:?} is taken by an earlier source: give each a distinct name=",
                    source.name
                )));
            }
            sources.push(source);
        }
        Ok(sources)
    }
}

/// One entry (`key` names it in a refusal; `position` gives its default name):
/// `name=` taken out, the rest parsed as `database.url` is.
pub(crate) fn source(
    key: &str,
    raw: &str,
    position: usize,
    db: &DatabaseSettings,
) -> Result<OutboxSource, ConfigError> {
    let fail = |why: &str| ConfigError(format!("{key} {} {why}", redact_url(raw)));
    if !(raw.starts_with("postgres://") || raw.starts_with("postgresql://")) {
        return Err(fail("is not a postgres:// URL"));
    }
    let mut url = url::Url::parse(raw).map_err(|_| fail("is not a valid URL"))?;
    let mut name = None;
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter_map(|(k, v)| match &*k {
            "name" => {
                name = Some(v.into_owned());
                None
            }
            _ => Some((k.into_owned(), v.into_owned())),
        })
        .collect();
    let name = name.unwrap_or_else(|| format!("source{position}"));
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    if name.is_empty() || name.len() > 40 || !name.chars().all(allowed) {
        return Err(fail(
            "has a name= that is not 1 to 40 letters, digits, '.', '_' or '-'",
        ));
    }
    if kept.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(kept);
    }
    let plan = database_plan(url.as_str(), db.allow_plaintext, db.ca_file())
        .map_err(|e| ConfigError(e.0.replace("database.url", key)))?;
    Ok(OutboxSource {
        name,
        shown: redact_url(url.as_str()),
        plan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(urls: &[&str]) -> Result<Vec<OutboxSource>, ConfigError> {
        let settings = OutboxSettings {
            sources: urls
                .iter()
                .map(|u| SecretString::from(u.to_string()))
                .collect(),
            ..OutboxSettings::default()
        };
        settings.parse_sources(&DatabaseSettings::default())
    }

    #[test]
    fn names_come_from_name_or_the_position_and_never_reach_the_driver() {
        let sources = parse(&[
            "postgres://app:s3cret@127.0.0.1/shop?name=shop&application_name=x",
            "postgres://127.0.0.1/billing",
        ])
        .unwrap();
        assert_eq!(sources[0].name, "shop");
        assert_eq!(sources[1].name, "source2");
        assert!(!sources[0].shown.contains("s3cret"), "{}", sources[0].shown);
        assert!(
            !sources[0].shown.contains("name=shop"),
            "{}",
            sources[0].shown
        );
        assert_eq!(sources[0].plan.config.get_dbname(), Some("shop"));
    }

    #[test]
    fn a_bad_source_is_refused_with_its_key_and_without_its_password() {
        let error = parse(&["postgres://app:s3cret@db.example.com/shop"]).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("outbox.sources[0]"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let error = parse(&[
            "postgres://127.0.0.1/a?name=x",
            "postgres://127.0.0.1/b?name=x",
        ])
        .unwrap_err();
        assert!(error.to_string().contains("taken"), "{error}");
        let error = parse(&["amqp://h/a"]).unwrap_err();
        assert!(error.to_string().contains("postgres://"), "{error}");
    }

    #[test]
    fn the_relay_and_per_producer_keys_are_refused_together() {
        let env: std::collections::HashMap<String, String> = [
            ("POSTIE__OUTBOX__SOURCES", "postgres://127.0.0.1/shop"),
            ("POSTIE__WORKER__KEY_NAMESPACE", "user_id"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let error = crate::config::Settings::load_from(None, Some(env)).unwrap_err();
        assert!(
            error.to_string().contains("outbox.sources cannot be used"),
            "{error}"
        );
    }

    #[test]
    fn the_bounds_are_refused_with_their_key() {
        let db = DatabaseSettings::default();
        for (batch_size, poll_interval, key) in [
            (0, Duration::from_secs(1), "outbox.batch_size"),
            (10_001, Duration::from_secs(1), "outbox.batch_size"),
            (500, Duration::from_millis(1), "outbox.poll_interval"),
            (500, Duration::from_secs(7200), "outbox.poll_interval"),
        ] {
            let settings = OutboxSettings {
                batch_size,
                poll_interval,
                ..OutboxSettings::default()
            };
            let error = settings.parse_sources(&db).unwrap_err();
            assert!(error.to_string().contains(key), "{error}");
        }
        assert!(OutboxSettings::default()
            .parse_sources(&db)
            .unwrap()
            .is_empty());
    }
}
