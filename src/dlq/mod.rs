//! `postie dlq …`: look at the dead letters in `<p>.dead` and move some or all of them
//! back to `<p>.send`.
//!
//! - [`list`] reads dead letters without consuming them: a consumer takes them
//!   (manual ack) and never acks; the look ends by cancelling the consumer and
//!   handing every letter back with one `basic.nack` (requeue), in the order they
//!   came, before its channel closes ([`give_back`]). `inspect` also reads one
//!   letter's body and headers, for the console.
//! - [`replay`] republishes the dead letters that match a filter straight to
//!   `<p>.send` (through `<p>.work`, mandatory, publisher confirm) without postie's
//!   dead-letter headers and retry counter, so each starts a fresh retry cycle; a
//!   dead letter is acked only after its copy is confirmed. The others go back to the
//!   queue untouched, the same way.
//!
//! Why a nack and not just the close: a quorum queue counts a letter handed back as
//! a delivery, and drops it past the queue's delivery limit (`<p>.dead` dead-letters
//! nowhere). RabbitMQ 4.x counts a closed channel's unacked letters (and
//! `basic.reject`) against a default limit of 20, but not `basic.nack` with requeue;
//! 3.x counts all three, without a default limit. `<p>.dead` is also declared with a
//! limit no number of looks reaches (`broker::dead`); one declared by an older postie
//! lacks it, which start-up and `postie status` report. Measured on RabbitMQ 3.10.8
//! and 4.3.6: docs/brokers.md.
//!
//! Both work on a snapshot: at most as many messages as `<p>.dead` held when they
//! started are looked at, so a replayed job that fails again and comes back while a
//! replay runs is not picked up a second time.
//!
//! Queue names do not depend on the delay mode, so neither needs a probe of the
//! broker, and a replay reaches `<p>.send` the same way in plugin and ladder mode.

mod letter;

pub(crate) use letter::{replay_headers, summarize};
pub use letter::{table, DeadLetterSummary};

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::broker;
use crate::config::Settings;
use crate::contract::ParseRules;
use crate::headers;
use crate::topology::{Topology, ROUTING_KEY};

/// Which dead letters [`replay`] moves. The default moves every one.
#[derive(Debug, Clone, Default)]
pub struct ReplayFilter {
    /// Only dead letters whose reason or kind contains this text (case-insensitive).
    pub reason_contains: Option<String>,
    /// Only dead letters of this idempotency key.
    pub key: Option<String>,
    /// Move at most this many.
    pub limit: Option<usize>,
}

impl ReplayFilter {
    /// True if the dead letter should be moved.
    pub(crate) fn matches(&self, letter: &DeadLetterSummary) -> bool {
        let reason_ok = self.reason_contains.as_deref().is_none_or(|wanted| {
            let wanted = wanted.to_lowercase();
            letter.reason.to_lowercase().contains(&wanted)
                || letter.kind.to_lowercase().contains(&wanted)
        });
        let key_ok = self.key.as_deref().is_none_or(|key| letter.key == key);
        reason_ok && key_ok
    }
}

/// What [`replay`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Dead letters republished to `<p>.send` (confirmed) and removed from `<p>.dead`.
    pub moved: usize,
    /// Dead letters looked at that did not match the filter, left in `<p>.dead`.
    pub kept: usize,
}

/// Up to `limit` dead letters from the head of `<p>.dead`, without consuming them.
pub async fn list(settings: &Settings, limit: usize) -> anyhow::Result<Vec<DeadLetterSummary>> {
    Ok(peek(settings, limit).await?.1)
}

/// Like [`list`], and also the number of dead letters in the queue.
pub(crate) async fn peek(
    settings: &Settings,
    limit: usize,
) -> anyhow::Result<(u32, Vec<DeadLetterSummary>)> {
    let (depth, letters, _) = inspect(settings, limit, None).await?;
    Ok((depth, letters))
}

/// The consumer tag of [`inspect`]'s reads.
const INSPECT_CONSUMER: &str = "postie-dlq-inspect";

/// One dead letter in full: what [`summarize`] reads, its body and its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LetterDetail {
    /// As `postie dlq list` shows it.
    pub(crate) summary: DeadLetterSummary,
    /// The body as published (UTF-8, invalid bytes replaced).
    pub(crate) body: String,
    /// Every header, by name, its value as text.
    pub(crate) headers: Vec<(String, String)>,
}

/// Like [`peek`], and also the first of them whose key is `detail` in full.
pub(crate) async fn inspect(
    settings: &Settings,
    limit: usize,
    detail: Option<&str>,
) -> anyhow::Result<(u32, Vec<DeadLetterSummary>, Option<LetterDetail>)> {
    let topology = names(settings);
    let queue = topology.dead_queue();
    let conn = connect(settings).await?;
    let result = async {
        // A channel of its own: what it holds unacked goes back when it closes.
        let channel = conn.create_channel().await?;
        let depth = depth(&channel, queue).await?;
        let read = read(&channel, queue, limit.min(depth as usize), detail, settings).await;
        // Every letter back, uncounted, even after a failed read.
        let returned = give_back(&channel, Some(INSPECT_CONSUMER)).await;
        let (letters, found) = read?;
        returned?;
        channel.close(200, "listed".into()).await?;
        Ok::<_, anyhow::Error>((depth, letters, found))
    }
    .await;
    let _ = conn.close(200, "done".into()).await;
    result
}

/// [`inspect`]'s read: up to `wanted` letters from a consumer on `channel`, none
/// acked.
async fn read(
    channel: &Channel,
    queue: &str,
    wanted: usize,
    detail: Option<&str>,
    settings: &Settings,
) -> anyhow::Result<(Vec<DeadLetterSummary>, Option<LetterDetail>)> {
    let rules = ParseRules::from_settings(settings);
    let (mut letters, mut found) = (Vec::new(), None);
    // Never more than the snapshot: messages held unacked are not handed out
    // again, but one dead-lettered meanwhile would be. A consumer with a prefetch
    // of the snapshot, not basic.get: one round trip per message made a page of
    // 10^4 dead letters take seconds. Each wait is bounded by
    // amqp.connect_timeout (a queue emptied by someone else meanwhile).
    let mut deliveries = consumer(channel, queue, wanted).await?;
    while letters.len() < wanted {
        let next = tokio::time::timeout(settings.amqp.connect_timeout, deliveries.next());
        let Ok(Some(delivery)) = next.await else {
            break;
        };
        let delivery = delivery?;
        let headers = delivery.properties.headers().as_ref();
        let summary = summarize(&delivery.data, headers, &rules.for_user(user_id(&delivery)));
        if found.is_none() && detail.is_some_and(|key| key == summary.key) {
            found = Some(LetterDetail {
                summary: summary.clone(),
                body: String::from_utf8_lossy(&delivery.data).into_owned(),
                headers: headers::as_text(headers),
            });
        }
        letters.push(summary);
        // Not acked, on purpose: handed back by `give_back`.
    }
    Ok((letters, found))
}

/// Hands every letter `channel` holds unacked back to its queue, uncounted: cancels
/// the consumer first (else the broker would deliver them to it again at once), then
/// one `basic.nack` of every outstanding delivery (tag 0, multiple) with requeue.
/// RabbitMQ 4.x does not count a nack against the delivery limit, where it counts
/// the close of a channel holding them; the letters keep their order.
async fn give_back(channel: &Channel, consumer: Option<&str>) -> anyhow::Result<()> {
    if let Some(tag) = consumer {
        channel
            .basic_cancel(tag.into(), BasicCancelOptions::default())
            .await?;
    }
    let all = BasicNackOptions {
        multiple: true,
        requeue: true,
    };
    channel.basic_nack(0, all).await?;
    Ok(())
}

/// Moves the dead letters that match `filter` back to `<p>.send`, each as a fresh
/// retry cycle, and leaves the others in `<p>.dead`.
pub async fn replay(settings: &Settings, filter: &ReplayFilter) -> anyhow::Result<ReplayReport> {
    let topology = names(settings);
    let (dead, send) = (topology.dead_queue(), topology.send_queue());
    let work = topology.work_exchange();
    let rules = ParseRules::from_settings(settings);
    let conn = connect(settings).await?;
    let mut report = ReplayReport::default();
    let result = async {
        let consume = conn.create_channel().await?;
        let publish = broker::confirm_channel(&conn).await?;
        // Fails early, with a clear message, if the work queue is missing.
        depth(&publish, send).await?;
        let snapshot = depth(&consume, dead).await?;
        let limit = filter.limit.unwrap_or(usize::MAX);
        // Non-matching deliveries stay unacked on `consume` until the end, then go
        // back with one nack; not one by one, since basic.get would hand the same
        // ones out again and again.
        let mut examined = 0;
        while report.moved < limit && examined < snapshot {
            let Some(delivery) = get(&consume, dead).await? else {
                break;
            };
            examined += 1;
            let headers = delivery.properties.headers().as_ref();
            let summary = summarize(&delivery.data, headers, &rules.for_user(user_id(&delivery)));
            if !filter.matches(&summary) {
                report.kept += 1;
                continue;
            }
            let properties = delivery
                .properties
                .clone()
                .with_delivery_mode(2)
                .with_headers(replay_headers(headers));
            // Through `<p>.work`, where due jobs and retries re-enter: its one binding
            // is `<p>.send` in every delay mode. Not the default exchange, which a
            // least-privilege user need not be allowed to write to. Mandatory, so a
            // missing binding is an error, not a silent drop.
            broker::publish_confirmed(
                &publish,
                work,
                ROUTING_KEY,
                true,
                &delivery.data,
                properties,
            )
            .await
            .map_err(|e| anyhow::anyhow!("republishing {} to {send}: {e}", summary.key))?;
            ack(&delivery).await?;
            report.moved += 1;
        }
        // Hands every unmatched dead letter back to `<p>.dead`, uncounted.
        give_back(&consume, None).await?;
        consume.close(200, "replayed".into()).await?;
        let _ = publish.close(200, "replayed".into()).await;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = conn.close(200, "done".into()).await;
    match result {
        Ok(()) => Ok(report),
        Err(e) if report.moved == 0 => Err(e),
        Err(e) => Err(e.context(format!(
            "replay stopped after moving {} dead letter(s) to {send}; the rest are still in {dead}",
            report.moved
        ))),
    }
}
/// The queue names; they do not depend on the delay mode, so no probe is needed.
pub(crate) fn names(settings: &Settings) -> Topology {
    Topology::new(&settings.topology, &settings.delay, settings.delay.mode)
}

async fn connect(settings: &Settings) -> anyhow::Result<Connection> {
    let addresses = settings.amqp.addresses()?;
    let timeout = settings.amqp.connect_timeout;
    Ok(broker::connect(&addresses, "postie-dlq", timeout)
        .await?
        .connection)
}

/// Ready messages in `queue` (a passive declare); a missing queue is an error naming it.
async fn depth(channel: &Channel, queue: &str) -> anyhow::Result<u32> {
    let options = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .map_err(|e| anyhow::anyhow!("queue {queue} is not there ({e}); run `postie topology`"))?;
    Ok(declared.message_count())
}

/// A consumer of `queue` (manual acks) that is handed at most `prefetch` messages.
async fn consumer(
    channel: &Channel,
    queue: &str,
    prefetch: usize,
) -> anyhow::Result<lapin::Consumer> {
    let prefetch = u16::try_from(prefetch.max(1)).unwrap_or(u16::MAX);
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    Ok(channel
        .basic_consume(
            queue.into(),
            INSPECT_CONSUMER.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?)
}

/// One message with manual ack, or `None` if the queue is empty.
async fn get(channel: &Channel, queue: &str) -> anyhow::Result<Option<Delivery>> {
    let message = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?;
    Ok(message.map(|m| m.delivery))
}

async fn ack(delivery: &Delivery) -> anyhow::Result<()> {
    if delivery.acker.ack(BasicAckOptions::default()).await? {
        Ok(())
    } else {
        anyhow::bail!("the ack of a moved dead letter was not delivered (channel closed)")
    }
}

/// The AMQP `user_id` a dead letter was published with: its key's namespace under
/// `worker.key_namespace = "user_id"`.
fn user_id(delivery: &Delivery) -> Option<&str> {
    delivery.properties.user_id().as_ref().map(|u| u.as_str())
}
