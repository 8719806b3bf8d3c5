//! Settings checked once, section by section, and the connection addresses parsed
//! into the typed values the rest of postie uses ([`Parsed`]): no module takes a
//! settings string apart again where it is used.

use secrecy::ExposeSecret;

use super::provider::{api_endpoint, is_api_url, ApiEndpoint};
use super::{
    database_plan, smtp_endpoint, AmqpAddresses, ConfigError, DbPlan, ProviderPlan, Settings,
    SmtpEndpoint,
};
use crate::endpoint::redact_url;

/// What validation parsed: the typed connection settings. `Debug` shows no secret.
pub(crate) struct Parsed {
    /// `amqp.url`, each address parsed.
    pub(crate) amqp: AmqpAddresses,
    /// Every transport in order of preference (`transport.providers`, else the one
    /// of `transport.url`), each with its TLS rules, name and rate.
    pub(crate) providers: Vec<ProviderPlan>,
    /// `database.url`: the connection settings and the TLS decision.
    pub(crate) database: DbPlan,
    /// `outbox.sources`: each producer's database, named.
    pub(crate) outbox: Vec<super::OutboxSource>,
}

impl std::fmt::Debug for Parsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parsed")
            .field("amqp", &self.amqp)
            .field("providers", &self.providers)
            .field("database_tls", &self.database.tls)
            .field("outbox", &self.outbox)
            .finish_non_exhaustive()
    }
}

/// The mail transport `transport.url` names.
#[derive(Debug, Clone)]
pub enum SmtpTransport {
    /// `file:///dir`: `.eml` files in that folder.
    Files(String),
    /// An SMTP relay.
    Relay(SmtpEndpoint),
    /// A provider's HTTP API (`ses://`, `sendgrid://`, `postmark://`, `mailgun://`).
    Api(ApiEndpoint),
}

impl SmtpTransport {
    /// Parses `raw` (`transport.url`) and applies the transport rules ([`smtp_endpoint`],
    /// or [`api_endpoint`] for a provider's API, whose credentials may come from the
    /// process environment).
    pub(crate) fn parse(raw: &str) -> Result<Self, ConfigError> {
        if is_api_url(raw) {
            return api_endpoint(raw, &|var| std::env::var(var).ok()).map(Self::Api);
        }
        Ok(match smtp_endpoint(raw)? {
            None => Self::Files(raw.trim_start_matches("file://").to_string()),
            Some(endpoint) => Self::Relay(endpoint),
        })
    }
}

fn fail<T>(message: String) -> Result<T, ConfigError> {
    Err(ConfigError(message))
}

impl Settings {
    /// Cross-field checks the types cannot express, then the connection addresses
    /// parsed (each refusal comes before any connection is made).
    pub(crate) fn validate(&self) -> Result<Parsed, ConfigError> {
        self.check_topology()?;
        self.check_delay_and_throttles()?;
        self.check_inbox()?;
        self.check_feedback()?;
        self.check_listeners()?;
        self.check_worker_and_smtp()?;
        self.check_budget()?;
        self.suppression.check().map_err(ConfigError)?;
        self.parse_addresses()
    }

    /// `amqp.management_url`: `https://`, or `http://` to this machine (or with
    /// `amqp.management_allow_http`), since its password goes with every request.
    fn check_management_url(&self) -> Result<(), ConfigError> {
        let Some(raw) = &self.amqp.management_url else {
            return Ok(());
        };
        let raw = raw.expose_secret();
        let shown = redact_url(raw);
        let url = match url::Url::parse(raw) {
            Ok(url) => url,
            // The parser's text could quote the URL: only its kind is said.
            Err(e) => return fail(format!("amqp.management_url {shown} is not a URL ({e})")),
        };
        let host = url.host_str().unwrap_or("");
        match url.scheme() {
            "https" => Ok(()),
            "http" if crate::endpoint::is_loopback_host(host) => Ok(()),
            "http" if self.amqp.management_allow_http => Ok(()),
            "http" => fail(format!(
                "amqp.management_url {shown}: http:// to {host}, which is not this machine,                  would send its password in clear; use https:// (RabbitMQ's management TLS                  listener), or set amqp.management_allow_http = true on a network you trust"
            )),
            other => fail(format!(
                "amqp.management_url {shown}: scheme {other}:// is not https:// (or http://                  to this machine)"
            )),
        }
    }

    fn check_topology(&self) -> Result<(), ConfigError> {
        let topology = &self.topology;
        let allowed = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
        if topology.prefix.is_empty() || !topology.prefix.chars().all(allowed) {
            return fail(format!(
                "topology.prefix {:?} must be non-empty ASCII letters, digits, '.', '_' or '-'",
                topology.prefix
            ));
        }
        for old in &topology.drain_prefixes {
            if old.is_empty() || old == &topology.prefix {
                return fail(format!(
                    "topology.drain_prefixes: {old:?} must be another prefix than topology.prefix {:?}",
                    topology.prefix
                ));
            }
        }
        if topology.quorum_initial_group_size == Some(0) {
            return fail("topology.quorum_initial_group_size must be at least 1".into());
        }
        if topology.retry_steps.iter().any(|d| d.is_zero()) {
            return fail("topology.retry_steps must all be above zero".into());
        }
        topology.check_lanes()
    }

    fn check_delay_and_throttles(&self) -> Result<(), ConfigError> {
        let delay = &self.delay;
        if delay.resolution.is_zero() || delay.max < delay.resolution {
            return fail("delay.resolution must be above zero and below delay.max".into());
        }
        if delay.relay_concurrency == 0 {
            return fail("delay.relay_concurrency must be at least 1".into());
        }
        if delay.reconcile_grace < std::time::Duration::from_secs(1) {
            return fail("delay.reconcile_grace must be at least 1s".into());
        }
        for (kind, rule) in &self.throttle {
            if rule.limit == 0 || rule.window.is_zero() {
                return fail(format!(
                    "throttle.{kind}: limit and window must be above zero"
                ));
            }
        }
        Ok(())
    }

    fn check_inbox(&self) -> Result<(), ConfigError> {
        let inbox = &self.inbox;
        if inbox.retention.is_zero()
            || inbox.tombstone_retention().is_zero()
            || inbox.prune_interval.is_zero()
            || inbox.prune_batch == 0
        {
            return fail(
                "inbox.retention, tombstone_retention, prune_interval and prune_batch must be above zero"
                    .into(),
            );
        }
        let events = &self.events;
        if !(1..=10_000).contains(&events.batch) || events.poll_interval.is_zero() {
            return fail(
                "events.batch must be 1 to 10000 and events.poll_interval above zero".into(),
            );
        }
        Ok(())
    }

    fn check_feedback(&self) -> Result<(), ConfigError> {
        self.feedback.check().map_err(ConfigError)?;
        let wanted = self
            .topology
            .lanes
            .iter()
            .find(|(_, lane)| lane.unsubscribe)
            .map(|(name, _)| name.as_str());
        self.unsubscribe.check(wanted).map_err(ConfigError)?;
        self.attachments.check().map_err(ConfigError)?;
        Ok(())
    }

    /// The console's and every HTTP listener's bounds.
    fn check_listeners(&self) -> Result<(), ConfigError> {
        let console = &self.console;
        if !(1..=10_000).contains(&console.page_size) || console.max_batch == 0 {
            return fail(
                "console.page_size must be 1 to 10000 and console.max_batch above zero".into(),
            );
        }
        if !(1..=65_535).contains(&console.dead_letter_scan) {
            // The letters are read by one consumer whose prefetch is this many.
            return fail("console.dead_letter_scan must be 1 to 65535".into());
        }
        if console.session_ttl < std::time::Duration::from_secs(1)
            || console.max_sessions == 0
            || console.sign_in_clients == 0
        {
            return fail(
                "console.session_ttl must be at least 1s, console.max_sessions and \
                 console.sign_in_clients above zero"
                    .into(),
            );
        }
        let http = &self.http;
        if http.max_connections == 0
            || http.header_timeout.is_zero()
            || http.request_timeout.is_zero()
        {
            return fail(
                "http.max_connections, http.header_timeout and http.request_timeout must be \
                 above zero"
                    .into(),
            );
        }
        Ok(())
    }

    fn check_worker_and_smtp(&self) -> Result<(), ConfigError> {
        if self.transport.rate_burst == Some(0) {
            return fail("transport.rate_burst must be at least 1".into());
        }
        if self.transport.pool_size == 0 {
            return fail("transport.pool_size must be at least 1".into());
        }
        if self.database.statement_timeout.is_zero() {
            return fail("database.statement_timeout must be above zero".into());
        }
        if self.worker.threads == Some(0) {
            return fail("worker.threads must be at least 1 (or unset: one per core)".into());
        }
        if self.worker.concurrency == 0 || self.amqp.prefetch == 0 {
            return fail("worker.concurrency and amqp.prefetch must be at least 1".into());
        }
        if self.worker.lease < self.transport.send_deadline() {
            return fail(format!(
                "worker.lease ({}) is shorter than a send may take ({}, twice transport.timeout): \
                 raise worker.lease or lower transport.timeout",
                humantime::format_duration(self.worker.lease),
                humantime::format_duration(self.transport.send_deadline())
            ));
        }
        Ok(())
    }

    /// Every connection address, parsed, with the transport rules applied.
    fn parse_addresses(&self) -> Result<Parsed, ConfigError> {
        // amqp.url: one address or a comma-separated list, each a URL of its own.
        let amqp = AmqpAddresses::parse(&self.amqp.url)?;
        self.check_management_url()?;
        let providers = self.provider_plans()?;
        if let Some(endpoint) = &self.otel.endpoint {
            let endpoint = endpoint.expose_secret();
            if let Err(e) = url::Url::parse(endpoint) {
                return fail(format!(
                    "otel.endpoint {} is not a URL: {e}",
                    redact_url(endpoint)
                ));
            }
        }
        let database = self.database.plan()?;
        let outbox = self.outbox.parse_sources(&self.database)?;
        if !outbox.is_empty() && matches!(self.worker.key_namespace, super::KeyNamespace::UserId) {
            return fail(
                "outbox.sources cannot be used with worker.key_namespace = \"user_id\": the \
                 relay publishes as postie's own RabbitMQ user, not as each producer; publish \
                 directly in that mode"
                    .into(),
            );
        }
        Ok(Parsed {
            amqp,
            providers,
            database,
            outbox,
        })
    }
}

impl super::DatabaseSettings {
    /// `url` parsed with the TLS decision ([`database_plan`]); `ca_file`, if set, must
    /// be a readable file.
    pub fn plan(&self) -> Result<DbPlan, ConfigError> {
        if let Some(path) = self.ca_file() {
            if !path.is_file() {
                return fail(format!(
                    "database.ca_file {} is not a readable file",
                    path.display()
                ));
            }
        }
        database_plan(
            self.url.expose_secret(),
            self.allow_plaintext,
            self.ca_file(),
        )
    }
}
