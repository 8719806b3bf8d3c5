//! Pollers that feed `/metrics`: queue depths and the pending gauge. Run by the
//! maintenance instance only (`maintenance.rs`), so one instance polls for all.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::Channel;

use super::Service;
use crate::ops::metrics::QueueLabel;
use crate::topology::DelayLayout;

/// How often queue depths are polled for `/metrics`.
pub(super) const DEPTH_POLL: Duration = Duration::from_secs(10);

impl Service {
    /// Polls the pending gauge (ladder mode) and the depth of every queue once. An
    /// error means the channel is gone (a missing queue closes it).
    pub(super) async fn poll_depths(&self, channel: &Channel) -> anyhow::Result<()> {
        let metrics = self.cx.metrics();
        let track_pending = self.cx.settings.delay.track_pending
            && matches!(self.cx.topology.delay(), DelayLayout::Ladder(_));
        if track_pending {
            if let Ok((_, total)) = self.cx.inbox.pending(None, None, 0).await {
                metrics.pending.set(total);
            }
        }
        for queue in self.cx.topology.queues() {
            let passive = lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let q = channel
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await?;
            metrics
                .queue_depth
                .get_or_create(&QueueLabel { queue })
                .set(i64::from(q.message_count()));
        }
        Ok(())
    }
}
