//! RabbitMQ connections and confirmed publishes (a returned or nacked publish is a
//! failure, never a silent drop).

use std::str::FromStr;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use secrecy::{ExposeSecret, SecretString};

use crate::config::AmqpSettings;
use crate::endpoint::{is_loopback_host, redact_url};

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

/// [`connect`] with `amqp.url` and `amqp.connect_timeout`, under connection name `name`.
pub async fn open(settings: &AmqpSettings, name: &str) -> anyhow::Result<Connection> {
    connect(&settings.url, name, settings.connect_timeout).await
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
