//! Publish one email job to postie, using lapin directly (see "The message contract"
//! in the README). Copy it into your own service: it needs only `lapin` (with its
//! `tokio` feature), `tokio` and `serde_json`, nothing from postie.
//!
//! ```sh
//! cargo run --example publish -- --to alice@example.com --delay-ms 10000
//! ```
//!
//! Every setting is a flag, or else an environment variable, or else a default:
//!
//! | flag | variable | default |
//! |---|---|---|
//! | `--amqp-url` | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `--prefix` | `POSTIE_PREFIX` | `postie` (publishes to exchange `<prefix>.delayed`) |
//! | `--key` | `EMAIL_KEY` | `demo-<unix ms>:welcome` |
//! | `--to` | `EMAIL_TO` | `alice@example.com` |
//! | `--delay-ms` | `EMAIL_DELAY_MS` | `5000` (0 = send now) |
//!
//! On success it prints one line, `published key=<key> exchange=<x> delay_ms=<n>`,
//! once the broker has confirmed the job. Any failure exits non-zero.

use std::error::Error;
use std::time::{SystemTime, UNIX_EPOCH};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

/// The routing key of the contract.
const ROUTING_KEY: &str = "email";

/// What to publish, and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// postie's topology prefix.
    pub prefix: String,
    /// The idempotency key.
    pub key: String,
    /// The recipient.
    pub to: String,
    /// `x-delay`, milliseconds.
    pub delay_ms: i64,
}

impl Options {
    /// From flags (`--name value` or `--name=value`), else `env(VARIABLE)`, else defaults.
    pub fn from_args(
        args: impl IntoIterator<Item = String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut flags = std::collections::HashMap::new();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let Some(name) = arg.strip_prefix("--") else {
                return Err(format!("unexpected argument {arg:?}"));
            };
            let (name, value) = match name.split_once('=') {
                Some((name, value)) => (name.to_string(), value.to_string()),
                None => {
                    let value = args
                        .next()
                        .ok_or_else(|| format!("--{name} needs a value"))?;
                    (name.to_string(), value)
                }
            };
            if !["amqp-url", "prefix", "key", "to", "delay-ms"].contains(&name.as_str()) {
                return Err(format!("unknown flag --{name}"));
            }
            flags.insert(name, value);
        }
        let setting = |flag: &str, variable: &str, default: &dyn Fn() -> String| {
            flags
                .get(flag)
                .cloned()
                .or_else(|| env(variable).filter(|v| !v.is_empty()))
                .unwrap_or_else(default)
        };
        let delay = setting("delay-ms", "EMAIL_DELAY_MS", &|| "5000".into());
        let delay_ms: i64 = delay.trim().parse().map_err(|_| {
            format!("delay must be an integer number of milliseconds, not {delay:?}")
        })?;
        Ok(Self {
            amqp_url: setting("amqp-url", "AMQP_URL", &|| {
                "amqp://guest:guest@127.0.0.1:5672/%2f".into()
            }),
            prefix: setting("prefix", "POSTIE_PREFIX", &|| "postie".into()),
            // In a real service the key comes from your business data, e.g.
            // format!("order-{order_id}:order_confirmation"), so that publishing the
            // same event twice (a retry, a redelivery) collides and yields one email.
            // The time-based default only lets this example run repeatedly.
            key: setting("key", "EMAIL_KEY", &|| {
                format!("demo-{}:welcome", unix_ms())
            }),
            to: setting("to", "EMAIL_TO", &|| "alice@example.com".into()),
            delay_ms: delay_ms.max(0),
        })
    }

    /// The exchange producers publish to.
    pub fn exchange(&self) -> String {
        format!("{}.delayed", self.prefix)
    }
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_millis() as i64
}

/// Publishes the job and returns once the broker has confirmed it.
pub async fn publish(options: &Options) -> Result<(), Box<dyn Error + Send + Sync>> {
    let body = serde_json::json!({
        "key": options.key,
        "from": "Shop <noreply@shop.example>",
        "to": [options.to],
        "subject": "Welcome!",
        "text": "Hello from the Rust producer example.",
        "html": "<p>Hello from the <b>Rust</b> producer example.</p>",
    });

    let mut headers = FieldTable::default();
    // Integers, as the contract asks.
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(options.delay_ms),
    );
    // The due time counts from here, even if postie is down right now.
    headers.insert(
        ShortString::from("postie-published-at"),
        AMQPValue::LongLongInt(unix_ms()),
    );
    let properties = BasicProperties::default()
        .with_delivery_mode(2) // persistent
        .with_content_type("application/json".into())
        .with_headers(headers);

    let connection =
        Connection::connect(&options.amqp_url, ConnectionProperties::default()).await?;
    let result = async {
        let channel = connection.create_channel().await?;
        // Publisher confirms: the broker acks (or nacks) every publish on this channel.
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let confirmation = channel
            .basic_publish(
                options.exchange().as_str().into(),
                ROUTING_KEY.into(),
                // Not mandatory: the delayed-message plugin returns every delayed
                // publish as unroutable yet delivers it later.
                BasicPublishOptions::default(),
                body.to_string().as_bytes(),
                properties,
            )
            .await? // sent
            .await?; // confirmed (or an error if the broker closed the channel, e.g. 404)
        match confirmation {
            Confirmation::Nack(_) => Err("the broker nacked the publish".into()),
            _ => Ok(()),
        }
    }
    .await;
    let _ = connection.close(200, "done".into()).await;
    result
}

#[tokio::main]
async fn main() {
    let options =
        match Options::from_args(std::env::args().skip(1), |name| std::env::var(name).ok()) {
            Ok(options) => options,
            Err(e) => {
                eprintln!("publish failed: {e}");
                std::process::exit(2);
            }
        };
    if let Err(e) = publish(&options).await {
        eprintln!("publish failed: {e}");
        std::process::exit(1);
    }
    println!(
        "published key={} exchange={} delay_ms={}",
        options.key,
        options.exchange(),
        options.delay_ms
    );
}
