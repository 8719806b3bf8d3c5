//! Typed settings, loaded in layers: built-in defaults, then an optional file
//! (`--config` / `POSTIE_CONFIG`), then `POSTIE__SECTION__KEY` environment variables.
//!
//! Connection URLs may carry passwords, so they are kept as [`SecretString`] and only
//! ever shown through [`redact_url`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer};

pub use crate::delay::DelayMode;

/// Everything postie can be told.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// RabbitMQ.
    pub amqp: AmqpSettings,
    /// PostgreSQL.
    pub database: DatabaseSettings,
    /// SMTP (or the `.eml` file transport).
    pub smtp: SmtpSettings,
    /// Exchange and queue names and arguments.
    pub topology: TopologySettings,
    /// The consumer and the unit of work.
    pub worker: WorkerSettings,
    /// How `x-delay` is honoured.
    pub delay: DelaySettings,
    /// The HTTP endpoint (metrics and health).
    pub http: HttpSettings,
    /// Logging.
    pub log: LogSettings,
    /// OpenTelemetry trace export.
    pub otel: OtelSettings,
}

/// RabbitMQ connection and consumer settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSettings {
    /// `amqp://user:pass@host:port/vhost` or `amqps://…`.
    pub url: SecretString,
    /// Unacked deliveries the broker may push to one instance.
    pub prefetch: u16,
    /// How long a connection attempt may take.
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
}

impl Default for AmqpSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("amqp://guest:guest@127.0.0.1:5672/%2f"),
            prefetch: 64,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// PostgreSQL settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// `postgres://user:pass@host:port/db` (key=value strings work too).
    pub url: SecretString,
    /// Connections in the pool.
    pub pool_size: usize,
    /// Apply the migrations in `sql/` at start-up.
    pub migrate_on_start: bool,
    /// How long to wait for a pooled connection or a new one.
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("postgres://postgres@127.0.0.1:5432/postgres"),
            pool_size: 16,
            migrate_on_start: true,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// SMTP settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SmtpSettings {
    /// `smtp://host:port` (plaintext, optionally `?tls=required` for STARTTLS),
    /// `smtps://host:port` (implicit TLS), or `file:///dir` to write `.eml` files.
    pub url: SecretString,
    /// Pooled SMTP connections.
    pub pool_size: u32,
    /// The whole send of one email must finish within this; keep it well inside the lease.
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
    /// `From` for jobs that carry none.
    pub default_from: Option<String>,
    /// The right-hand side of the Message-ID derived from each job's key.
    pub message_id_domain: String,
    /// Consecutive failures to reach the relay that open the circuit breaker
    /// (consumption pauses until the relay answers).
    pub breaker_threshold: u32,
}

impl Default for SmtpSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("smtp://127.0.0.1:1025"),
            pool_size: 16,
            timeout: Duration::from_secs(20),
            default_from: None,
            message_id_domain: "postie.local".into(),
            breaker_threshold: 5,
        }
    }
}

/// Names and arguments of the broker objects.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopologySettings {
    /// Prefix of every exchange and queue name (`postie` → `postie.send`, …).
    pub prefix: String,
    /// Backoff steps: retry queue `n` holds a failed job for `retry_steps[n]`.
    /// A job gets `retry_steps.len() + 1` attempts before it is dead-lettered.
    #[serde(deserialize_with = "durations")]
    pub retry_steps: Vec<Duration>,
    /// Broker-side safety net: deliveries of one message before the broker itself
    /// dead-letters it (counts redeliveries after crashes and connection losses).
    pub delivery_limit: u32,
}

impl Default for TopologySettings {
    fn default() -> Self {
        Self {
            prefix: "postie".into(),
            retry_steps: [5, 30, 120, 600, 3600]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
            delivery_limit: 50,
        }
    }
}

/// The consumer and the unit of work.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Deliveries processed at the same time by one instance.
    pub concurrency: usize,
    /// How long a claim is exclusive. Another instance takes a job over only after
    /// the lease has expired, so it must be well above `smtp.timeout`.
    #[serde(deserialize_with = "duration")]
    pub lease: Duration,
    /// Largest accepted message body, in bytes.
    pub max_body_bytes: usize,
    /// Name of this instance in the inbox `owner` column (default: host-pid-random).
    pub instance_id: Option<String>,
    /// Largest wait between tries while a dependency is down.
    #[serde(deserialize_with = "duration")]
    pub outage_backoff_max: Duration,
    /// On SIGTERM: how long in-flight deliveries get to finish before they are
    /// handed back to the broker unacked.
    #[serde(deserialize_with = "duration")]
    pub drain_timeout: Duration,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            concurrency: 32,
            lease: Duration::from_secs(60),
            max_body_bytes: 512 * 1024,
            instance_id: None,
            outage_backoff_max: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Delays: plugin or ladder mode.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DelaySettings {
    /// `auto`, `plugin` or `ladder` (see README, "Delays").
    pub mode: DelayMode,
    /// Ladder mode: the unit of the TTL cascade. Smaller means more levels; the
    /// worker waits out the last sub-unit rest, so this is not the lateness.
    #[serde(deserialize_with = "duration")]
    pub resolution: Duration,
    /// Ladder mode: the longest accepted `x-delay`; longer jobs are dead-lettered.
    /// (Plugin mode: the plugin's 2^32-1 ms.)
    #[serde(deserialize_with = "duration")]
    pub max: Duration,
    /// Ladder mode: intake deliveries relayed at once per instance (and its prefetch).
    pub relay_concurrency: u16,
}

impl Default for DelaySettings {
    fn default() -> Self {
        Self {
            mode: DelayMode::Auto,
            resolution: Duration::from_millis(100),
            max: Duration::from_secs(366 * 86_400),
            relay_concurrency: 64,
        }
    }
}

/// HTTP endpoint settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// Where `/metrics`, `/healthz` and `/readyz` listen; empty to disable.
    #[serde(deserialize_with = "optional_addr")]
    pub listen: Option<SocketAddr>,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 9090))),
        }
    }
}

/// Log output.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    /// `human` for development, `json` for production.
    pub format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `postie=debug,lapin=warn`. `RUST_LOG` wins.
    /// lapin is off by default: it logs the probe's expected 503 and every
    /// connection loss as errors, which postie already reports in its own words.
    pub filter: String,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            filter: "info,lapin=off,tokio_postgres=warn".into(),
        }
    }
}

/// OpenTelemetry: spans per delivery exported over OTLP/HTTP.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OtelSettings {
    /// OTLP/HTTP traces endpoint, e.g. `http://127.0.0.1:4318/v1/traces`; unset = off.
    pub endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
}

impl Default for OtelSettings {
    fn default() -> Self {
        Self {
            endpoint: None,
            service_name: "postie".into(),
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Coloured, one line per event.
    Human,
    /// One JSON object per line.
    Json,
}

/// A configuration problem, worded for one line on stderr.
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct ConfigError(String);

impl Settings {
    /// Loads defaults, then `file` (if any), then the `POSTIE__…` environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_from(file, None)
    }

    /// Like [`Settings::load`], with `env` standing in for the process environment
    /// when given (tests run many configurations in one process).
    pub fn load_from(
        file: Option<&Path>,
        env: Option<std::collections::HashMap<String, String>>,
    ) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            builder = builder.add_source(config::File::from(path));
        }
        builder = builder.add_source(
            config::Environment::with_prefix("POSTIE")
                .prefix_separator("__")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("topology.retry_steps")
                .try_parsing(true)
                .source(env),
        );
        let settings: Settings = builder
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| ConfigError(e.to_string()))?;
        settings.validate()?;
        Ok(settings)
    }

    /// Cross-field checks the types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError(m));
        if self.topology.prefix.is_empty()
            || !self
                .topology
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return fail(format!(
                "topology.prefix {:?} must be non-empty ASCII letters, digits, '.', '_' or '-'",
                self.topology.prefix
            ));
        }
        if self.topology.retry_steps.iter().any(|d| d.is_zero()) {
            return fail("topology.retry_steps must all be above zero".into());
        }
        if self.delay.resolution.is_zero() || self.delay.max < self.delay.resolution {
            return fail("delay.resolution must be above zero and below delay.max".into());
        }
        if self.delay.relay_concurrency == 0 {
            return fail("delay.relay_concurrency must be at least 1".into());
        }
        if self.worker.concurrency == 0 || self.amqp.prefetch == 0 {
            return fail("worker.concurrency and amqp.prefetch must be at least 1".into());
        }
        if self.worker.lease < self.smtp.timeout * 2 {
            return fail(format!(
                "worker.lease ({}) must be at least twice smtp.timeout ({})",
                humantime::format_duration(self.worker.lease),
                humantime::format_duration(self.smtp.timeout)
            ));
        }
        for (name, url) in [("amqp.url", &self.amqp.url), ("smtp.url", &self.smtp.url)] {
            if let Err(e) = url::Url::parse(url.expose_secret()) {
                return fail(format!(
                    "{name} {} is not a URL: {e}",
                    redact_url(url.expose_secret())
                ));
            }
        }
        Ok(())
    }

    /// This instance's name in the inbox `owner` column.
    pub fn instance_id(&self) -> String {
        self.worker.instance_id.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "postie".into());
            let random = uuid::Uuid::new_v4().simple().to_string();
            format!("{host}-{}-{}", std::process::id(), &random[..8])
        })
    }
}

/// A URL with its password (and any `password=` query or key=value part) replaced by `***`.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(mut url) if url.password().is_some() => {
            let _ = url.set_password(Some("***"));
            url.to_string()
        }
        Ok(url) => url.to_string(),
        // libpq key=value strings: hide the value of password=…
        Err(_) => raw
            .split_whitespace()
            .map(|part| {
                if part.to_ascii_lowercase().starts_with("password=") {
                    "password=***"
                } else {
                    part
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text)
        .map_err(|e| serde::de::Error::custom(format!("{text:?} is not a duration like 5s: {e}")))
}

fn optional_addr<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = Option::<String>::deserialize(d)?.unwrap_or_default();
    if text.trim().is_empty() {
        return Ok(None);
    }
    text.trim()
        .parse()
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{text:?} is not an address like 127.0.0.1:9090: {e}")))
}

fn durations<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|text| {
            humantime::parse_duration(text).map_err(|e| {
                serde::de::Error::custom(format!("{text:?} is not a duration like 5s: {e}"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_in_urls_and_key_value_strings() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            redact_url("host=db user=app password=s3cret"),
            "host=db user=app password=***"
        );
        assert_eq!(redact_url("smtp://127.0.0.1:1025"), "smtp://127.0.0.1:1025");
    }

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().expect("defaults validate");
    }

    #[test]
    fn environment_overrides_defaults_and_parses_lists() {
        let env = [
            ("POSTIE__TOPOLOGY__RETRY_STEPS", "1s,2m"),
            ("POSTIE__AMQP__PREFETCH", "7"),
            ("POSTIE__HTTP__LISTEN", ""),
            ("POSTIE__SMTP__URL", "file:///tmp/x"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(
            s.topology.retry_steps,
            [Duration::from_secs(1), Duration::from_secs(120)]
        );
        assert_eq!(s.amqp.prefetch, 7);
        assert_eq!(s.http.listen, None);
    }

    #[test]
    fn bad_values_and_unknown_keys_fail_with_the_key_named() {
        for (key, value, expected) in [
            ("POSTIE__SMTP__TIMEOUT", "soon", "smtp.timeout"),
            ("POSTIE__AMQP__PREFETCH", "lots", "amqp.prefetch"),
            ("POSTIE__AMQP__PREFECH", "5", "prefech"),
        ] {
            let env = [(key.to_string(), value.to_string())].into_iter().collect();
            let err = Settings::load_from(None, Some(env)).unwrap_err().to_string();
            assert!(err.contains(expected), "{key}: {err}");
        }
    }

    #[test]
    fn lease_must_exceed_smtp_timeout() {
        let mut s = Settings::default();
        s.worker.lease = Duration::from_secs(10);
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("worker.lease"), "{err}");
    }
}
