//! The relay of the producers' transactional outboxes (issue 31; `outbox.sources`),
//! on the current broker session's confirm channel (`Service::session_publisher`).
//!
//! One task per source for the life of `serve`, so that a broker outage neither
//! closes the sources' connections nor hides their rows' age: without a session the
//! rows wait and the oldest one's age is still read. It holds a connection for the
//! batches and,
//! with `outbox.listen`, one that `LISTEN`s on `postie_outbox`: `postie.enqueue`'s
//! notification, delivered at the producer's commit, starts a pass at once; polling
//! every `outbox.poll_interval` is the fallback (and all there is without LISTEN). A
//! full batch is followed at once. Each pass takes the oldest rows no other relay
//! holds (`FOR UPDATE SKIP LOCKED`: several instances relay one source together),
//! publishes each to `<p>.delayed` as a producer would (`x-delay` = due − enqueued,
//! `postie-published-at` = the enqueue, persistent, `message_id` = the key), awaits
//! every confirm, then deletes them and commits (`outbox::relay_batch`); the whole
//! pass is under `database.statement_timeout + amqp.connect_timeout`.
//!
//! A source that cannot be reached, or does not answer, pauses its own relay: one
//! line when it goes down and one when it comes back (its URL redacted), its
//! `outbox_source_up` gauge, `/readyz`'s detail line; its connections are rebuilt
//! with backoff (`ops::backoff`) while the other sources go on. A refused publish
//! leaves the rows where they are and backs off too. At least once: a batch whose
//! confirms arrived but whose delete did not commit is published again, and the
//! inbox's key makes the email once.
//!
//! A row that can never be published does not stop the rows after it (issue 45): one
//! over `worker.max_body_bytes`, or whose times `postie.take` could not compute, is
//! set aside unpublished; when the broker refuses a batch with a 406 (a message over
//! its `max_message_size` closes the channel, and every publish in flight with it),
//! the batch is published again one row at a time, and the row the broker refuses
//! alone is set aside with the broker's words. Set aside is `postie.reject`: moved to
//! `postie.outbox_rejected` in the batch's transaction, counted
//! (`postie_outbox_rejected_total`) and shown by `postie status`. A source whose
//! outbox is older than version 3 has nowhere to set rows aside: its refused rows
//! wait as before, and the relay says once, at connect, to run `postie outbox install`.

mod rows;

use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::publisher::Publisher;
use super::Service;
use crate::broker::{PublishError, ROUTING_KEY};
use crate::inbox::OutboxError;
use crate::ops::backoff::Backoff;
use crate::ops::metrics::SourceLabel;
use crate::outbox::{
    oldest_seconds, relay_batch, version, Batch, Refused, Row, Source, REJECTS_FROM,
};
use rows::screen;

impl Service {
    /// Starts the relay of every outbox source, one task each, for the life of
    /// `serve`; each ends with `stop`.
    pub(super) fn spawn_outbox(
        &self,
        stop: &CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.outbox
            .iter()
            .map(|source| {
                let (service, source, stop) = (self.clone(), source.clone(), stop.clone());
                tokio::spawn(async move { service.relay_source(&source, &stop).await })
            })
            .collect()
    }

    /// Relays `source` until `stop`, reconnecting with backoff while it is down.
    async fn relay_source(&self, source: &Source, stop: &CancellationToken) {
        let max = self.cx.settings.worker.outage_backoff_max;
        let mut backoff = Backoff::new(Duration::from_millis(200), max);
        while !stop.is_cancelled() {
            let Err(cause) = self.relay_connected(source, stop, &mut backoff).await else {
                return;
            };
            let wait = backoff.failed();
            if self.cx.health.set_outbox_source(&source.name, false) {
                tracing::error!(source = %source.name, url = %source.shown, %cause, retry_in = ?wait,
                    "outbox source unavailable; its rows wait there, the other sources go on");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Connects to `source` and relays its passes; `Ok` once `stop`, the cause in
    /// words once the source fails (a statement's error, no answer, a lost connection).
    async fn relay_connected(
        &self,
        source: &Source,
        stop: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<(), String> {
        let settings = &self.cx.settings;
        let (mut client, _listener, mut wake) = open(source, settings).await?;
        let version = within(settings.database.statement_timeout, version(&client)).await?;
        let can_reject = version >= REJECTS_FROM;
        if self.cx.health.set_outbox_source(&source.name, true) {
            tracing::info!(source = %source.name, url = %source.shown, "relaying the outbox source");
        }
        if !can_reject {
            tracing::warn!(source = %source.name, version,
                "this outbox cannot set aside a row that can never be published (one such row stops the rows after it): run `postie outbox install` on it");
        }
        let deadline = settings.database.statement_timeout + settings.amqp.connect_timeout;
        let label = SourceLabel {
            source: source.name.clone(),
        };
        let mut refused = false;
        let mut sessions = self.session_publisher.subscribe();
        loop {
            let Some(publisher) = sessions.borrow_and_update().clone() else {
                // No broker session: the rows wait, and their age is still shown.
                self.note_oldest(&client, &label, deadline).await?;
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = sessions.changed() => {}
                    _ = tokio::time::sleep(settings.outbox.poll_interval) => {}
                }
                continue;
            };
            let started = Instant::now();
            let pass = self.outbox_pass(&mut client, &publisher, can_reject);
            let pass = tokio::time::timeout(deadline, pass).await;
            let wait = match pass {
                Ok(Ok(batch)) => {
                    self.count_batch(&label, batch, started);
                    if std::mem::take(&mut refused) {
                        tracing::info!(source = %source.name, "publishing the outbox source's rows again");
                    }
                    backoff.succeeded();
                    match batch.rows >= settings.outbox.batch_size as usize {
                        true => Duration::ZERO,
                        false => settings.outbox.poll_interval,
                    }
                }
                Ok(Err(OutboxError::Publish(error))) => {
                    if !std::mem::replace(&mut refused, true) {
                        tracing::warn!(source = %source.name, %error,
                            "could not publish outbox rows; they stay in the outbox and are tried again");
                    }
                    self.note_oldest(&client, &label, deadline).await?;
                    backoff.failed()
                }
                Ok(Err(OutboxError::Db(error))) => return Err(error.cause()),
                Err(_) => return Err(no_answer(deadline)),
            };
            if stop.is_cancelled() {
                return Ok(());
            }
            if wait.is_zero() {
                continue;
            }
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
                woke = next_wake(&mut wake), if !refused => {
                    if woke.is_none() {
                        return Err("the listening connection was lost".into());
                    }
                }
            }
        }
    }

    /// One batch: taken, published (confirms awaited together), deleted; with
    /// `can_reject`, the rows that can never be published set aside.
    async fn outbox_pass(
        &self,
        client: &mut tokio_postgres::Client,
        publisher: &Publisher,
        can_reject: bool,
    ) -> Result<Batch, OutboxError<PublishError>> {
        let exchange = self.cx.topology.delayed_exchange();
        let limit = self.cx.settings.outbox.batch_size as i32;
        // Before version 3 a row cannot be set aside: published as before, postie
        // dead-letters one over its limit.
        let max_body = match can_reject {
            true => self.cx.settings.worker.max_body_bytes,
            false => usize::MAX,
        };
        relay_batch(client, limit, |rows: Vec<Row>| async move {
            let (ready, mut refused) = screen(&rows, max_body);
            let all = ready
                .iter()
                .map(|row| publish_row(publisher, exchange, row));
            let error = match futures_util::future::try_join_all(all).await {
                Ok(_) => return Ok(refused),
                Err(error) if can_reject && error.refusal().is_some() => error,
                Err(error) => return Err(error),
            };
            // One of them closed the channel, and every publish in flight failed with
            // it: each alone now, to find which.
            tracing::warn!(%error, rows = ready.len(),
                "the broker refused a message of an outbox batch; publishing its rows one by one");
            for row in &ready {
                let Err(error) = publish_row(publisher, exchange, row).await else {
                    continue;
                };
                let Some(words) = error.refusal() else {
                    return Err(error);
                };
                let reason = format!("refused by the broker: {words}");
                refused.push(Refused { id: row.id, reason });
            }
            Ok(refused)
        })
        .await
    }

    /// Sets the source's oldest-row gauge from the table (the rows wait unpublished);
    /// the cause in words if the source fails to answer.
    async fn note_oldest(
        &self,
        client: &tokio_postgres::Client,
        label: &SourceLabel,
        deadline: Duration,
    ) -> Result<(), String> {
        let age = within(deadline, oldest_seconds(client)).await?;
        let metrics = self.cx.metrics();
        metrics.outbox_oldest_seconds.get_or_create(label).set(age);
        Ok(())
    }

    /// Counts a batch under its source.
    fn count_batch(&self, label: &SourceLabel, batch: Batch, started: Instant) {
        let metrics = self.cx.metrics();
        metrics
            .outbox_oldest_seconds
            .get_or_create(label)
            .set(batch.oldest_seconds);
        if batch.rejected > 0 {
            tracing::warn!(source = %label.source, rows = batch.rejected,
                "outbox rows that can never be published set aside in postie.outbox_rejected, with the reason");
            metrics
                .outbox_rejected
                .get_or_create(label)
                .inc_by(batch.rejected as u64);
        }
        if batch.rows > 0 {
            metrics
                .outbox_relayed
                .get_or_create(label)
                .inc_by(batch.rows as u64);
            metrics
                .outbox_batch_seconds
                .get_or_create(label)
                .observe(started.elapsed().as_secs_f64());
        }
    }
}

/// One row published to `exchange` as a producer would, its confirm awaited.
async fn publish_row(
    publisher: &Publisher,
    exchange: &str,
    row: &rows::Ready<'_>,
) -> Result<(), PublishError> {
    let properties = row.properties();
    (publisher.publish(exchange, ROUTING_KEY, false, row.body, properties)).await
}

/// A source's connection for the batches and, with `outbox.listen`, its listening
/// connection and the receiver of its notifications; the cause in words if not.
async fn open(source: &Source, settings: &crate::config::Settings) -> Result<Connections, String> {
    let connect = settings.database.connect_timeout;
    let client = within(connect, source.connect()).await?;
    if !settings.outbox.listen {
        return Ok((client, None, None));
    }
    let (sender, receiver) = mpsc::channel(1);
    let listener = within(connect, source.listen(sender)).await?;
    Ok((client, Some(listener), Some(receiver)))
}

/// A source's connection for batches, its listening connection (kept open while
/// held) and that one's notifications.
type Connections = (
    tokio_postgres::Client,
    Option<tokio_postgres::Client>,
    Option<mpsc::Receiver<()>>,
);

/// A source's step under `limit`; its failure in words.
async fn within<T>(
    limit: Duration,
    step: impl std::future::Future<Output = Result<T, crate::inbox::DbError>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, step).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(error.cause()),
        Err(_) => Err(no_answer(limit)),
    }
}

/// "no answer within …".
fn no_answer(limit: Duration) -> String {
    format!("no answer within {}", humantime::format_duration(limit))
}

/// The next notification of the listening connection; `None` once it is gone;
/// never without one (polling only).
async fn next_wake(wake: &mut Option<mpsc::Receiver<()>>) -> Option<()> {
    match wake {
        Some(wake) => wake.recv().await,
        None => std::future::pending().await,
    }
}
