//! Publish one email job to postie, or many with pipelined publisher confirms, using
//! lapin directly (see "The message contract" and "Publishing many jobs" in the
//! README). Copy it into your own service: it needs only `lapin` (with its
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
//! | `--count` | `EMAIL_COUNT` | `1` (more: keys `<key>-0`, `<key>-1`, …) |
//! | `--window` | `EMAIL_WINDOW` | `256` (publishes awaiting their confirm, at most) |
//!
//! On success it prints one line per job, `published key=<key> exchange=<x>
//! delay_ms=<n>`, once the broker has confirmed it; with `--count` above 1, then
//! `published N jobs in S s (R jobs/s, window W)`. Any failure (a nack, a closed
//! channel, no confirm within 30 s) exits non-zero.

use std::collections::VecDeque;
use std::error::Error;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, PublisherConfirm};

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
    /// How many jobs: more than one gets keys `<key>-0`, `<key>-1`, ….
    pub count: u64,
    /// At most this many publishes awaiting their confirm at a time (1 = wait for
    /// each confirm before the next publish).
    pub window: usize,
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
            if ![
                "amqp-url", "prefix", "key", "to", "delay-ms", "count", "window",
            ]
            .contains(&name.as_str())
            {
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
        let count = setting("count", "EMAIL_COUNT", &|| "1".into());
        let count: u64 = count
            .trim()
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("count must be a whole number of at least 1, not {count:?}"))?;
        let window = setting("window", "EMAIL_WINDOW", &|| "256".into());
        let window: usize = window
            .trim()
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                format!("window must be a whole number of at least 1, not {window:?}")
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
            count,
            window,
        })
    }

    /// The jobs' keys: `key` alone, or `<key>-0` … `<key>-<count - 1>`.
    pub fn keys(&self) -> Vec<String> {
        if self.count == 1 {
            vec![self.key.clone()]
        } else {
            (0..self.count)
                .map(|i| format!("{}-{i}", self.key))
                .collect()
        }
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

/// The JSON body of the job for `key`.
fn body(key: &str, to: &str) -> Vec<u8> {
    serde_json::json!({
        "key": key,
        "from": "Shop <noreply@shop.example>",
        "to": [to],
        "subject": "Welcome!",
        "text": "Hello from the Rust producer example.",
        "html": "<p>Hello from the <b>Rust</b> producer example.</p>",
    })
    .to_string()
    .into_bytes()
}

/// Publishes the jobs (see [`Options::keys`]) and calls `confirmed(key)` for each once
/// the broker has confirmed it, in publishing order. It keeps at most
/// `options.window` publishes unconfirmed: when the window is full it waits for the
/// oldest confirm before publishing the next job. It returns once every job is
/// confirmed, or with an error at the first nack or if the broker closes the
/// channel; jobs published but not confirmed then may or may not have arrived, and a
/// real producer republishes them (the idempotency key makes that safe).
pub async fn publish(
    options: &Options,
    mut confirmed: impl FnMut(&str),
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let connection =
        Connection::connect(&options.amqp_url, ConnectionProperties::default()).await?;
    let result = async {
        let channel = connection.create_channel().await?;
        // Publisher confirms: the broker acks (or nacks) every publish on this channel.
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let exchange = options.exchange();
        // Published, not yet confirmed: oldest first.
        let mut in_flight: VecDeque<(String, PublisherConfirm)> = VecDeque::new();
        for key in options.keys() {
            if in_flight.len() >= options.window {
                let (key, confirm) = in_flight.pop_front().expect("the window is full");
                check(&key, confirm).await?;
                confirmed(&key);
            }
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
            let confirm = channel
                .basic_publish(
                    exchange.as_str().into(),
                    ROUTING_KEY.into(),
                    // Not mandatory: the delayed-message plugin returns every delayed
                    // publish as unroutable yet delivers it later.
                    BasicPublishOptions::default(),
                    &body(&key, &options.to),
                    properties,
                )
                .await?; // sent; the confirm comes later
            in_flight.push_back((key, confirm));
        }
        for (key, confirm) in in_flight {
            check(&key, confirm).await?;
            confirmed(&key);
        }
        Ok(())
    }
    .await;
    // Every job is confirmed (or we failed): a stuck broker must not hang the exit.
    let _ =
        tokio::time::timeout(Duration::from_secs(5), connection.close(200, "done".into())).await;
    result
}

/// How long to wait for a confirm before giving up on the broker.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits for the confirm of `key`'s publish: an ack is success; a nack, a closed
/// channel (e.g. 404 when the exchange does not exist) or no answer within
/// [`CONFIRM_TIMEOUT`] is an error.
async fn check(key: &str, confirm: PublisherConfirm) -> Result<(), Box<dyn Error + Send + Sync>> {
    let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| format!("no confirm for {key} within {CONFIRM_TIMEOUT:?}"))??;
    match confirmation {
        Confirmation::Nack(_) => Err(format!("the broker nacked the publish of {key}").into()),
        _ => Ok(()),
    }
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
    let exchange = options.exchange();
    let started = std::time::Instant::now();
    let printed = publish(&options, |key| {
        println!(
            "published key={key} exchange={exchange} delay_ms={}",
            options.delay_ms
        )
    })
    .await;
    if let Err(e) = printed {
        eprintln!("publish failed: {e}");
        std::process::exit(1);
    }
    if options.count > 1 {
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "published {} jobs in {seconds:.2} s ({:.0} jobs/s, window {})",
            options.count,
            options.count as f64 / seconds,
            options.window
        );
    }
}
