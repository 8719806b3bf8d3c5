//! `postie status`: inbox counts by status and the depth of every queue.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::broker;
use crate::config::Settings;
use crate::inbox::Inbox;

/// Prints inbox counts by status and the depth of every queue.
pub(super) async fn run(settings: &Settings) -> anyhow::Result<()> {
    let inbox = Inbox::connect(&settings.database).await?;
    let counts = inbox.counts().await?;
    out!("inbox:");
    for (status, count) in &counts.by_status {
        out!("  {:<10} {count}", status.as_str());
    }
    out!("  duplicates suppressed: {}", counts.duplicates);
    out!("  leases taken over:     {}", counts.takeovers);
    let limit = settings
        .smtp
        .rate_limit
        .map_or("none".to_string(), |r| r.to_string());
    let last_minute = inbox.sent_last_minute().await?;
    out!(
        "send rate: {last_minute} sent in the last 60 s ({:.1}/s); limit {limit}",
        last_minute as f64 / 60.0
    );

    let topology = broker::resolve_topology(settings).await?;
    out!("delay mode: {}", topology.mode_name());
    let conn = broker::open(&settings.amqp, "postie-status").await?;
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
