//! Pollers that feed `/metrics`: queue depths, the pending gauge, and the bounce and
//! complaint rates (with their warnings). Run by the
//! maintenance instance only (`maintenance.rs`), so one instance polls for all.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::Channel;

use super::Service;
use crate::ops::metrics::{FeedbackKind, QueueLabel, RateLabel, RateWindow};
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

/// How often the bounce and complaint rates are read for `/metrics` and the warnings.
pub(super) const RATE_POLL: Duration = Duration::from_secs(60);

/// The rates above their warning threshold at the last poll, by (type, kind, window):
/// a warning is logged when a rate goes over, and a line when it comes back under.
pub(super) type Warned = std::collections::HashSet<(String, FeedbackKind, RateWindow)>;

impl Service {
    /// Reads the bounce and complaint rates per job type, sets their gauges and logs
    /// each one that crossed its threshold (`suppression.bounce_rate_warning`,
    /// `.complaint_rate_warning`, once its window holds `rate_min_sends` sends).
    pub(super) async fn poll_rates(&self, warned: &mut Warned) {
        let deadline = self.cx.settings.database.statement_timeout;
        let rates = match tokio::time::timeout(deadline, self.cx.inbox.rates()).await {
            Ok(Ok(rates)) => rates,
            Ok(Err(error)) => return tracing::debug!(%error, "bounce and complaint rates not read"),
            Err(_) => return tracing::debug!("bounce and complaint rates: no answer in time"),
        };
        let settings = &self.cx.settings.suppression;
        let gauge = &self.cx.metrics().feedback_rate;
        gauge.clear();
        let mut over = Warned::new();
        for r in &rates {
            for (w, window) in [RateWindow::Hour, RateWindow::Day].into_iter().enumerate() {
                for (feedback, count, limit) in [
                    (
                        FeedbackKind::Bounce,
                        r.bounces,
                        settings.bounce_rate_warning,
                    ),
                    (
                        FeedbackKind::Complaint,
                        r.complaints,
                        settings.complaint_rate_warning,
                    ),
                ] {
                    let Some(rate) = r.rate(count, w) else {
                        continue;
                    };
                    let label = RateLabel {
                        kind: r.kind.clone(),
                        feedback,
                        window,
                    };
                    gauge.get_or_create(&label).set(rate);
                    if r.over(rate, w, limit, settings.rate_min_sends) {
                        over.insert((r.kind.clone(), feedback, window));
                    }
                }
            }
        }
        for (kind, feedback, window) in over.difference(warned) {
            tracing::warn!(
                r#type = %kind, kind = feedback.as_str(), window = window.as_str(),
                "the {} rate of this job type is over its warning threshold: providers review \
                 or suspend senders above such rates (postie status shows the figures)",
                feedback.as_str()
            );
        }
        for (kind, feedback, window) in warned.difference(&over) {
            tracing::info!(r#type = %kind, kind = feedback.as_str(), window = window.as_str(), "the rate is back under its warning threshold");
        }
        *warned = over;
    }
}
