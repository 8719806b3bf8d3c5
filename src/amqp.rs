//! RabbitMQ plumbing: connecting, publishing with confirms (and treating a returned
//! or nacked publish as a failure), and reading/writing postie's headers.

use std::str::FromStr;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use secrecy::{ExposeSecret, SecretString};

use crate::config::{is_loopback_host, redact_url};

/// Header: failed attempts so far in the current retry cycle (postie's own; RabbitMQ
/// 3.13+ drops client-set `x-*` headers, so none of ours start with `x-`).
pub const HEADER_ATTEMPT: &str = "postie-attempt";
/// Header: the error of the last failed attempt.
pub const HEADER_LAST_ERROR: &str = "postie-last-error";
/// Header on dead letters: why the job was dead-lettered, for a person.
pub const HEADER_DEAD_REASON: &str = "postie-dead-reason";
/// Header on dead letters: a short machine-readable reason class.
pub const HEADER_DEAD_KIND: &str = "postie-dead-kind";
/// Header on dead letters: when (RFC 3339).
pub const HEADER_DEAD_AT: &str = "postie-dead-at";
/// Header on dead letters: attempts made before dead-lettering.
pub const HEADER_DEAD_ATTEMPTS: &str = "postie-dead-attempts";

/// A publish that did not reach a queue durably.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The channel or connection failed.
    #[error("publish failed: {0}")]
    Broker(#[from] lapin::Error),
    /// The broker nacked (e.g. a full queue with `reject-publish`).
    #[error("broker nacked the publish to {0}")]
    Nacked(String),
    /// No queue was bound for it (mandatory publish returned).
    #[error("publish to {0} was returned unroutable")]
    Unroutable(String),
}

/// Heartbeat interval asked of the broker when `amqp.url` does not set `heartbeat`.
const HEARTBEAT_SECS: u16 = 10;

/// Connects with a timeout; the error names the redacted URL, never the password.
///
/// `amqps://` is TLS with the broker's certificate verified against the system's
/// roots. `amqp://` to a host other than this machine works, with one warning per
/// process: brokers often run plaintext inside a private network, and the producers'
/// side of the broker is not postie's to secure (README, "Security").
pub async fn connect(
    url: &SecretString,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Connection> {
    static PLAINTEXT_WARNED: std::sync::Once = std::sync::Once::new();
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let redacted = redact_url(url.expose_secret());
    if let Ok(parsed) = url::Url::parse(url.expose_secret()) {
        let host = parsed.host_str().unwrap_or("");
        if parsed.scheme() == "amqp" && !host.is_empty() && !is_loopback_host(host) {
            PLAINTEXT_WARNED.call_once(|| {
                tracing::warn!(
                    "amqp.url points at {host} without TLS: the broker password and every \
                     job cross the network unencrypted; use amqps:// unless this network \
                     is trusted"
                );
            });
        }
    }
    // A short heartbeat unless the URL sets one: a broker that vanishes without closing
    // the connection is noticed in seconds, not after the broker's default 60 s × 2.
    let mut uri = lapin::uri::AMQPUri::from_str(url.expose_secret())
        .map_err(|e| anyhow::anyhow!("amqp.url {redacted} is not valid: {e}"))?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(HEARTBEAT_SECS);
    }
    match tokio::time::timeout(timeout, Connection::connect_uri(uri, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "cannot connect to RabbitMQ at {redacted}: {e}"
        )),
        Err(_) => Err(anyhow::anyhow!(
            "cannot connect to RabbitMQ at {redacted}: no answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// Opens a channel with publisher confirms switched on.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, lapin::Error> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Publishes and waits for the broker's confirm. `mandatory` makes an unroutable
/// publish an error instead of a silent drop (never use it on delayed publishes to
/// the plugin's exchange: it returns them at once yet delivers them later).
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    let target = if exchange.is_empty() {
        format!("queue {routing_key}")
    } else {
        format!("exchange {exchange}")
    };
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory,
                ..Default::default()
            },
            body,
            properties,
        )
        .await?
        .await?;
    match confirm {
        Confirmation::Nack(_) => Err(PublishError::Nacked(target)),
        Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable(target)),
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
    }
}

/// Properties of a job message as the contract asks: persistent JSON.
pub fn job_properties() -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
}

/// A header value as text, if it is a string or a number.
pub fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => header_i64(other).map(|n| n.to_string()),
    }
}

/// A header value as an integer, if it is an integer, or a string holding one.
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
pub fn set_text(headers: &mut FieldTable, name: &str, value: &str) {
    headers.insert(
        ShortString::from(name),
        AMQPValue::LongString(LongString::from(value)),
    );
}

/// Sets an integer header.
pub fn set_int(headers: &mut FieldTable, name: &str, value: i64) {
    headers.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
}

/// Headers the broker adds when it dead-letters a message. postie drops them when it
/// republishes: RabbitMQ (before 3.13) reads a client-supplied `x-death` for its
/// dead-letter cycle detection, and a job that passes the same TTL queue twice
/// (deferred twice, a second ladder pass, a replay) would be taken for a cycle and
/// dropped or, with at-least-once dead-lettering, stuck in that queue for good.
pub const BROKER_DEATH_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
];

/// A copy of `headers` without `names`.
pub fn without(headers: Option<&FieldTable>, names: &[&str]) -> FieldTable {
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
}
