//! Typed settings, loaded in layers: built-in defaults, then an optional file
//! (`--config` / `POSTIE_CONFIG`), then `POSTIE__SECTION__KEY` environment variables.
//!
//! Connection URLs may carry passwords, so they are kept as [`SecretString`] and only
//! ever shown through [`redact_url`].

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
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
    /// Per-type anti-spam throttles, keyed by the job's `type` (none by default).
    pub throttle: std::collections::BTreeMap<String, ThrottleRule>,
}

/// At most `limit` emails of one type per recipient per `window`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottleRule {
    /// Emails allowed per recipient per window.
    pub limit: u32,
    /// The sliding window.
    #[serde(deserialize_with = "duration")]
    pub window: Duration,
    /// What to do with one over the limit.
    pub policy: ThrottlePolicy,
}

/// What happens to a job over its throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThrottlePolicy {
    /// Record it as `throttled` and ack: never sent.
    Drop,
    /// Send it when the window allows (never early).
    Defer,
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
            prefetch: 128,
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
    /// Accept an unencrypted connection to a host that is not this machine (`sslmode`
    /// absent, `disable` or `prefer`). Off: postie refuses to start instead.
    pub allow_plaintext: bool,
    /// PEM file of CA certificates to trust for the server's certificate, on top of the
    /// system's roots (`sslmode=verify-ca` trusts these alone).
    pub ca_file: Option<PathBuf>,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("postgres://postgres@127.0.0.1:5432/postgres"),
            pool_size: 16,
            migrate_on_start: true,
            connect_timeout: Duration::from_secs(5),
            allow_plaintext: false,
            ca_file: None,
        }
    }
}

impl DatabaseSettings {
    /// `ca_file`, unless unset or empty.
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca_file
            .as_deref()
            .filter(|path| !path.as_os_str().is_empty())
    }
}

/// SMTP settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SmtpSettings {
    /// `smtp://host:port` (STARTTLS required, except to this machine; `?tls=none`,
    /// `?tls=opportunistic` or `?tls=required` to choose), `smtps://host:port`
    /// (implicit TLS), or `file:///dir` to write `.eml` files. See [`smtp_endpoint`].
    pub url: SecretString,
    /// Pooled SMTP connections.
    pub pool_size: u32,
    /// Longest wait for the relay on any one SMTP step (connect, each command and
    /// reply). A send takes a handful of steps, so keep the lease several times longer.
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
            concurrency: 64,
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
    /// Ladder mode: record each scheduled job in the inbox, for `postie pending`
    /// and the pending gauge (one upsert per job).
    pub track_pending: bool,
}

impl Default for DelaySettings {
    fn default() -> Self {
        Self {
            mode: DelayMode::Auto,
            resolution: Duration::from_millis(100),
            max: Duration::from_secs(366 * 86_400),
            relay_concurrency: 64,
            track_pending: true,
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
        for (kind, rule) in &self.throttle {
            if rule.limit == 0 || rule.window.is_zero() {
                return fail(format!(
                    "throttle.{kind}: limit and window must be above zero"
                ));
            }
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
        // The transport rules, checked here so that a refusal comes before any connection.
        smtp_endpoint(self.smtp.url.expose_secret())?;
        if let Some(path) = self.database.ca_file() {
            if !path.is_file() {
                return fail(format!(
                    "database.ca_file {} is not a readable file",
                    path.display()
                ));
            }
        }
        database_plan(
            self.database.url.expose_secret(),
            self.database.allow_plaintext,
            self.database.ca_file(),
        )?;
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

/// True if `host` is this machine: an address in 127.0.0.0/8, `::1` (bracketed or not,
/// or IPv4-mapped), the name `localhost`, or a Unix socket directory (an absolute path).
/// Any other name counts as remote, even one that happens to resolve to a loopback
/// address: the decision must not depend on DNS.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim();
    if host.starts_with('/') {
        return true;
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let bare = bare.strip_suffix('.').unwrap_or(bare);
    if bare.eq_ignore_ascii_case("localhost") {
        return true;
    }
    bare.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// How postie protects its PostgreSQL connections, from `sslmode` in `database.url`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbTls {
    /// No TLS: `sslmode` absent, `disable` or `prefer` (postie never negotiates TLS
    /// it does not verify). Only to this machine, or with `database.allow_plaintext`.
    Off,
    /// TLS, with the certificate chain (system roots plus `database.ca_file`) and the
    /// host name verified: `sslmode=require` and `sslmode=verify-full`.
    VerifyFull,
    /// TLS, with the chain verified against `database.ca_file` alone and the host name
    /// not checked: `sslmode=verify-ca`.
    VerifyCa,
}

/// `database.url` parsed for tokio-postgres, and how to protect the connections.
pub struct DbPlan {
    /// The connection settings, `sslmode` already applied (`Disable` or `Require`).
    pub config: tokio_postgres::Config,
    /// TLS, and what is verified.
    pub tls: DbTls,
}

/// Parses `database.url` (URL or key=value) and decides on TLS.
///
/// `sslmode` is read by postie itself, because tokio-postgres knows neither
/// `verify-ca` nor `verify-full`. Without TLS (`sslmode` absent, `disable` or
/// `prefer`) every host must be this machine (see [`is_loopback_host`]) unless
/// `allow_plaintext`; otherwise this returns the one-line refusal. It never connects.
pub fn database_plan(
    url: &str,
    allow_plaintext: bool,
    ca_file: Option<&Path>,
) -> Result<DbPlan, ConfigError> {
    let (rewritten, sslmode) = split_sslmode(url);
    let tls = match sslmode.as_deref() {
        None | Some("disable") | Some("prefer") => DbTls::Off,
        Some("require") | Some("verify-full") => DbTls::VerifyFull,
        Some("verify-ca") => DbTls::VerifyCa,
        Some(other) => {
            return Err(ConfigError(format!(
                "database.url has sslmode={other}, which postie does not support: \
                 use disable, prefer, require, verify-ca or verify-full"
            )))
        }
    };
    let mut config = tokio_postgres::Config::from_str(&rewritten).map_err(|e| {
        ConfigError(format!(
            "database.url {} is not valid: {e}",
            redact_url(url)
        ))
    })?;
    match tls {
        DbTls::Off => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            if let Some(host) = remote_database_host(&config) {
                if !allow_plaintext {
                    return Err(ConfigError(format!(
                        "database.url points at {host} without sslmode=require: the database \
                         password and every job's recipients would cross the network \
                         unencrypted; set sslmode=require (or verify-full), or \
                         database.allow_plaintext = true to accept the risk"
                    )));
                }
            }
        }
        DbTls::VerifyCa if ca_file.is_none() => {
            return Err(ConfigError(
                "database.url has sslmode=verify-ca, which checks the certificate chain but \
                 not the host name, so against the system's roots any publicly issued \
                 certificate would pass: set database.ca_file to the CA that signs the \
                 server's certificate, or use sslmode=verify-full"
                    .into(),
            ))
        }
        DbTls::VerifyFull | DbTls::VerifyCa => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
        }
    }
    Ok(DbPlan { config, tls })
}

/// The first host (or `hostaddr`, which is where tokio-postgres connects when given)
/// that is not this machine.
fn remote_database_host(config: &tokio_postgres::Config) -> Option<String> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    (0..hosts.len().max(addrs.len())).find_map(|i| match (addrs.get(i), hosts.get(i)) {
        (Some(addr), _) => (!addr.to_canonical().is_loopback()).then(|| addr.to_string()),
        (None, Some(tokio_postgres::config::Host::Tcp(host))) => {
            (!is_loopback_host(host)).then(|| host.clone())
        }
        #[cfg(unix)]
        (None, Some(tokio_postgres::config::Host::Unix(_))) => None,
        (None, None) => None,
    })
}

/// Finds `sslmode` in a PostgreSQL URL or key=value string. Returns the string with
/// `verify-ca` and `verify-full` replaced by `require` (all tokio-postgres can parse),
/// and the mode as written, lower-cased (the last one wins, as in libpq).
fn split_sslmode(raw: &str) -> (String, Option<String>) {
    let is_url = ["postgres://", "postgresql://"]
        .iter()
        .any(|prefix| raw.starts_with(prefix));
    if is_url {
        let Some((base, query)) = raw.split_once('?') else {
            return (raw.to_string(), None);
        };
        let mut mode = None;
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                if key != "sslmode" {
                    return pair.to_string();
                }
                let value = percent_decode(value).to_ascii_lowercase();
                let verify = value.starts_with("verify-");
                mode = Some(value);
                if verify {
                    "sslmode=require".to_string()
                } else {
                    pair.to_string()
                }
            })
            .collect();
        return (format!("{base}?{}", pairs.join("&")), mode);
    }
    // key=value: `key = value` or `key = 'quoted \' value'`, separated by whitespace.
    let mut out = String::with_capacity(raw.len());
    let mut mode = None;
    let mut rest = raw;
    let copy_space = |rest: &mut &str, out: &mut String| {
        let trimmed = rest.trim_start();
        out.push_str(&rest[..rest.len() - trimmed.len()]);
        *rest = trimmed;
    };
    loop {
        copy_space(&mut rest, &mut out);
        if rest.is_empty() {
            break;
        }
        let key_end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let key = &rest[..key_end];
        out.push_str(key);
        rest = &rest[key_end..];
        copy_space(&mut rest, &mut out);
        let Some(after) = rest.strip_prefix('=') else {
            // Malformed: leave it to tokio-postgres to say so.
            out.push_str(rest);
            break;
        };
        out.push('=');
        rest = after;
        copy_space(&mut rest, &mut out);
        let (len, value) = scan_value(rest);
        if key == "sslmode" {
            let value = value.to_ascii_lowercase();
            out.push_str(if value.starts_with("verify-") {
                "require"
            } else {
                &rest[..len]
            });
            mode = Some(value);
        } else {
            out.push_str(&rest[..len]);
        }
        rest = &rest[len..];
    }
    (out, mode)
}

/// One key=value value at the start of `s`: its length as written and its unescaped text.
fn scan_value(s: &str) -> (usize, String) {
    let mut value = String::new();
    let mut chars = s.char_indices();
    if s.starts_with('\'') {
        chars.next();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| c)),
                '\'' => return (i + 1, value),
                c => value.push(c),
            }
        }
        return (s.len(), value);
    }
    while let Some((i, c)) = chars.next() {
        match c {
            c if c.is_whitespace() => return (i, value),
            '\\' => value.extend(chars.next().map(|(_, c)| c)),
            c => value.push(c),
        }
    }
    (s.len(), value)
}

/// `%XX` escapes decoded (and nothing else: `+` stays `+`).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How postie talks to the SMTP relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpSecurity {
    /// No TLS: `tls=none`, or `smtp://` to this machine without `tls=`.
    Plaintext,
    /// STARTTLS, and no email or credentials unless it succeeds (the default for
    /// `smtp://` to any other host).
    StartTlsRequired,
    /// STARTTLS if the server offers it (`tls=opportunistic`): a man in the middle can
    /// strip it.
    StartTlsOpportunistic,
    /// TLS from the first byte (`smtps://`).
    ImplicitTls,
}

/// `smtp.url` taken apart. Credentials stay secret; `Debug` shows none.
#[derive(Debug, Clone)]
pub struct SmtpEndpoint {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port: as given, else 465 for `smtps://`, 587 for an explicit `tls=required` or
    /// `tls=opportunistic`, and 25 otherwise.
    pub port: u16,
    /// TLS.
    pub security: SmtpSecurity,
    /// The EHLO name, from the URL's path (`smtp://host/ehlo.name`).
    pub hello_name: Option<String>,
    /// User name and password, percent-decoded, when the URL has a password.
    pub credentials: Option<(String, SecretString)>,
}

/// Takes `smtp.url` apart and decides on TLS: `None` for `file://`.
///
/// `smtp://` without `tls=` means STARTTLS required, except to this machine (see
/// [`is_loopback_host`]), where local relays such as Mailpit speak plaintext. Plaintext
/// to another host needs an explicit `tls=none`. `smtps://` is implicit TLS.
pub fn smtp_endpoint(raw: &str) -> Result<Option<SmtpEndpoint>, ConfigError> {
    if raw.starts_with("file://") {
        return Ok(None);
    }
    let fail = |why: &str| ConfigError(format!("smtp.url {} {why}", redact_url(raw)));
    let url = url::Url::parse(raw).map_err(|e| fail(&format!("is not a URL: {e}")))?;
    let host = match url.host() {
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        Some(host) => host.to_string(),
        None => return Err(fail("names no host")),
    };
    if host.is_empty() {
        return Err(fail("names no host"));
    }
    let tls = url
        .query_pairs()
        .filter(|(k, _)| k == "tls")
        .last()
        .map(|(_, v)| v.to_ascii_lowercase());
    let (security, default_port) = match (url.scheme(), tls.as_deref()) {
        ("smtp", None) if is_loopback_host(&host) => (SmtpSecurity::Plaintext, 25),
        ("smtp", None) => (SmtpSecurity::StartTlsRequired, 25),
        ("smtp", Some("none")) => (SmtpSecurity::Plaintext, 25),
        ("smtp", Some("required")) => (SmtpSecurity::StartTlsRequired, 587),
        ("smtp", Some("opportunistic")) => (SmtpSecurity::StartTlsOpportunistic, 587),
        ("smtps", None | Some("required")) => (SmtpSecurity::ImplicitTls, 465),
        ("smtp" | "smtps", Some(other)) => {
            return Err(fail(&format!(
                "has tls={other}: use tls=required, tls=opportunistic or tls=none with \
                 smtp://, and no tls= with smtps://"
            )))
        }
        _ => return Err(fail("must start with smtp://, smtps:// or file://")),
    };
    let credentials = url.password().map(|password| {
        (
            percent_decode(url.username()),
            SecretString::from(percent_decode(password)),
        )
    });
    let path = url.path().trim_matches('/');
    Ok(Some(SmtpEndpoint {
        host,
        port: url.port().unwrap_or(default_port),
        security,
        hello_name: (!path.is_empty()).then(|| path.to_string()),
        credentials,
    }))
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
    text.trim().parse().map(Some).map_err(|e| {
        serde::de::Error::custom(format!(
            "{text:?} is not an address like 127.0.0.1:9090: {e}"
        ))
    })
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
            let err = Settings::load_from(None, Some(env))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{key}: {err}");
        }
    }

    #[test]
    fn throttles_are_read_per_type_from_the_environment() {
        let env = [
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__LIMIT", "2"),
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__WINDOW", "1h"),
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__POLICY", "defer"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = Settings::load_from(None, Some(env)).unwrap();
        let rule = &s.throttle["order_confirmation"];
        assert_eq!(
            (rule.limit, rule.window, rule.policy),
            (2, Duration::from_secs(3600), ThrottlePolicy::Defer)
        );
    }

    #[test]
    fn lease_must_exceed_smtp_timeout() {
        let mut s = Settings::default();
        s.worker.lease = Duration::from_secs(10);
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("worker.lease"), "{err}");
    }

    #[test]
    fn loopback_hosts_are_told_apart_without_dns() {
        for (host, local) in [
            ("127.0.0.1", true),
            ("127.5.5.5", true),
            ("127.255.255.254", true),
            ("::1", true),
            ("[::1]", true),
            ("::ffff:127.0.0.1", true),
            ("localhost", true),
            ("LocalHost", true),
            ("localhost.", true),
            ("/var/run/postgresql", true),
            ("/tmp", true),
            ("db.internal", false),
            ("10.0.0.5", false),
            ("192.168.1.10", false),
            ("128.0.0.1", false),
            ("0.0.0.0", false),
            ("::", false),
            ("fe80::1", false),
            ("localhost.example.com", false),
            ("db.localhost", false),
            ("127.0.0.1.example.com", false),
            ("", false),
        ] {
            assert_eq!(is_loopback_host(host), local, "{host:?}");
        }
    }

    /// The decision for one `database.url`: the TLS mode, or a refusal's first words.
    fn db_decision(
        url: &str,
        allow_plaintext: bool,
        ca_file: Option<&str>,
    ) -> Result<DbTls, String> {
        database_plan(url, allow_plaintext, ca_file.map(Path::new))
            .map(|plan| plan.tls)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn database_tls_follows_sslmode_and_refuses_plaintext_off_the_machine() {
        const REFUSED: &str = "without sslmode=require";
        for host in [
            "127.0.0.1",
            "127.5.5.5",
            "[::1]",
            "localhost",
            "%2Fvar%2Frun%2Fpostgresql",
            "db.internal",
            "10.0.0.5",
        ] {
            let local = !matches!(host, "db.internal" | "10.0.0.5");
            let url = |query: &str| format!("postgres://app:pw@{host}:5432/app{query}");
            for (query, allow, expected) in [
                ("", false, if local { Ok(DbTls::Off) } else { Err(REFUSED) }),
                (
                    "?sslmode=disable",
                    false,
                    if local { Ok(DbTls::Off) } else { Err(REFUSED) },
                ),
                (
                    "?sslmode=prefer",
                    false,
                    if local { Ok(DbTls::Off) } else { Err(REFUSED) },
                ),
                ("", true, Ok(DbTls::Off)),
                ("?sslmode=prefer", true, Ok(DbTls::Off)),
                ("?sslmode=require", false, Ok(DbTls::VerifyFull)),
                ("?sslmode=verify-full", false, Ok(DbTls::VerifyFull)),
                (
                    "?application_name=x&sslmode=VERIFY-FULL",
                    false,
                    Ok(DbTls::VerifyFull),
                ),
                ("?sslmode=verify-ca", false, Err("database.ca_file")),
                ("?sslmode=allow", false, Err("sslmode=allow")),
            ] {
                let url = url(query);
                let got = db_decision(&url, allow, None);
                match expected {
                    Ok(tls) => assert_eq!(got, Ok(tls), "{url} allow={allow}"),
                    Err(words) => {
                        let err = got.expect_err(&url);
                        assert!(err.contains(words), "{url}: {err}");
                        assert!(!err.contains(":pw@"), "{url}: {err}");
                    }
                }
            }
        }
        assert_eq!(
            db_decision(
                "postgres://app:pw@db.internal/app?sslmode=verify-ca",
                false,
                Some("/ca.pem")
            ),
            Ok(DbTls::VerifyCa)
        );
    }

    #[test]
    fn database_refusal_is_one_line_naming_the_host_and_the_ways_out() {
        let err = db_decision(
            "postgres://postie:s3cr3t@db.example.invalid:5432/x",
            false,
            None,
        )
        .unwrap_err();
        assert!(
            err.starts_with(
                "configuration error: database.url points at db.example.invalid without sslmode=require: "
            ),
            "{err}"
        );
        assert!(err.contains("set sslmode=require (or verify-full), or database.allow_plaintext = true to accept the risk"), "{err}");
        assert!(!err.contains('\n') && !err.contains("s3cr3t"), "{err}");
    }

    #[test]
    fn database_hosts_lists_hostaddr_and_key_value_strings_are_all_checked() {
        for (url, expected) in [
            ("host=/var/run/postgresql dbname=x", Ok(DbTls::Off)),
            (
                "host=localhost user=a password='p w' dbname=x",
                Ok(DbTls::Off),
            ),
            ("host=db.internal dbname=x", Err("points at db.internal")),
            (
                "host=db.internal dbname=x sslmode=verify-full",
                Ok(DbTls::VerifyFull),
            ),
            (
                "host=db.internal sslmode = 'verify-full' dbname=x",
                Ok(DbTls::VerifyFull),
            ),
            (
                "host=db.internal password='a sslmode=require' dbname=x",
                Err("points at db.internal"),
            ),
            (
                "host=localhost,db.internal dbname=x",
                Err("points at db.internal"),
            ),
            (
                "postgres://a@localhost,10.0.0.5/x",
                Err("points at 10.0.0.5"),
            ),
            // Where the connection goes is hostaddr, not host.
            (
                "host=localhost hostaddr=10.0.0.5 dbname=x",
                Err("points at 10.0.0.5"),
            ),
            (
                "host=db.internal hostaddr=127.0.0.1 dbname=x",
                Ok(DbTls::Off),
            ),
        ] {
            match (db_decision(url, false, None), expected) {
                (Ok(got), Ok(tls)) => assert_eq!(got, tls, "{url}"),
                (Err(err), Err(words)) => assert!(err.contains(words), "{url}: {err}"),
                (got, _) => panic!("{url}: {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn verify_modes_reach_tokio_postgres_as_require_and_the_rest_is_kept() {
        let plan = database_plan(
            "postgres://u:p%40ss@db.internal:6432/app?sslmode=verify-full&connect_timeout=3",
            false,
            None,
        )
        .unwrap();
        assert_eq!(
            plan.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(plan.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(plan.config.get_ports(), [6432]);
        assert_eq!(plan.config.get_dbname(), Some("app"));
        // prefer is plaintext: postie never negotiates TLS it does not verify.
        let plan = database_plan("host=localhost sslmode=prefer", false, None).unwrap();
        assert_eq!(
            plan.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        let (rewritten, mode) = split_sslmode("host=x password='it\\'s' sslmode=verify-ca");
        assert_eq!(rewritten, "host=x password='it\\'s' sslmode=require");
        assert_eq!(mode.as_deref(), Some("verify-ca"));
    }

    /// `smtp.url` → (TLS, port), or the error's words.
    fn smtp_decision(url: &str) -> Result<(SmtpSecurity, u16), String> {
        smtp_endpoint(url)
            .map(|e| e.map(|e| (e.security, e.port)).expect("not file://"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn smtp_requires_starttls_off_the_machine_unless_told_otherwise() {
        use SmtpSecurity::*;
        for (url, expected) in [
            ("smtp://127.0.0.1:1025", Ok((Plaintext, 1025))),
            ("smtp://127.5.5.5", Ok((Plaintext, 25))),
            ("smtp://[::1]:1025", Ok((Plaintext, 1025))),
            ("smtp://localhost:1025", Ok((Plaintext, 1025))),
            ("smtp://mail.example.com", Ok((StartTlsRequired, 25))),
            ("smtp://10.0.0.5:2525", Ok((StartTlsRequired, 2525))),
            ("smtp://u:p@relay.internal:587", Ok((StartTlsRequired, 587))),
            (
                "smtp://mail.example.com?tls=required",
                Ok((StartTlsRequired, 587)),
            ),
            (
                "smtp://127.0.0.1:1025?tls=required",
                Ok((StartTlsRequired, 1025)),
            ),
            (
                "smtp://mail.example.com?tls=opportunistic",
                Ok((StartTlsOpportunistic, 587)),
            ),
            ("smtp://mail.example.com:25?tls=none", Ok((Plaintext, 25))),
            ("smtp://mail.example.com?tls=NONE", Ok((Plaintext, 25))),
            ("smtps://mail.example.com", Ok((ImplicitTls, 465))),
            ("smtps://u:p@mail.example.com:2465", Ok((ImplicitTls, 2465))),
            ("smtps://mail.example.com?tls=none", Err("tls=none")),
            ("smtp://mail.example.com?tls=yes", Err("tls=yes")),
            ("http://mail.example.com", Err("must start with smtp://")),
            (
                "smtp://u:secret@mail.example.com?tls=maybe",
                Err("smtp://u:***@mail.example.com"),
            ),
        ] {
            match (smtp_decision(url), expected) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{url}"),
                (Err(err), Err(words)) => {
                    assert!(err.contains(words), "{url}: {err}");
                    assert!(!err.contains("secret"), "{url}: {err}");
                }
                (got, _) => panic!("{url}: {got:?}, expected {expected:?}"),
            }
        }
        assert!(smtp_endpoint("file:///tmp/mail").unwrap().is_none());
    }

    #[test]
    fn smtp_credentials_and_ehlo_name_come_from_the_url() {
        let endpoint =
            smtp_endpoint("smtp://us%40er:p%2Bw%3Ad+x@[2001:db8::1]:2525/client.example")
                .unwrap()
                .unwrap();
        assert_eq!(endpoint.host, "2001:db8::1");
        assert_eq!(endpoint.security, SmtpSecurity::StartTlsRequired);
        assert_eq!(endpoint.hello_name.as_deref(), Some("client.example"));
        let (user, password) = endpoint.credentials.clone().unwrap();
        assert_eq!(user, "us@er");
        assert_eq!(password.expose_secret(), "p+w:d+x");
        assert!(!format!("{endpoint:?}").contains("p+w"), "{endpoint:?}");
    }

    #[test]
    fn validate_applies_the_transport_rules() {
        let mut s = Settings::default();
        s.database.url = SecretString::from("postgres://postie:pw@db.internal/postie");
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("database.url points at db.internal"), "{err}");
        s.database.allow_plaintext = true;
        s.validate().expect("allow_plaintext accepts the risk");
        s.database.url =
            SecretString::from("postgres://postie:pw@db.internal/postie?sslmode=verify-ca");
        s.database.ca_file = Some(PathBuf::from("/nonexistent/ca.pem"));
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("database.ca_file /nonexistent/ca.pem"),
            "{err}"
        );
        s.database.ca_file = Some(PathBuf::new());
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("verify-ca"), "{err}");

        let env = [(
            "POSTIE__SMTP__URL",
            "smtp://relay.example.com?tls=sometimes",
        )]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let err = Settings::load_from(None, Some(env))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tls=sometimes"), "{err}");
        let env = [
            ("POSTIE__DATABASE__URL", "postgres://a@10.0.0.5/x"),
            ("POSTIE__DATABASE__ALLOW_PLAINTEXT", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = Settings::load_from(None, Some(env)).expect("escape hatch from the environment");
        assert!(s.database.allow_plaintext);
    }
}
