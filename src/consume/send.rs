//! The send role's handler, and the one place a [`Disposition`] is carried out:
//! publish a copy (confirmed, its `postie-*` headers sealed) and then ack, ack alone,
//! or leave the delivery unacked; and [`Service::admit`], the door every delivery
//! passes as it is read, in every loop: a `postie-*` header without postie's seal is
//! dropped and counted.

use std::time::Duration;

use lapin::message::Delivery;
use lapin::BasicProperties;
use tracing::Instrument;

use super::publisher::Publisher;
use super::Service;
use crate::broker::{self, Acks, PublishError};
use crate::config::KeyNamespace;
use crate::headers::{self, header_int, HEADER_ATTEMPT};
use crate::ops::backoff::Backoff;
use crate::topology::{DelayLayout, LaneId};
use crate::work::{Disposition, Outcome, Target};

impl Service {
    /// One delivery of `lane`'s send queue: the worker names its outcome, the outcome
    /// its disposition. Still unclaimed at `mark_at`, it is marked as arrived.
    pub(super) async fn handle_send(
        &self,
        delivery: Delivery,
        (mark_at, lane): (Option<tokio::time::Instant>, LaneId),
        publish: &Publisher,
        acks: &Acks,
    ) {
        let headers = delivery.properties.headers().as_ref();
        let attempt = header_int(headers, HEADER_ATTEMPT).unwrap_or(0);
        let span = tracing::info_span!(
            "delivery",
            key = tracing::field::Empty,
            attempt,
            outcome = tracing::field::Empty,
            redelivered = delivery.redelivered,
        );
        // Continue the producer's trace, if the job carries one.
        let parent = crate::ops::telemetry::parent_context(headers);
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
        let metrics = self.cx.metrics().clone();
        metrics.jobs_received.inc();
        metrics.in_flight.inc();
        let started = std::time::Instant::now();
        async {
            let timestamp = *delivery.properties.timestamp();
            let user_id = delivery.properties.user_id().as_ref().map(|u| u.as_str());
            // The scheduled key is read from the body only if it is needed: the
            // worker's parse is the delivery's one parse otherwise.
            let scheduled = || self.scheduled_key(&delivery);
            let key = || scheduled().map(|(key, _)| key);
            let work = self
                .worker
                .process(&delivery.data, headers, (timestamp, user_id), lane);
            let processed = self.arrivals.watch(mark_at, key, work).await;
            let disposition = match processed {
                Ok(outcome) => {
                    self.finish_unclaimed(&outcome, scheduled).await;
                    self.count_lane(lane, &outcome);
                    outcome.settle(&metrics, &self.cx.topology, headers)
                }
                Err(interrupted) => {
                    tracing::warn!(%interrupted, "leaving the delivery unacked for redelivery");
                    Disposition::LeaveUnacked
                }
            };
            if self.dispose(disposition, &delivery, publish, acks).await {
                metrics
                    .processing_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
        }
        .instrument(span)
        .await;
        metrics.in_flight.dec();
    }

    /// `delivery` as postie may trust it: its `postie-*` headers without a valid seal
    /// (a producer's, or forged) dropped and counted, the others and a producer's own
    /// (`x-delay`, `postie-published-at`, `traceparent`, …) kept (`headers::Seal`).
    pub(super) fn admit(&self, mut delivery: Delivery) -> Delivery {
        let headers = delivery.properties.headers().as_ref();
        let admitted = self.cx.seal.admit(headers, &delivery.data);
        if let Some(headers) = admitted.headers {
            delivery.properties = std::mem::take(&mut delivery.properties).with_headers(headers);
        }
        if admitted.dropped > 0 {
            let metrics = self.cx.metrics();
            metrics.headers_dropped.inc_by(admitted.dropped as u64);
            tracing::debug!(
                dropped = admitted.dropped,
                "postie-* headers without postie's seal dropped at intake"
            );
        }
        delivery
    }

    /// A sent email counted in its lane, with its lateness (`postie_lane_*`).
    fn count_lane(&self, lane: LaneId, outcome: &Outcome) {
        let Outcome::Sent { lateness_ms, .. } = outcome else {
            return;
        };
        let metrics = self.cx.metrics();
        let label = &self.lane_labels[lane.0];
        metrics.lane_sent.get_or_create(label).inc();
        metrics
            .lane_lateness_seconds
            .get_or_create(label)
            .observe(*lateness_ms as f64 / 1000.0);
    }

    /// Carries out `disposition` for `delivery`; true if the delivery was acked.
    pub(super) async fn dispose(
        &self,
        disposition: Disposition,
        delivery: &Delivery,
        publish: &Publisher,
        acks: &Acks,
    ) -> bool {
        match disposition {
            Disposition::LeaveUnacked => return false,
            Disposition::Ack => {}
            Disposition::Republish(target) | Disposition::DeadLetter(target) => {
                if let Err(error) = self.publish_retrying(publish, delivery, target).await {
                    tracing::warn!(%error, "could not publish the outcome; leaving the delivery unacked");
                    return false;
                }
            }
        }
        acks.done(delivery.delivery_tag);
        true
    }

    /// Publishes a copy of the delivery (confirmed, persistent) to `target`, retrying
    /// while the broker refuses it; gives up only if the channel is gone (the delivery
    /// then returns to its queue by itself) or on hard stop.
    async fn publish_retrying(
        &self,
        publish: &Publisher,
        delivery: &Delivery,
        target: Target,
    ) -> Result<(), PublishError> {
        let Target {
            exchange,
            routing_key,
            headers,
        } = target;
        let mut headers = headers::without_broker_death(headers);
        // postie's own headers on the copy, sealed for its body (`headers::Seal`).
        self.cx.seal.seal(&mut headers, &delivery.data);
        let keep_user_id = self.cx.settings.worker.key_namespace == KeyNamespace::UserId;
        let properties: BasicProperties =
            broker::copy_properties(&delivery.properties, keep_user_id)
                .with_delivery_mode(2)
                .with_headers(headers);
        // Plugin mode: the plugin returns a mandatory publish at once and still delivers it later.
        let mandatory = !(exchange == self.cx.topology.delayed_exchange()
            && self.cx.topology.delay() == DelayLayout::Plugin);
        let mut backoff = Backoff::new(
            Duration::from_millis(100),
            self.cx.settings.worker.outage_backoff_max,
        );
        loop {
            match publish
                .publish(
                    &exchange,
                    &routing_key,
                    mandatory,
                    &delivery.data,
                    properties.clone(),
                )
                .await
            {
                Ok(()) => return Ok(()),
                // The connection is gone: the delivery returns to its queue by itself.
                Err(error) if !publish.connection_stands() => return Err(error),
                // Refused, nacked, or the channel closed by the broker (replaced on the
                // next try): retry with backoff.
                Err(error) => {
                    tracing::warn!(%error, "republish refused; retrying");
                    if !backoff.wait(&self.cx.hard_stop).await {
                        return Err(error);
                    }
                }
            }
        }
    }
}
