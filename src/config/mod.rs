//! Typed settings, loaded in layers: built-in defaults, then an optional file
//! (`--config` / `POSTIE_CONFIG`), then `POSTIE__SECTION__KEY` environment variables.
//!
//! Connection URLs may carry passwords, so they are kept as [`SecretString`] and only
//! ever shown through [`redact_url`](crate::endpoint::redact_url).
//!
//! - `validate.rs`: every setting checked once, section by section, returning what
//!   it parsed (`Parsed`: `amqp.url`'s addresses, the transports' `ProviderPlan`s,
//!   `database.url`'s `DbPlan`), which the rest of postie uses instead of the strings.
//! - `amqp.rs` `amqp.url`; `database.rs` `database.url` and its `sslmode`; `smtp.rs`
//!   an SMTP `transport.url`; `provider.rs` a provider API's URL (`ses://`, `sendgrid://`,
//!   `postmark://`, `mailgun://`: region, key from the URL or the environment,
//!   `endpoint=`); `transport.rs` `transport.url` / `transport.providers`, each a
//!   `ProviderPlan` (name, parsed URL, its own rate from `name=`, `rate_limit=`,
//!   `rate_burst=`), and the keys every transport shares (`pool_size`, `timeout`,
//!   `default_from`, `message_id_domain`, `breaker_threshold`, `rate_limit`,
//!   `rate_burst`), their old `smtp.*` names read with one warning each; `rate.rs`
//!   `transport.rate_limit` (`14/s`, `600/m`); `memory.rs` also gives
//!   `delay.relay_prefetch`'s default (what the byte budget leaves); `keys.rs`
//!   (tests) lists every key the structs accept, for the README's reference.
//! - `suppression.rs` the suppression list's settings; `feedback.rs` the feedback
//!   webhooks' (`feedback.listen`, body and time bounds, each provider's key or
//!   credentials, SNS's allow-list, its required topics and `Timestamp` window,
//!   Mailgun's token cap, `feedback.trust_unmatched`: the sources whose unmatched
//!   notices still suppress); `events.rs` the delivery events' (`events.*`);
//!   `unsubscribe.rs` one-click unsubscribe's (`unsubscribe.*`: the link's base, the
//!   mailto address, the signing keys and their grace); `attachments.rs` the
//!   attachments' (`attachments.*`: the contract's limits, `url_hosts`, the
//!   fetcher's bounds, the spool and its byte budget).
//! - `outbox.rs` the outbox relay's: `outbox.sources` (each URL's `name=` taken out,
//!   parsed as `database.url` is, under its TLS rules), `outbox.batch_size`,
//!   `poll_interval`, `listen`.
//! - `lanes.rs` the lanes (`topology.lanes`: weight, optional cap, optional tenant
//!   cap, optional send window and its zone; `topology.default_lane`) and what makes a
//!   lane name; `window.rs` a send window's days and hours (`Window`); `memory.rs` each lane's
//!   prefetch from `worker.inflight_bytes` ÷ `max_body_bytes`; `throttle.rs` a job
//!   type's throttle (`worker.throttles`).
//! - `console.rs` the console's (`console.*`: its pages' bounds, `session_ttl`,
//!   `max_sessions`, `sign_in_clients`).
//! - `sections.rs` and `observe.rs` document every field (`observe.rs`: `http.*`,
//!   with every HTTP listener's bounds `max_connections`, `header_timeout`,
//!   `request_timeout`; `log.*`, `otel.*`); `de.rs` reads durations.

use std::path::Path;
#[cfg(test)]
use std::path::PathBuf;
#[cfg(test)]
use std::time::Duration;

use secrecy::ExposeSecret;
#[cfg(test)]
use secrecy::SecretString;
use serde::Deserialize;

mod amqp;
mod attachments;
mod console;
mod database;
mod de;
mod events;
mod feedback;
#[cfg(test)]
mod keys;
mod lanes;
mod memory;
mod observe;
mod outbox;
mod provider;
mod rate;
mod sections;
mod smtp;
mod suppression;
mod throttle;
mod transport;
mod unsubscribe;
mod validate;
mod window;

pub use amqp::{AmqpAddress, AmqpAddresses};
pub use attachments::{AttachmentSettings, S3Settings, DEFAULT_MAX_BYTES, DEFAULT_MAX_COUNT};
pub(crate) use console::ConsoleSettings;
pub(crate) use database::{database_plan, DbPlan, DbTls};
pub use events::EventsSettings;
pub use feedback::{
    FeedbackSettings, MailgunSettings, PostmarkSettings, SendgridSettings, SnsSettings,
};
pub(crate) use lanes::is_lane_name;
pub use lanes::LaneSettings;
pub(crate) use memory::Prefetch;
pub(crate) use observe::{HttpSettings, LogFormat, LogSettings, OtelSettings};
pub(crate) use outbox::source as outbox_source;
pub use outbox::{OutboxSettings, OutboxSource};
pub(crate) use provider::{ApiEndpoint, ApiProvider};
pub use rate::SendRate;
pub use sections::*;
pub(crate) use smtp::{smtp_endpoint, SmtpEndpoint, SmtpSecurity};
pub use suppression::SuppressionSettings;
pub use throttle::{ThrottlePolicy, ThrottleRule};
pub(crate) use transport::ProviderPlan;
pub use transport::TransportSettings;
pub use unsubscribe::{UnsubscribeKey, UnsubscribeSettings};
pub(crate) use validate::SmtpTransport;
pub use window::Window;

use crate::endpoint::passwords;

/// Everything postie can be told.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// RabbitMQ.
    pub amqp: AmqpSettings,
    /// PostgreSQL.
    pub database: DatabaseSettings,
    /// Where emails go (`transport.url` or `transport.providers`) and what every
    /// transport shares.
    pub transport: TransportSettings,
    /// What only an SMTP relay is told.
    pub smtp: SmtpSettings,
    /// Exchange and queue names and arguments.
    pub topology: TopologySettings,
    /// The consumer and the unit of work.
    pub worker: WorkerSettings,
    /// How `x-delay` is honoured.
    pub delay: DelaySettings,
    /// The HTTP endpoint (metrics and health).
    pub http: HttpSettings,
    /// The operator console.
    pub console: ConsoleSettings,
    /// Logging.
    pub log: LogSettings,
    /// OpenTelemetry trace export.
    pub otel: OtelSettings,
    /// Retention of finished inbox rows and the pruning that enforces it.
    pub inbox: InboxSettings,
    /// The suppression list: hard bounces and what else postie does not send to.
    pub suppression: SuppressionSettings,
    /// The providers' bounce and complaint webhooks (`/feedback/<provider>`; off).
    pub feedback: FeedbackSettings,
    /// Delivery events for the producers (`<p>.events`).
    pub events: EventsSettings,
    /// The producers' transactional outboxes that `serve` relays (`outbox.sources`).
    pub outbox: OutboxSettings,
    /// One-click unsubscribe links (RFC 8058) and their signing keys.
    pub unsubscribe: UnsubscribeSettings,
    /// Attachments: limits, where `url` sources may come from, the spool.
    pub attachments: AttachmentSettings,
    /// Per-type anti-spam throttles, keyed by the job's `type` (none by default).
    pub throttle: std::collections::BTreeMap<String, ThrottleRule>,
    /// The old `smtp.*` names this configuration used (see [`Settings::warnings`]).
    #[serde(skip)]
    old_names: transport::OldNames,
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
                .with_list_parse_key("smtp.throttle_patterns")
                .with_list_parse_key("topology.drain_prefixes")
                .with_list_parse_key("transport.providers")
                .with_list_parse_key("suppression.hard_bounce_codes")
                .with_list_parse_key("feedback.sns.allowed_hosts")
                .with_list_parse_key("feedback.sns.topic_arns")
                .with_list_parse_key("feedback.trust_unmatched")
                .with_list_parse_key("outbox.sources")
                .with_list_parse_key("attachments.url_hosts")
                .with_list_parse_key("attachments.s3.buckets")
                .try_parsing(true)
                .source(env),
        );
        let mut layers = builder.build().map_err(|e| ConfigError(e.to_string()))?;
        let old_names = transport::move_old_smtp_keys(&mut layers.cache)?;
        let as_written = |e: ConfigError| old_names.as_written(e);
        let mut settings: Settings = layers
            .try_deserialize()
            .map_err(|e| as_written(ConfigError(e.to_string())))?;
        settings.validate().map_err(as_written)?;
        settings.old_names = old_names;
        Ok(settings)
    }

    /// One line per old key name the configuration used (`smtp.timeout` for
    /// `transport.timeout`), for the log once it is up: settings load before it.
    pub fn warnings(&self) -> Vec<String> {
        self.old_names.warnings()
    }

    /// Every password in the connection addresses (`amqp.url`, `database.url`,
    /// `transport.url`, `transport.providers`, `outbox.sources`, `otel.endpoint`), as
    /// written and decoded: what the log writer and
    /// the last error line scrub, in case a library quotes an address.
    pub fn passwords(&self) -> Vec<String> {
        let mut found: Vec<String> = [
            Some(&self.amqp.url),
            Some(&self.database.url),
            self.transport.url.as_ref(),
            self.otel.endpoint.as_ref(),
        ]
        .into_iter()
        .flatten()
        .chain(&self.transport.providers)
        .chain(&self.outbox.sources)
        .flat_map(|url| passwords(url.expose_secret()))
        .collect();
        found.sort();
        found.dedup();
        // The longest first, so that a password containing another is replaced whole.
        found.sort_by_key(|p| std::cmp::Reverse(p.len()));
        found
    }

    /// This instance's name in the inbox `owner` column.
    pub(crate) fn instance_id(&self) -> String {
        self.worker.instance_id.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "postie".into());
            let random = uuid::Uuid::new_v4().simple().to_string();
            format!("{host}-{}-{}", std::process::id(), &random[..8])
        })
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// An environment for [`Settings::load_from`].
    fn vars(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().expect("defaults validate");
    }

    #[test]
    fn feedback_is_off_by_default_and_reads_its_lists_and_secrets() {
        let s = Settings::load_from(None, Some(vars(&[]))).unwrap();
        assert_eq!(s.feedback.listen, None);
        assert_eq!(
            s.feedback.sns.allowed_hosts,
            ["sns.*.amazonaws.com", "sns.*.amazonaws.com.cn"]
        );
        assert!(s.feedback.trust_unmatched.is_empty());
        // Served without its topics: refused, naming the key (issue 45).
        let open = vars(&[("POSTIE__FEEDBACK__LISTEN", "127.0.0.1:9091")]);
        let err = Settings::load_from(None, Some(open))
            .unwrap_err()
            .to_string();
        assert!(err.contains("feedback.sns.topic_arns"), "{err}");
        let unknown = vars(&[("POSTIE__FEEDBACK__TRUST_UNMATCHED", "dsn,smtp")]);
        let err = Settings::load_from(None, Some(unknown))
            .unwrap_err()
            .to_string();
        assert!(err.contains("feedback.trust_unmatched: \"smtp\""), "{err}");
        let env = vars(&[
            ("POSTIE__FEEDBACK__LISTEN", "127.0.0.1:9091"),
            (
                "POSTIE__FEEDBACK__SNS__TOPIC_ARNS",
                "arn:aws:sns:eu-west-1:1:a",
            ),
            ("POSTIE__FEEDBACK__TRUST_UNMATCHED", "ses,dsn"),
            (
                "POSTIE__FEEDBACK__SNS__ALLOWED_HOSTS",
                "a.example,http://127.0.0.1:80",
            ),
            (
                "POSTIE__FEEDBACK__MAILGUN__SIGNING_KEY",
                "mg-key-do-not-print",
            ),
            (
                "POSTIE__FEEDBACK__POSTMARK__PASSWORD",
                "pm-pass-do-not-print",
            ),
        ]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.feedback.listen, Some("127.0.0.1:9091".parse().unwrap()));
        assert_eq!(
            s.feedback.sns.allowed_hosts,
            ["a.example", "http://127.0.0.1:80"]
        );
        assert!(s.feedback.trusts_unmatched("dsn") && !s.feedback.trusts_unmatched("arf"));
        let shown = format!("{:?}", s.feedback);
        assert!(!shown.contains("do-not-print"), "{shown}");
        let zero = vars(&[("POSTIE__FEEDBACK__MAX_BODY_BYTES", "0")]);
        assert!(Settings::load_from(None, Some(zero)).is_err());
    }

    #[test]
    fn environment_overrides_defaults_and_parses_lists() {
        let env = vars(&[
            ("POSTIE__TOPOLOGY__RETRY_STEPS", "1s,2m"),
            ("POSTIE__AMQP__PREFETCH", "7"),
            ("POSTIE__HTTP__LISTEN", ""),
            ("POSTIE__TRANSPORT__URL", "file:///tmp/x"),
            ("POSTIE__WORKER__THREADS", "1"),
        ]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.worker.threads, Some(1));
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
            ("POSTIE__TRANSPORT__TIMEOUT", "soon", "transport.timeout"),
            ("POSTIE__SMTP__TIMEOUT", "soon", "smtp.timeout"),
            ("POSTIE__AMQP__PREFETCH", "lots", "amqp.prefetch"),
            ("POSTIE__AMQP__PREFECH", "5", "prefech"),
            ("POSTIE__WORKER__THREADS", "0", "worker.threads"),
            ("POSTIE__WORKER__THREADS", "many", "worker.threads"),
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
        let env = vars(&[
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__LIMIT", "2"),
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__WINDOW", "1h"),
            ("POSTIE__THROTTLE__ORDER_CONFIRMATION__POLICY", "defer"),
        ]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        let rule = &s.throttle["order_confirmation"];
        assert_eq!(
            (rule.limit, rule.window, rule.policy),
            (2, Duration::from_secs(3600), ThrottlePolicy::Defer)
        );
    }

    #[test]
    fn inbox_retention_is_read_and_tombstones_default_to_it() {
        let env = vars(&[("POSTIE__INBOX__RETENTION", "7d")]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.inbox.retention, Duration::from_secs(7 * 86_400));
        assert_eq!(s.inbox.tombstone_retention(), s.inbox.retention);
        let env = vars(&[
            ("POSTIE__INBOX__TOMBSTONE_RETENTION", "1h"),
            ("POSTIE__INBOX__PRUNE_INTERVAL", "1s"),
        ]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.inbox.tombstone_retention(), Duration::from_secs(3600));
        assert_eq!(s.inbox.retention, Duration::from_secs(30 * 86_400));
        let env = vars(&[("POSTIE__INBOX__RETENTION", "0s")]);
        let err = Settings::load_from(None, Some(env))
            .unwrap_err()
            .to_string();
        assert!(err.contains("inbox.retention"), "{err}");
    }

    #[test]
    fn a_comma_separated_amqp_url_arrives_whole_and_each_address_is_checked() {
        let list = "amqp://u:SECRETPW1@10.0.0.1:5672/%2f,amqp://u:SECRETPW2@10.0.0.2:5672/%2f,amqp://u:SECRETPW3@10.0.0.3:5672/%2f";
        let env = vars(&[("POSTIE__AMQP__URL", list)]);
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.amqp.url.expose_secret(), list);
        let bad = "amqp://u:SECRETPW1@10.0.0.1/%2f,amqp://u:SECRETPW2@10.0.0.2:notaport/%2f";
        let env = vars(&[("POSTIE__AMQP__URL", bad)]);
        let err = Settings::load_from(None, Some(env))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("amqp.url amqp://u:***@10.0.0.2:notaport"),
            "{err}"
        );
        assert!(!err.contains("SECRETPW"), "{err}");
        let mut s = Settings::default();
        s.amqp.url = SecretString::from(" , ");
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("amqp.url is empty"));
    }

    #[test]
    fn transport_pool_size_must_be_at_least_one() {
        let mut s = Settings::default();
        s.transport.pool_size = 0;
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("transport.pool_size must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn lease_must_cover_a_whole_send() {
        let mut s = Settings::default();
        s.worker.lease = Duration::from_secs(10);
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("worker.lease (10s) is shorter than a send may take (40s"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
        s.worker.lease = s.transport.send_deadline();
        s.validate()
            .expect("a lease as long as the send deadline is enough");
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

        let env = vars(&[(
            "POSTIE__TRANSPORT__URL",
            "smtp://relay.example.com?tls=sometimes",
        )]);
        let err = Settings::load_from(None, Some(env))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tls=sometimes"), "{err}");
        let env = vars(&[
            ("POSTIE__DATABASE__URL", "postgres://a@10.0.0.5/x"),
            ("POSTIE__DATABASE__ALLOW_PLAINTEXT", "true"),
        ]);
        let s = Settings::load_from(None, Some(env)).expect("escape hatch from the environment");
        assert!(s.database.allow_plaintext);
    }
}
