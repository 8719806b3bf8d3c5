//! The sections about observing postie: the HTTP endpoint, logging, trace export;
//! and the bounds every HTTP listener of postie's holds its clients to.

use std::net::SocketAddr;
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::de::{duration, optional_addr};

/// The HTTP endpoint (metrics and health), and the bounds of every HTTP listener:
/// this one, the console's and the feedback webhooks'.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// Where `/metrics`, `/healthz` and `/readyz` listen; empty to disable.
    #[serde(deserialize_with = "optional_addr")]
    pub listen: Option<SocketAddr>,
    /// Each listener serves at most this many connections at once; one more waits in
    /// the kernel's queue until one of them ends.
    pub max_connections: usize,
    /// A request's headers must arrive within this, and a kept-alive connection with
    /// no request for this long is closed (slow or idle clients).
    #[serde(deserialize_with = "duration")]
    pub header_timeout: Duration,
    /// A request's body must arrive within this (408 past it), and its answer be
    /// taken by the client within this once ready (else the connection is closed).
    #[serde(deserialize_with = "duration")]
    pub request_timeout: Duration,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 9090))),
            max_connections: 64,
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
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
    /// It may carry credentials (`https://user:password@collector/v1/traces`, or a
    /// `?api_key=`): kept secret, shown only redacted.
    pub endpoint: Option<SecretString>,
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
