//! `postie publish`: one job to the contract exchange, with a publisher confirm.

use std::path::PathBuf;
use std::time::Duration;

use lapin::types::FieldTable;

use crate::broker;
use crate::config::{KeyNamespace, Settings};
use crate::contract::PLUGIN_MAX_DELAY;
use crate::contract::{EmailJob, ParseRules};
use crate::endpoint::percent_decode;
use crate::headers::{self, HEADER_PUBLISHED_AT, HEADER_X_DELAY};
use crate::topology::{Topology, ROUTING_KEY};

/// A job to publish: a JSON file, or fields from flags.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct PublishArgs {
    /// Read the JSON body from a file (`-` for stdin) instead of the flags below.
    #[arg(long, conflicts_with_all = ["key", "order_id", "kind", "to", "subject", "text", "html"])]
    pub file: Option<PathBuf>,
    /// Idempotency key (default: ORDER_ID:TYPE).
    #[arg(long)]
    pub key: Option<String>,
    /// Order id.
    #[arg(long)]
    pub order_id: Option<String>,
    /// Notification type.
    #[arg(long = "type")]
    pub kind: Option<String>,
    /// Sender (default: transport.default_from).
    #[arg(long)]
    pub from: Option<String>,
    /// Recipient; repeat for more.
    #[arg(long)]
    pub to: Vec<String>,
    /// Subject line.
    #[arg(long)]
    pub subject: Option<String>,
    /// Plain-text body.
    #[arg(long)]
    pub text: Option<String>,
    /// HTML body.
    #[arg(long)]
    pub html: Option<String>,
    /// Delay before sending, e.g. 90s or 2h (sets x-delay).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub delay: Option<Duration>,
    /// Not before this instant, RFC 3339 with an offset, e.g. 2027-03-28T10:00:00+02:00
    /// (sets the body's send_at; with --delay too, the later of the two).
    #[arg(long)]
    pub at: Option<String>,
}

impl PublishArgs {
    /// The JSON body these arguments describe.
    pub(crate) fn body(&self) -> anyhow::Result<Vec<u8>> {
        let body = self.given_body()?;
        let Some(at) = &self.at else {
            return Ok(body);
        };
        // The body's own send_at, replaced: what --at says is what the job gets.
        let mut job: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| anyhow::anyhow!("--at needs a JSON object as the body: {e}"))?;
        let Some(members) = job.as_object_mut() else {
            anyhow::bail!("--at needs a JSON object as the body");
        };
        members.insert("send_at".into(), at.clone().into());
        Ok(serde_json::to_vec(&job)?)
    }

    fn given_body(&self) -> anyhow::Result<Vec<u8>> {
        if let Some(path) = &self.file {
            return Ok(if path.as_os_str() == "-" {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)?;
                buf
            } else {
                std::fs::read(path)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?
            });
        }
        let mut job = serde_json::Map::new();
        let mut put = |name: &str, value: &Option<String>| {
            if let Some(v) = value {
                job.insert(name.into(), v.clone().into());
            }
        };
        put("key", &self.key);
        put("order_id", &self.order_id);
        put("type", &self.kind);
        put("from", &self.from);
        put("subject", &self.subject);
        put("text", &self.text);
        put("html", &self.html);
        job.insert("to".into(), self.to.clone().into());
        Ok(serde_json::to_vec(&job)?)
    }
}

/// The `x-delay` to publish with: `--delay`, or the time left to `send_at` if that
/// is later (at most the plugin's 2^32-1 ms). The ladder's relay reads `send_at`
/// itself, but in plugin mode nothing reads it before the plugin has held the job
/// for its `x-delay`; either way the due time is the later of the two, so this is
/// right whichever mode `auto` finds (a job out of the plugin early is sent back to
/// wait the rest).
fn x_delay_ms(job: &EmailJob, delay: Option<Duration>, now_ms: i64) -> i64 {
    let delay_ms = delay.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let cap = i64::try_from(PLUGIN_MAX_DELAY.as_millis()).unwrap_or(i64::MAX);
    let until = job
        .send_at_ms
        .map_or(0, |at| at.saturating_sub(now_ms).min(cap));
    delay_ms.max(until)
}

/// Publishes one job to the contract exchange with a publisher confirm.
pub(super) async fn run(settings: &Settings, args: &PublishArgs) -> anyhow::Result<()> {
    let body = args.body()?;
    // Check locally first, so a typo fails here rather than in the DLQ.
    let job = EmailJob::parse(&body, &ParseRules::from_settings(settings))
        .map_err(|e| anyhow::anyhow!("refusing to publish: {e}"))?;
    // Only the entry exchange's name is needed, and it is the same in every mode.
    let topology = Topology::new(&settings.topology, &settings.delay, settings.delay.mode);
    let connected = broker::connect(
        &settings.amqp.addresses()?,
        "postie-publish",
        settings.amqp.connect_timeout,
    )
    .await?;
    let conn = connected.connection;
    let channel = broker::confirm_channel(&conn).await?;
    let mut table = FieldTable::default();
    let now = chrono::Utc::now();
    let delay_ms = x_delay_ms(&job, args.delay, now.timestamp_millis());
    if delay_ms > 0 {
        headers::set_int(&mut table, HEADER_X_DELAY, delay_ms);
    }
    headers::set_int(&mut table, HEADER_PUBLISHED_AT, now.timestamp_millis());
    let mut properties = broker::job_properties()
        .with_headers(table)
        .with_timestamp(now.timestamp() as u64);
    let mut key = job.key.clone();
    if settings.worker.key_namespace == KeyNamespace::UserId {
        // Per-producer keys: publish as the user this connection logged in as.
        let user = url::Url::parse(&connected.address)
            .ok()
            .map(|url| percent_decode(url.username()))
            .filter(|user| !user.is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "worker.key_namespace = \"user_id\": amqp.url {} names no user to publish as",
                    connected.address
                )
            })?;
        key = key.in_namespace(&user);
        properties = properties.with_user_id(user.as_str().into());
    }
    broker::publish_confirmed(
        &channel,
        topology.delayed_exchange(),
        ROUTING_KEY,
        false,
        &body,
        properties,
    )
    .await?;
    out!("published {key} to {}", topology.delayed_exchange());
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
