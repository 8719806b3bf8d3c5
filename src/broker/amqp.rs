//! RabbitMQ connections and confirmed publishes (a returned or nacked publish is a
//! failure, never a silent drop).
//!
//! `connect` is the one way to connect: it tries every parsed address of `amqp.url`
//! in turn, from a random start and past the last one used. `PublishError::refusal`
//! is the broker's 406 for a message itself (over its `max_message_size`).
//! `copy_properties` gives a republished copy the delivery's properties, its headers
//! not copied.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::config::{AmqpAddress, AmqpAddresses};
use crate::endpoint::scrub;

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

impl PublishError {
    /// The broker's words when it refused the message itself: the channel closed with
    /// 406 PRECONDITION_FAILED in answer to the publish (a message over the broker's
    /// `max_message_size`), which no retry of the same message changes. Only a
    /// publish of one message alone tells whose it was: every publish in flight on
    /// the channel fails with the same error.
    pub(crate) fn refusal(&self) -> Option<String> {
        match self {
            Self::Broker(error) => match error.kind() {
                lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => {
                    Some(format!("{} {}", amqp.get_id(), amqp.get_message()))
                }
                _ => None,
            },
            Self::Nacked(_) | Self::Unroutable(_) => None,
        }
    }
}

/// A connection and the (redacted) address of the node it reached.
pub struct Connected {
    /// The connection.
    pub connection: Connection,
    /// The address in use, without its password: for logs and `/readyz`.
    pub address: String,
}

/// Where the next connection attempt of this process starts in an address list:
/// random at first (a fleet spreads over the nodes), then just past the address of
/// the last connection made, so a reconnect after a lost session tries another
/// node first.
static NEXT_ADDRESS: std::sync::OnceLock<AtomicUsize> = std::sync::OnceLock::new();

fn next_address() -> &'static AtomicUsize {
    NEXT_ADDRESS.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        AtomicUsize::new(random as usize)
    })
}

/// The order in which to try `count` addresses, starting at `start` (mod `count`).
pub(crate) fn rotation(start: usize, count: usize) -> impl Iterator<Item = usize> {
    (0..count).map(move |i| (start.wrapping_add(i)) % count.max(1))
}

/// The one way postie connects to RabbitMQ: to the first of `addresses` (`amqp.url`,
/// parsed once by [`AmqpAddresses::parse`]) that answers, trying them in turn from
/// where the last connection of this process left off; each attempt has `timeout`,
/// and the connection is named `name`. The errors name the redacted addresses,
/// never a password.
///
/// `amqps://` is TLS with the broker's certificate verified against the system's
/// roots. `amqp://` to a host other than this machine works, with one warning per
/// process: brokers often run plaintext inside a private network, and the producers'
/// side of the broker is not postie's to secure (README, "Security").
pub async fn connect(
    addresses: &AmqpAddresses,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Connected> {
    let addresses = addresses.all();
    let start = next_address().load(Ordering::Relaxed);
    let mut failures = Vec::new();
    for i in rotation(start, addresses.len()) {
        match connect_one(&addresses[i], name, timeout).await {
            Ok(connection) => {
                next_address().store(i.wrapping_add(1), Ordering::Relaxed);
                return Ok(Connected {
                    connection,
                    address: addresses[i].shown.clone(),
                });
            }
            Err(error) => {
                if addresses.len() > 1 {
                    tracing::debug!(%error, "RabbitMQ address failed; trying the next");
                }
                failures.push(error);
            }
        }
    }
    // The next attempt starts one further on, not at the same dead node.
    next_address().store(start.wrapping_add(1), Ordering::Relaxed);
    Err(match failures.len() {
        1 => failures.remove(0),
        n => anyhow::anyhow!(
            "cannot connect to RabbitMQ at any of its {n} addresses: {}",
            failures
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        ),
    })
}

/// One address, with a timeout.
async fn connect_one(
    address: &AmqpAddress,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Connection> {
    static PLAINTEXT_WARNED: std::sync::Once = std::sync::Once::new();
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let redacted = &address.shown;
    if let Some(host) = &address.plaintext_to {
        PLAINTEXT_WARNED.call_once(|| {
            tracing::warn!(
                "amqp.url points at {host} without TLS: the broker password and every \
                 job cross the network unencrypted; use amqps:// unless this network \
                 is trusted"
            );
        });
    }
    let uri = address.uri.clone();
    match tokio::time::timeout(timeout, Connection::connect_uri(uri, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "cannot connect to RabbitMQ at {redacted}: {}",
            scrub(&e.to_string(), &address.passwords)
        )),
        Err(_) => Err(anyhow::anyhow!(
            "cannot connect to RabbitMQ at {redacted}: no answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// Whether the connection's RabbitMQ user may publish a message whose `user_id` is
/// another user's (the `impersonator` tag), as postie must under
/// `worker.key_namespace = "user_id"` to re-publish producers' jobs. Publishes one
/// empty message that no queue receives, under a made-up `user_id`, on a channel of
/// its own: the broker closes that channel with 406 if the user may not.
pub(crate) async fn may_impersonate(conn: &Connection) -> Result<bool, lapin::Error> {
    let channel = confirm_channel(conn).await?;
    let nobody = format!("postie-probe-{}", uuid::Uuid::new_v4().simple());
    let properties = BasicProperties::default().with_user_id(nobody.as_str().into());
    match publish_confirmed(&channel, "", &nobody, false, b"", properties).await {
        Err(PublishError::Broker(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => Ok(false),
            _ => Err(e),
        },
        // Acked, or nacked for another reason: the user_id itself passed.
        Ok(()) | Err(_) => {
            let _ = channel.close(200, "probe done".into()).await;
            Ok(true)
        }
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

/// A queue as a passive declare sees it: ready messages and consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueueState {
    /// Messages ready for delivery (not those delivered and unacked).
    pub ready: u32,
    /// Consumers.
    pub consumers: u32,
}

/// `queue`'s state, or `None` if the broker has no such queue (404). Uses a channel of
/// its own, since a failed passive declare closes it.
pub(crate) async fn queue_state(
    conn: &Connection,
    queue: &str,
) -> Result<Option<QueueState>, lapin::Error> {
    let channel = conn.create_channel().await?;
    let options = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
    {
        Ok(q) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(Some(QueueState {
                ready: q.message_count(),
                consumers: q.consumer_count(),
            }))
        }
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `queue` exists ([`queue_state`]).
pub(crate) async fn queue_exists(conn: &Connection, queue: &str) -> anyhow::Result<bool> {
    Ok(queue_state(conn, queue).await?.is_some())
}

/// A 404 NOT_FOUND from the broker.
fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404)
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

/// `properties` for a copy postie republishes: every property but `headers` (the copy
/// brings its own, so the original's are not copied only to be replaced) and, unless
/// `keep_user_id`, `user_id`. RabbitMQ refuses a publish whose `user_id` is not the
/// publishing connection's user (406, closing the channel) unless that user has the
/// `impersonator` tag: a producer's `user_id` cannot ride along on postie's own
/// re-publishes unless postie needs it (`worker.key_namespace = "user_id"`).
pub(crate) fn copy_properties(properties: &BasicProperties, keep_user_id: bool) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $set:ident),* $(,)?) => {
            $(if let Some(value) = properties.$get() {
                out = out.$set(value.clone());
            })*
        };
    }
    copy!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        expiration => with_expiration,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        app_id => with_app_id,
        cluster_id => with_cluster_id,
    );
    if keep_user_id {
        copy!(user_id => with_user_id);
    }
    out
}

#[cfg(test)]
mod tests {
    use secrecy::SecretString;

    use super::*;
    use lapin::types::AMQPValue;

    #[test]
    fn only_the_user_id_is_dropped() {
        let full = job_properties()
            .with_user_id("svc-a".into())
            .with_message_id("m-1".into())
            .with_timestamp(1_700_000_000)
            .with_app_id("shop".into())
            .with_correlation_id("c-1".into())
            .with_priority(3);
        let expected = job_properties()
            .with_message_id("m-1".into())
            .with_timestamp(1_700_000_000)
            .with_app_id("shop".into())
            .with_correlation_id("c-1".into())
            .with_priority(3);
        assert_eq!(copy_properties(&full, false), expected);
        // Kept when asked; the headers are never copied (the copy sets its own).
        let mut headers = FieldTable::default();
        headers.insert("traceparent".into(), AMQPValue::LongString("00-abc".into()));
        let with_headers = full.clone().with_headers(headers);
        assert_eq!(copy_properties(&with_headers, true), full);
    }

    #[test]
    fn addresses_are_tried_in_turn_from_any_start() {
        assert_eq!(rotation(0, 3).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(rotation(4, 3).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(rotation(usize::MAX, 3).count(), 3);
        assert_eq!(rotation(7, 1).collect::<Vec<_>>(), [0]);
        // Every start visits every address exactly once.
        for start in 0..6 {
            let mut seen: Vec<_> = rotation(start, 3).collect();
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2]);
        }
    }

    #[tokio::test]
    async fn failures_name_every_address_redacted_and_the_next_attempt_moves_on() {
        // Closed ports on this machine: refused at once.
        let closed: Vec<u16> = (0..3)
            .map(|_| {
                std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port()
            })
            .collect();
        let list = format!(
            "amqp://u:SECRETPW1@127.0.0.1:{}/%2f,amqp://u:SECRETPW2@127.0.0.1:{}/%2f, amqp://u:SECRETPW3@127.0.0.1:{}/%2f",
            closed[0], closed[1], closed[2]
        );
        let before = next_address().load(Ordering::Relaxed);
        let addresses = AmqpAddresses::parse(&SecretString::from(list)).unwrap();
        let Err(error) = connect(&addresses, "t", Duration::from_secs(2)).await else {
            panic!("nothing listens");
        };
        let error = error.to_string();
        assert!(error.contains("any of its 3 addresses"), "{error}");
        assert!(!error.contains("SECRETPW"), "{error}");
        assert_eq!(error.matches("u:***@127.0.0.1:").count(), 3, "{error}");
        assert_eq!(
            next_address().load(Ordering::Relaxed),
            before.wrapping_add(1)
        );
        // A bad address is refused when amqp.url is parsed, before any connection.
        let Err(error) = AmqpAddresses::parse(&SecretString::from(
            "amqp://u:SECRETPW9@127.0.0.1:notaport/%2f",
        )) else {
            panic!("not a valid URL");
        };
        let error = error.to_string();
        assert!(!error.contains("SECRETPW9"), "{error}");
    }
}
