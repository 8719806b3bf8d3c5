//! Pollers that feed `/metrics`: queue depths and the pending gauge.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::Service;
use crate::broker::DelayLayout;
use crate::ops::metrics::QueueLabel;

/// How often queue depths are polled for `/metrics`.
const DEPTH_POLL: Duration = Duration::from_secs(10);

impl Service {
    /// Polls the depth of every queue for `/metrics` until `stop` (or until a queue
    /// is missing, which closes the channel; the next session starts a new poller).
    pub(super) async fn spawn_depth_poller(
        &self,
        conn: &Connection,
        stop: CancellationToken,
    ) -> anyhow::Result<()> {
        let channel = conn.create_channel().await?;
        let topology = self.topology.clone();
        let metrics = self.worker.health().metrics().clone();
        let track_pending =
            self.settings.delay.track_pending && matches!(topology.delay(), DelayLayout::Ladder(_));
        let inbox = self.worker.inbox().clone();
        tokio::spawn(async move {
            'poll: loop {
                if track_pending {
                    if let Ok((_, total)) = inbox.pending(None, None, 0).await {
                        metrics.pending.set(total);
                    }
                }
                for queue in topology.queues() {
                    let passive = lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    match channel
                        .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                        .await
                    {
                        Ok(q) => metrics
                            .queue_depth
                            .get_or_create(&QueueLabel { queue })
                            .set(i64::from(q.message_count())),
                        Err(error) => {
                            tracing::debug!(%error, "queue depth poller stopped");
                            break 'poll;
                        }
                    };
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(DEPTH_POLL) => {}
                }
            }
            let _ = channel.close(200, "done".into()).await;
        });
        Ok(())
    }
}
