//! The CLI sub-commands other than `serve`: `migrate`, `topology`, `publish`, `status`.

use std::path::PathBuf;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::amqp;
use crate::config::Settings;
use crate::consumer::resolve_topology;
use crate::delay::{HEADER_PUBLISHED_AT, HEADER_X_DELAY};
use crate::inbox::Inbox;
use crate::job::{EmailJob, ParseRules};
use crate::topology::{Topology, ROUTING_KEY};

/// Applies pending migrations and prints what it applied.
pub async fn migrate(settings: &Settings) -> anyhow::Result<()> {
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    let applied = inbox.migrate().await?;
    if applied.is_empty() {
        out!("database is up to date");
    }
    for name in applied {
        out!("applied {name}");
    }
    Ok(())
}

/// Declares the topology (or deletes it) and prints the mode and the names.
pub async fn topology(settings: &Settings, delete: bool) -> anyhow::Result<()> {
    let topology = resolve_topology(settings).await?;
    let conn = amqp::connect(
        &settings.amqp.url,
        "postie-topology",
        settings.amqp.connect_timeout,
    )
    .await?;
    let channel = conn.create_channel().await?;
    if delete {
        topology.delete(&channel).await?;
        out!(
            "deleted every queue and exchange under {:?}",
            settings.topology.prefix
        );
    } else {
        topology.declare(&channel).await?;
        out!(
            "delay mode: {} (configured: {})",
            topology.mode_name(),
            settings.delay.mode.as_str()
        );
        out!("exchanges: {}", topology.exchanges().join(", "));
        out!("queues:    {}", topology.queues().join(", "));
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// A job to publish: a JSON file, or fields from flags.
#[derive(Debug, Default, Clone)]
pub struct PublishRequest {
    /// Read the body from this file (`-` for stdin).
    pub file: Option<PathBuf>,
    /// `key`.
    pub key: Option<String>,
    /// `order_id`.
    pub order_id: Option<String>,
    /// `type`.
    pub kind: Option<String>,
    /// `from`.
    pub from: Option<String>,
    /// `to`.
    pub to: Vec<String>,
    /// `subject`.
    pub subject: Option<String>,
    /// `text`.
    pub text: Option<String>,
    /// `html`.
    pub html: Option<String>,
    /// The `x-delay` header.
    pub delay: Option<Duration>,
}

impl PublishRequest {
    /// The JSON body this request describes.
    pub fn body(&self) -> anyhow::Result<Vec<u8>> {
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

/// Publishes one job to the contract exchange with a publisher confirm.
pub async fn publish(settings: &Settings, request: &PublishRequest) -> anyhow::Result<()> {
    let body = request.body()?;
    // Check locally first, so a typo fails here rather than in the DLQ.
    let job = EmailJob::parse(
        &body,
        &ParseRules {
            max_body_bytes: settings.worker.max_body_bytes,
            default_from: settings.smtp.default_from.as_deref(),
        },
    )
    .map_err(|e| anyhow::anyhow!("refusing to publish: {e}"))?;
    // Only the entry exchange's name is needed, and it is the same in every mode.
    let topology = Topology::new(&settings.topology, &settings.delay, settings.delay.mode);
    let conn = amqp::connect(
        &settings.amqp.url,
        "postie-publish",
        settings.amqp.connect_timeout,
    )
    .await?;
    let channel = amqp::confirm_channel(&conn).await?;
    let mut headers = FieldTable::default();
    if let Some(delay) = request.delay {
        amqp::set_int(&mut headers, HEADER_X_DELAY, delay.as_millis() as i64);
    }
    let now = chrono::Utc::now();
    amqp::set_int(&mut headers, HEADER_PUBLISHED_AT, now.timestamp_millis());
    let properties = amqp::job_properties()
        .with_headers(headers)
        .with_timestamp(now.timestamp() as u64);
    amqp::publish_confirmed(
        &channel,
        &topology.delayed_exchange(),
        ROUTING_KEY,
        false,
        &body,
        properties,
    )
    .await?;
    out!("published {} to {}", job.key, topology.delayed_exchange());
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// Prints inbox counts by status and the depth of every queue.
pub async fn status(settings: &Settings) -> anyhow::Result<()> {
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    let counts = inbox.counts().await?;
    out!("inbox:");
    for (status, count) in &counts.by_status {
        out!("  {status:<10} {count}");
    }
    out!("  duplicates suppressed: {}", counts.duplicates);
    out!("  leases taken over:     {}", counts.takeovers);

    let topology = resolve_topology(settings).await?;
    out!("delay mode: {}", topology.mode_name());
    let conn = amqp::connect(
        &settings.amqp.url,
        "postie-status",
        settings.amqp.connect_timeout,
    )
    .await?;
    out!("queues (ready messages, consumers):");
    let mut channel = conn.create_channel().await?;
    for queue in topology.queues() {
        let options = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match channel
            .queue_declare(queue.as_str().into(), options, FieldTable::default())
            .await
        {
            Ok(q) => out!(
                "  {queue:<24} {:>8} {:>4}",
                q.message_count(),
                q.consumer_count()
            ),
            Err(_) => {
                out!("  {queue:<24} (missing: run `postie topology`)");
                // A failed passive declare closes the channel.
                channel = conn.create_channel().await?;
            }
        }
    }
    let _ = channel.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// Cancels `key` up to `revision` (None: the newest seen) and says what that meant.
pub async fn cancel(settings: &Settings, key: &str, revision: Option<i32>) -> anyhow::Result<()> {
    let key = crate::job::IdempotencyKey::parse(key).map_err(|e| anyhow::anyhow!("{e}"))?;
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    inbox.migrate().await?;
    let cancelled = inbox.cancel(key.as_str(), revision).await?;
    let what = match cancelled.prior_status.as_str() {
        "sent" => "already sent: nothing to cancel".to_string(),
        "sending" => {
            "being sent right now: it may still go out; later deliveries are cancelled".to_string()
        }
        "new" => format!(
            "not seen yet: kept as a tombstone; a job for it up to revision {} will be skipped",
            cancelled.covers
        ),
        _ => format!("cancelled (revisions up to {})", cancelled.covers),
    };
    out!("{key}: {what}");
    Ok(())
}

/// Lists and counts scheduled jobs (ladder mode).
pub async fn pending(
    settings: &Settings,
    due_before: Option<&str>,
    key: Option<&str>,
    limit: i64,
) -> anyhow::Result<()> {
    let due_before_ms = due_before.map(parse_instant).transpose()?;
    let inbox = Inbox::new(&settings.database)?;
    inbox.check(&settings.database.url).await?;
    let (jobs, total) = inbox.pending(due_before_ms, key, limit).await?;
    for job in &jobs {
        let due = chrono::DateTime::from_timestamp_millis(job.due_ms)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            .unwrap_or_default();
        out!("{due}  rev {:<3} {}", job.revision, job.key);
    }
    out!(
        "{total} pending{}",
        if (jobs.len() as i64) < total {
            format!(" ({} shown)", jobs.len())
        } else {
            String::new()
        }
    );
    Ok(())
}

/// An RFC 3339 time, or a duration from now (`10m`), in Unix ms.
fn parse_instant(text: &str) -> anyhow::Result<i64> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(text) {
        return Ok(at.timestamp_millis());
    }
    let ahead = humantime::parse_duration(text).map_err(|_| {
        anyhow::anyhow!("{text:?} is neither an RFC 3339 time nor a duration like 10m")
    })?;
    Ok(chrono::Utc::now().timestamp_millis() + ahead.as_millis() as i64)
}
