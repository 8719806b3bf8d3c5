//! Record an order and enqueue its confirmation email in one transaction, through
//! postie's transactional outbox, using tokio-postgres directly (see "Transactional
//! outbox" in the README). Copy it into your own service: it needs only
//! `tokio-postgres`, `tokio` and `serde_json`, nothing from postie.
//!
//! ```sh
//! postie outbox install --database postgres://app@127.0.0.1/shop   # once
//! cargo run --example outbox -- --to alice@example.com --delay-ms 10000
//! ```
//!
//! The order row and the email job commit together or not at all: postie's relay
//! (`outbox.sources` in `postie serve`) publishes the job after the commit, and the
//! inbox's key makes it one email. A job rolled back with the order is never sent.
//!
//! Every setting is a flag, or else an environment variable, or else a default:
//!
//! | flag | variable | default |
//! |---|---|---|
//! | `--database-url` | `PRODUCER_DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/shop` |
//! | `--order-id` | `ORDER_ID` | `<unix ms>` |
//! | `--to` | `EMAIL_TO` | `alice@example.com` |
//! | `--delay-ms` | `EMAIL_DELAY_MS` | `5000` (0 = send now) |
//! | `--rollback` | | roll the transaction back instead of committing |
//!
//! On success it prints `enqueued key=<key> outbox_id=<id> delay_ms=<n>` after the
//! commit, or with `--rollback` `rolled back key=<key>`. Any failure exits non-zero:
//! a refused job (`postie.enqueue` checks the key and the recipients) rolls the order
//! back with it.

use std::error::Error;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The shop's own table; in a real service this is your business data.
const ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS example_orders (
    id         text PRIMARY KEY,
    email      text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)";

/// The deadline of the connection and of each statement.
const DEADLINE: Duration = Duration::from_secs(10);

/// What to enqueue, and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// The producer's PostgreSQL, where `postie outbox install` created `postie.enqueue`.
    pub database_url: String,
    /// The order's id; the job's key is `order-<id>:order_confirmation`.
    pub order_id: String,
    /// The recipient.
    pub to: String,
    /// How long after the commit the email is due, milliseconds.
    pub delay_ms: i64,
    /// Roll the transaction back instead of committing it.
    pub rollback: bool,
}

impl Options {
    /// From flags (`--name value`, `--rollback`), else `env(VARIABLE)`, else defaults.
    pub fn from_args(
        args: impl IntoIterator<Item = String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut flags = std::collections::HashMap::new();
        let mut rollback = false;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--rollback" => rollback = true,
                "--database-url" | "--order-id" | "--to" | "--delay-ms" => {
                    let value = args.next().ok_or_else(|| format!("{arg} needs a value"))?;
                    flags.insert(arg[2..].to_string(), value);
                }
                _ => return Err(format!("unexpected argument {arg:?}")),
            }
        }
        let setting = |flag: &str, variable: &str, default: String| {
            flags
                .get(flag)
                .cloned()
                .or_else(|| env(variable).filter(|v| !v.is_empty()))
                .unwrap_or(default)
        };
        let delay = setting("delay-ms", "EMAIL_DELAY_MS", "5000".into());
        let delay_ms = delay.trim().parse().map_err(|_| {
            format!("delay must be an integer number of milliseconds, not {delay:?}")
        })?;
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        Ok(Self {
            database_url: setting(
                "database-url",
                "PRODUCER_DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/shop".into(),
            ),
            order_id: setting("order-id", "ORDER_ID", now_ms.to_string()),
            to: setting("to", "EMAIL_TO", "alice@example.com".into()),
            delay_ms,
            rollback,
        })
    }

    /// The job's idempotency key: from the business data, so that enqueueing the same
    /// event twice yields one email.
    pub fn key(&self) -> String {
        format!("order-{}:order_confirmation", self.order_id)
    }

    /// The line printed once the transaction ended, `id` the outbox row's.
    pub fn outcome(&self, id: i64) -> String {
        if self.rollback {
            format!("rolled back key={}", self.key())
        } else {
            format!(
                "enqueued key={} outbox_id={id} delay_ms={}",
                self.key(),
                self.delay_ms
            )
        }
    }
}

/// Writes the order and its email job in one transaction (or rolls both back) and
/// returns the outbox row's id.
pub async fn enqueue(options: &Options) -> Result<i64, Box<dyn Error + Send + Sync>> {
    let mut config: tokio_postgres::Config = options.database_url.parse()?;
    config.connect_timeout(DEADLINE);
    config.options(format!("-c statement_timeout={}", DEADLINE.as_millis()));
    let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
    let driver = tokio::spawn(connection);
    let job = serde_json::json!({
        "key": options.key(),
        "from": "Shop <noreply@shop.example>",
        "to": [options.to],
        "subject": format!("Order {} confirmed", options.order_id),
        "text": "Hello from the Rust outbox example.",
    });
    client.batch_execute(ORDERS_TABLE).await?;
    // Dropped without a commit, the transaction rolls back: the order and the job go
    // together.
    let tx = client.transaction().await?;
    tx.execute(
        "INSERT INTO example_orders (id, email) VALUES ($1, $2)",
        &[&options.order_id, &options.to],
    )
    .await?;
    // Same transaction: the job is visible to the relay only after COMMIT.
    let row = tx
        .query_one(
            "SELECT postie.enqueue($1::text::jsonb, make_interval(secs => $2::bigint / 1000.0))",
            &[&job.to_string(), &options.delay_ms.max(0)],
        )
        .await?;
    let id: i64 = row.get(0);
    if options.rollback {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    drop(client);
    let _ = driver.await;
    Ok(id)
}

#[tokio::main]
async fn main() {
    let options =
        match Options::from_args(std::env::args().skip(1), |name| std::env::var(name).ok()) {
            Ok(options) => options,
            Err(error) => {
                eprintln!("outbox failed: {error}");
                std::process::exit(2);
            }
        };
    match enqueue(&options).await {
        Ok(id) => println!("{}", options.outcome(id)),
        Err(error) => {
            eprintln!("outbox failed: {error}");
            std::process::exit(1);
        }
    }
}
