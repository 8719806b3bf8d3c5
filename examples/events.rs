//! Consume postie's delivery events (see "Delivery events" in the README) using lapin
//! directly: a queue bound to the topic exchange `<prefix>.events`, each event
//! acknowledged after it was handled, duplicates (delivery is at least once) skipped
//! by the event's id. Needs only `lapin`, `tokio`, `futures-util` and `serde_json`.
//!
//! ```sh
//! cargo run --example events -- --binding 'email.dead.*'
//! ```
//!
//! | flag | variable | default |
//! |---|---|---|
//! | `--amqp-url` | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `--prefix` | `POSTIE_PREFIX` | `postie` (binds to exchange `<prefix>.events`) |
//! | `--queue` | `EVENTS_QUEUE` | none: a temporary queue `producer.events-<pid>-<ms>`, deleted with the connection; a name: a durable quorum queue that keeps events while this consumer is down |
//! | `--binding` | `EVENTS_BINDING` | `email.#` (every event; `email.<outcome>.<type>`) |
//! | `--count` | `EVENTS_COUNT` | `0` (run until stopped; more: exit after that many distinct events) |
//!
//! It prints `listening queue=<q> exchange=<x> binding=<b>` once bound, then one line
//! per event, `event id=<id> outcome=<o> key=<k> type=<t> routing_key=<r>`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::error::Error;
use std::time::{SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

/// How many event ids are remembered for dedupe (a real consumer keeps them with its
/// own data, e.g. a unique column).
const REMEMBERED: usize = 100_000;

/// Where to listen, and for how long.
#[derive(Debug, Clone)]
pub struct Options {
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// postie's topology prefix.
    pub prefix: String,
    /// A durable queue's name, or None for a temporary one.
    pub queue: Option<String>,
    /// The binding key.
    pub binding: String,
    /// Exit after this many distinct events (0: never).
    pub count: u64,
}

impl Options {
    /// From flags (`--name value` or `--name=value`), else `env(VARIABLE)`, else defaults.
    pub fn from_args(
        args: impl IntoIterator<Item = String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut flags = HashMap::new();
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
            if !["amqp-url", "prefix", "queue", "binding", "count"].contains(&name.as_str()) {
                return Err(format!("unknown flag --{name}"));
            }
            flags.insert(name, value);
        }
        let setting = |flag: &str, variable: &str| {
            flags
                .get(flag)
                .cloned()
                .or_else(|| env(variable).filter(|v| !v.is_empty()))
        };
        let count = setting("count", "EVENTS_COUNT").unwrap_or_else(|| "0".into());
        let count: u64 = count
            .trim()
            .parse()
            .map_err(|_| format!("count must be a whole number, not {count:?}"))?;
        Ok(Self {
            amqp_url: setting("amqp-url", "AMQP_URL")
                .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            prefix: setting("prefix", "POSTIE_PREFIX").unwrap_or_else(|| "postie".into()),
            queue: setting("queue", "EVENTS_QUEUE"),
            binding: setting("binding", "EVENTS_BINDING").unwrap_or_else(|| "email.#".into()),
            count,
        })
    }

    /// The exchange postie publishes events to.
    pub fn exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }
}

/// One event as this consumer prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's id (dedupe by it).
    pub id: String,
    /// sent, dead, suppressed, throttled, cancelled, bounced, complained.
    pub outcome: String,
    /// The job's key.
    pub key: String,
    /// The job's type, or "none".
    pub kind: String,
    /// The routing key it came with.
    pub routing_key: String,
}

/// Binds the queue, calls `listening(queue)` once it is bound, then `on_event` for
/// each distinct event until `options.count` of them (or forever).
pub async fn consume(
    options: &Options,
    listening: impl FnOnce(&str),
    mut on_event: impl FnMut(&Event),
) -> Result<(), Box<dyn Error>> {
    let conn = Connection::connect(&options.amqp_url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    let (queue, declare, arguments) = match &options.queue {
        Some(name) => {
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            let durable = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            (name.clone(), durable, arguments)
        }
        None => {
            let ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
            let temporary = QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            };
            let name = format!("producer.events-{}-{ms}", std::process::id());
            (name, temporary, FieldTable::default())
        }
    };
    channel
        .queue_declare(queue.as_str().into(), declare, arguments)
        .await?;
    channel
        .queue_bind(
            queue.as_str().into(),
            options.exchange().as_str().into(),
            options.binding.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel.basic_qos(100, BasicQosOptions::default()).await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "events-example".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    listening(&queue);
    let (mut seen, mut order) = (HashSet::new(), VecDeque::new());
    let mut handled = 0;
    while options.count == 0 || handled < options.count {
        let Some(delivery) = deliveries.next().await else {
            return Err("the broker ended the consumer".into());
        };
        let delivery = delivery?;
        let body: serde_json::Value = serde_json::from_slice(&delivery.data)?;
        let text = |name: &str| body[name].as_str().unwrap_or("none").to_string();
        let event = Event {
            id: text("id"),
            outcome: text("outcome"),
            key: text("key"),
            kind: text("type"),
            routing_key: delivery.routing_key.to_string(),
        };
        if seen.insert(event.id.clone()) {
            order.push_back(event.id.clone());
            if order.len() > REMEMBERED {
                seen.remove(&order.pop_front().unwrap_or_default());
            }
            on_event(&event);
            handled += 1;
        }
        // Acked after it was handled: a crash before this gets it again.
        delivery.ack(BasicAckOptions::default()).await?;
    }
    conn.close(200, "done".into()).await?;
    Ok(())
}

#[tokio::main]
async fn main() {
    let options = match Options::from_args(std::env::args().skip(1), |v| std::env::var(v).ok()) {
        Ok(options) => options,
        Err(error) => {
            eprintln!("events: {error}");
            std::process::exit(2);
        }
    };
    let exchange = options.exchange();
    let listening = |queue: &str| {
        println!(
            "listening queue={queue} exchange={exchange} binding={}",
            options.binding
        );
    };
    let printed = |e: &Event| {
        println!(
            "event id={} outcome={} key={} type={} routing_key={}",
            e.id, e.outcome, e.key, e.kind, e.routing_key
        );
    };
    if let Err(error) = consume(&options, listening, printed).await {
        eprintln!("events failed: {error}");
        std::process::exit(1);
    }
}
