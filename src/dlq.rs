//! `postie dlq …`: look at the dead letters in `<p>.dead` and move some or all of them
//! back to `<p>.send`.
//!
//! - [`list`] reads dead letters without consuming them: it takes them with
//!   `basic.get` (manual ack), never acks, and closes its channel, so the broker puts
//!   every one of them back.
//! - [`replay`] republishes the dead letters that match a filter straight to
//!   `<p>.send` (through `<p>.work`, mandatory, publisher confirm) without postie's
//!   dead-letter headers and retry counter, so each starts a fresh retry cycle; a
//!   dead letter is acked only after its copy is confirmed. The others go back to the
//!   queue untouched.
//!
//! Both work on a snapshot: at most as many messages as `<p>.dead` held when they
//! started are looked at, so a replayed job that fails again and comes back while a
//! replay runs is not picked up a second time.
//!
//! Queue names do not depend on the delay mode, so neither needs a probe of the
//! broker, and a replay reaches `<p>.send` the same way in plugin and ladder mode.

use std::fmt::Write as _;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::amqp::{self, header_int, header_text};
use crate::config::Settings;
use crate::job::{EmailJob, ParseRules};
use crate::topology::{Topology, ROUTING_KEY};

/// One dead letter as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterSummary {
    /// The job's idempotency key: from a valid body, else the body's raw `key` (or
    /// `order_id:type`) field, else `-`.
    pub key: String,
    /// `postie-dead-kind` (`invalid`, `permanent`, `retries_exhausted`), or `broker`
    /// for a message the broker dead-lettered by itself (delivery limit), or `-`.
    pub kind: String,
    /// Why it is here: `postie-dead-reason`, else what the broker's `x-death` header
    /// says, else `-`.
    pub reason: String,
    /// `postie-dead-attempts`: SMTP attempts made before it was dead-lettered.
    pub attempts: Option<i64>,
    /// When it was dead-lettered (RFC 3339).
    pub dead_at: Option<String>,
}

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
    pub fn matches(&self, letter: &DeadLetterSummary) -> bool {
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

/// Headers a replayed job loses: postie's dead-letter headers and its retry counter
/// (a replay starts a fresh retry cycle), and the broker's own delivery counter.
const REPLAY_DROPPED_HEADERS: &[&str] = &[
    amqp::HEADER_DEAD_REASON,
    amqp::HEADER_DEAD_KIND,
    amqp::HEADER_DEAD_AT,
    amqp::HEADER_DEAD_ATTEMPTS,
    amqp::HEADER_ATTEMPT,
    "x-delivery-count",
];

/// Up to `limit` dead letters from the head of `<p>.dead`, without consuming them.
pub async fn list(settings: &Settings, limit: usize) -> anyhow::Result<Vec<DeadLetterSummary>> {
    Ok(peek(settings, limit).await?.1)
}

/// Like [`list`], and also the number of dead letters in the queue.
async fn peek(settings: &Settings, limit: usize) -> anyhow::Result<(u32, Vec<DeadLetterSummary>)> {
    let topology = names(settings);
    let queue = topology.dead_queue();
    let rules = parse_rules(settings);
    let conn = connect(settings).await?;
    let result = async {
        // A channel of its own: closing it is what hands the messages back.
        let channel = conn.create_channel().await?;
        let depth = depth(&channel, &queue).await?;
        let mut letters = Vec::new();
        // Never more than the snapshot: messages held unacked are not handed out
        // again, but one dead-lettered meanwhile would be.
        while letters.len() < limit.min(depth as usize) {
            let Some(delivery) = get(&channel, &queue).await? else {
                break;
            };
            letters.push(summarize(
                &delivery.data,
                delivery.properties.headers().as_ref(),
                &rules,
            ));
            // Not acked, on purpose.
        }
        // Closing the channel returns every unacked message to the queue. A quorum
        // queue counts that as a delivery attempt of each message; `<p>.dead` has no
        // delivery limit, so this is harmless. (Not so on RabbitMQ 4.0 to 4.2: they give
        // every quorum queue a default limit of 20 and count such returns against it,
        // so there `<p>.dead` needs an explicit, high limit.)
        channel.close(200, "listed".into()).await?;
        Ok::<_, anyhow::Error>((depth, letters))
    }
    .await;
    let _ = conn.close(200, "done".into()).await;
    result
}

/// Moves the dead letters that match `filter` back to `<p>.send`, each as a fresh
/// retry cycle, and leaves the others in `<p>.dead`.
pub async fn replay(settings: &Settings, filter: &ReplayFilter) -> anyhow::Result<ReplayReport> {
    let topology = names(settings);
    let (dead, send) = (topology.dead_queue(), topology.send_queue());
    let work = topology.work_exchange();
    let rules = parse_rules(settings);
    let conn = connect(settings).await?;
    let mut report = ReplayReport::default();
    let result = async {
        let consume = conn.create_channel().await?;
        let publish = amqp::confirm_channel(&conn).await?;
        // Fails early, with a clear message, if the work queue is missing.
        depth(&publish, &send).await?;
        let snapshot = depth(&consume, &dead).await?;
        let limit = filter.limit.unwrap_or(usize::MAX);
        // Non-matching deliveries stay unacked on `consume` until it is closed; they
        // are not nacked with requeue one by one, since basic.get would hand the same
        // ones out again and again.
        let mut examined = 0;
        while report.moved < limit && examined < snapshot {
            let Some(delivery) = get(&consume, &dead).await? else {
                break;
            };
            examined += 1;
            let headers = delivery.properties.headers().as_ref();
            let summary = summarize(&delivery.data, headers, &rules);
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
            amqp::publish_confirmed(
                &publish,
                &work,
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
        // Hands every unmatched dead letter back to `<p>.dead` (see `peek` about
        // delivery counts).
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

/// `postie dlq list`: prints a table of up to `limit` dead letters.
pub async fn print_list(settings: &Settings, limit: usize) -> anyhow::Result<()> {
    let (depth, letters) = peek(settings, limit).await?;
    let queue = names(settings).dead_queue();
    match depth {
        0 => out!("{queue} is empty"),
        n if (n as usize) > letters.len() => {
            out!(
                "{queue}: {n} dead letter(s), the first {} shown",
                letters.len()
            )
        }
        n => out!("{queue}: {n} dead letter(s)"),
    }
    if !letters.is_empty() {
        print!("{}", table(&letters));
    }
    Ok(())
}

/// `postie dlq replay`: replays and prints the counts.
pub async fn print_replay(settings: &Settings, filter: &ReplayFilter) -> anyhow::Result<()> {
    let report = replay(settings, filter).await?;
    let topology = names(settings);
    out!(
        "moved {} dead letter(s) to {}; {} not matching the filter left in {}",
        report.moved,
        topology.send_queue(),
        report.kept,
        topology.dead_queue()
    );
    Ok(())
}

/// The dead letters as a plain-text table, one line each, reason last.
pub fn table(letters: &[DeadLetterSummary]) -> String {
    const KEY_WIDTH: usize = 48;
    let rows: Vec<[String; 5]> = letters
        .iter()
        .map(|l| {
            [
                shorten(&printable(&l.key), KEY_WIDTH),
                printable(&l.kind),
                l.attempts.map_or_else(|| "-".into(), |n| n.to_string()),
                l.dead_at.as_deref().map_or_else(|| "-".into(), short_time),
                printable(&l.reason),
            ]
        })
        .collect();
    let header = ["KEY", "KIND", "ATTEMPTS", "DEAD AT", "REASON"];
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(header.map(String::from)).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// What an operator needs to know about one dead letter, from its body and headers.
pub fn summarize(
    body: &[u8],
    headers: Option<&FieldTable>,
    rules: &ParseRules<'_>,
) -> DeadLetterSummary {
    let key = key_of(body, rules).unwrap_or_else(|| "-".into());
    let postie_reason = header_text(headers, amqp::HEADER_DEAD_REASON);
    let postie_at = header_text(headers, amqp::HEADER_DEAD_AT);
    let broker = last_death(headers);
    // postie's headers say why, unless the broker dead-lettered the message after
    // postie did (say a replay by shovel that then hit the delivery limit).
    let broker_is_newer = match (&broker, postie_at.as_deref().and_then(rfc3339_secs)) {
        (Some(death), Some(postie_secs)) => death.time.is_some_and(|t| t > postie_secs),
        (Some(_), None) => postie_reason.is_none(),
        (None, _) => false,
    };
    if let (Some(death), true) = (&broker, broker_is_newer) {
        return DeadLetterSummary {
            key,
            kind: "broker".into(),
            reason: format!(
                "dead-lettered by the broker ({}) from {}",
                death.reason, death.queue
            ),
            attempts: None,
            dead_at: death
                .time
                .and_then(|t| chrono::DateTime::from_timestamp(t as i64, 0))
                .map(|t| t.to_rfc3339()),
        };
    }
    let reason = postie_reason
        .or_else(|| {
            header_text(headers, "x-first-death-reason")
                .map(|r| format!("dead-lettered by the broker ({r})"))
        })
        .unwrap_or_else(|| "-".into());
    DeadLetterSummary {
        key,
        kind: header_text(headers, amqp::HEADER_DEAD_KIND).unwrap_or_else(|| "-".into()),
        reason,
        attempts: header_int(headers, amqp::HEADER_DEAD_ATTEMPTS),
        dead_at: postie_at,
    }
}

/// The headers a replayed copy carries: the original ones minus
/// [`REPLAY_DROPPED_HEADERS`].
pub fn replay_headers(original: Option<&FieldTable>) -> FieldTable {
    amqp::without(original, REPLAY_DROPPED_HEADERS)
}

/// The idempotency key of a body: parsed as a job if it is one, else read from its
/// raw JSON, so that invalid jobs can still be told apart.
fn key_of(body: &[u8], rules: &ParseRules<'_>) -> Option<String> {
    if let Ok(job) = EmailJob::parse(body, rules) {
        return Some(job.key.as_str().to_owned());
    }
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let text = |name: &str| value.get(name)?.as_str().filter(|s| !s.trim().is_empty());
    match (text("key"), text("order_id"), text("type")) {
        (Some(key), _, _) => Some(key.to_owned()),
        (None, Some(order), Some(kind)) => Some(format!("{order}:{kind}")),
        _ => None,
    }
}

/// The most recent entry of the broker's `x-death` header.
struct Death {
    reason: String,
    queue: String,
    /// Unix seconds.
    time: Option<u64>,
}

fn last_death(headers: Option<&FieldTable>) -> Option<Death> {
    let AMQPValue::FieldArray(deaths) = headers?.inner().get("x-death")? else {
        return None;
    };
    // The broker keeps the most recent event first.
    let AMQPValue::FieldTable(entry) = deaths.as_slice().first()? else {
        return None;
    };
    let text = |name: &str| header_text(Some(entry), name).unwrap_or_else(|| "?".into());
    let time = match entry.inner().get("time") {
        Some(AMQPValue::Timestamp(t)) => Some(*t),
        _ => None,
    };
    Some(Death {
        reason: text("reason"),
        queue: text("queue"),
        time,
    })
}

fn rfc3339_secs(text: &str) -> Option<u64> {
    let secs = chrono::DateTime::parse_from_rfc3339(text).ok()?.timestamp();
    u64::try_from(secs).ok()
}

/// `2024-05-01 12:00:00Z` from RFC 3339, or the text as given.
fn short_time(text: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| {
            t.with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%SZ")
                .to_string()
        })
        .unwrap_or_else(|_| printable(text))
}

/// Control characters escaped, so that one dead letter stays on one line.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn shorten(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(width - 1).collect();
    out.push('…');
    out
}

/// The queue names; they do not depend on the delay mode, so no probe is needed.
fn names(settings: &Settings) -> Topology {
    Topology::new(&settings.topology, &settings.delay, settings.delay.mode)
}

fn parse_rules(settings: &Settings) -> ParseRules<'_> {
    ParseRules {
        max_body_bytes: settings.worker.max_body_bytes,
        default_from: settings.smtp.default_from.as_deref(),
    }
}

async fn connect(settings: &Settings) -> anyhow::Result<Connection> {
    amqp::connect(
        &settings.amqp.url,
        "postie-dlq",
        settings.amqp.connect_timeout,
    )
    .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString, ShortString};

    const RULES: ParseRules<'static> = ParseRules {
        max_body_bytes: 1 << 20,
        default_from: None,
    };

    fn table_of(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    fn x_death(reason: &str, queue: &str, time: u64) -> AMQPValue {
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table_of(&[
            ("reason", text(reason)),
            ("queue", text(queue)),
            ("time", AMQPValue::Timestamp(time)),
            ("count", AMQPValue::LongLongInt(1)),
        ]))]))
    }

    fn valid_job(key: &str) -> Vec<u8> {
        serde_json::json!({
            "key": key, "from": "a@example.com", "to": ["b@example.com"],
            "subject": "s", "text": "t",
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn the_key_comes_from_a_valid_job_else_the_raw_json_else_a_dash() {
        assert_eq!(key_of(&valid_job("k-1"), &RULES).as_deref(), Some("k-1"));
        let bad_address = br#"{"key": "k-2", "to": ["not an address"], "text": "t"}"#;
        assert_eq!(key_of(bad_address, &RULES).as_deref(), Some("k-2"));
        let derived = br#"{"order_id": "42", "type": "shipped", "to": []}"#;
        assert_eq!(key_of(derived, &RULES).as_deref(), Some("42:shipped"));
        assert_eq!(key_of(b"{\"key\": \"k-3\", ", &RULES), None);
        assert_eq!(key_of(br#"{"key": 7}"#, &RULES), None);
    }

    #[test]
    fn postie_headers_give_kind_reason_attempts_and_time() {
        let h = table_of(&[
            (amqp::HEADER_DEAD_REASON, text("550 5.1.1 no such user")),
            (amqp::HEADER_DEAD_KIND, text("permanent")),
            (amqp::HEADER_DEAD_AT, text("2024-05-01T12:00:00.5+00:00")),
            (amqp::HEADER_DEAD_ATTEMPTS, AMQPValue::LongLongInt(1)),
            // An older broker event (a retry queue's TTL) does not win.
            ("x-death", x_death("expired", "p.retry.0", 1_714_564_000)),
        ]);
        let s = summarize(&valid_job("k"), Some(&h), &RULES);
        assert_eq!(s.key, "k");
        assert_eq!(s.kind, "permanent");
        assert_eq!(s.reason, "550 5.1.1 no such user");
        assert_eq!(s.attempts, Some(1));
        assert_eq!(s.dead_at.as_deref(), Some("2024-05-01T12:00:00.5+00:00"));
    }

    #[test]
    fn broker_dead_letters_fall_back_to_x_death_then_x_first_death_reason() {
        let h = table_of(&[(
            "x-death",
            x_death("delivery_limit", "p.send", 1_714_564_800),
        )]);
        let s = summarize(b"junk", Some(&h), &RULES);
        assert_eq!(s.key, "-");
        assert_eq!(s.kind, "broker");
        assert!(
            s.reason.contains("delivery_limit") && s.reason.contains("p.send"),
            "{}",
            s.reason
        );
        assert_eq!(s.attempts, None);
        assert!(s.dead_at.unwrap().starts_with("2024-05-01T12:00:00"));

        // Replayed by shovel with stale postie headers, then dead-lettered by the broker.
        let h = table_of(&[
            (amqp::HEADER_DEAD_REASON, text("old reason")),
            (amqp::HEADER_DEAD_AT, text("2024-05-01T11:00:00+00:00")),
            (
                "x-death",
                x_death("delivery_limit", "p.send", 1_714_564_800),
            ),
        ]);
        assert_eq!(summarize(b"", Some(&h), &RULES).kind, "broker");

        let h = table_of(&[("x-first-death-reason", text("delivery_limit"))]);
        let s = summarize(b"", Some(&h), &RULES);
        assert!(s.reason.contains("delivery_limit"), "{}", s.reason);

        let s = summarize(b"", None, &RULES);
        assert_eq!((s.kind.as_str(), s.reason.as_str()), ("-", "-"));
    }

    #[test]
    fn a_replayed_copy_loses_the_dead_letter_headers_and_the_retry_counter() {
        let h = table_of(&[
            (amqp::HEADER_DEAD_REASON, text("r")),
            (amqp::HEADER_DEAD_KIND, text("permanent")),
            (amqp::HEADER_DEAD_AT, text("2024-05-01T12:00:00Z")),
            (amqp::HEADER_DEAD_ATTEMPTS, AMQPValue::LongLongInt(4)),
            (amqp::HEADER_ATTEMPT, AMQPValue::LongLongInt(3)),
            ("x-delivery-count", AMQPValue::LongLongInt(2)),
            ("traceparent", text("00-abc")),
            ("x-delay", AMQPValue::LongLongInt(5000)),
        ]);
        let out = replay_headers(Some(&h));
        let names: Vec<&str> = out.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, ["traceparent", "x-delay"]);
    }

    #[test]
    fn the_filter_matches_reason_or_kind_case_insensitively_and_the_exact_key() {
        let letter = DeadLetterSummary {
            key: "k-1".into(),
            kind: "permanent".into(),
            reason: "SMTP 550 No such user".into(),
            attempts: Some(1),
            dead_at: None,
        };
        let filter = |reason: Option<&str>, key: Option<&str>| ReplayFilter {
            reason_contains: reason.map(Into::into),
            key: key.map(Into::into),
            limit: None,
        };
        assert!(filter(None, None).matches(&letter));
        assert!(filter(Some("no such"), None).matches(&letter));
        assert!(filter(Some("PERMANENT"), Some("k-1")).matches(&letter));
        assert!(!filter(Some("421"), None).matches(&letter));
        assert!(!filter(None, Some("k-")).matches(&letter));
    }

    #[test]
    fn the_table_aligns_columns_and_keeps_each_letter_on_one_line() {
        let letters = [
            DeadLetterSummary {
                key: "k\n1".into(),
                kind: "invalid".into(),
                reason: "bad\r\nthing".into(),
                attempts: Some(0),
                dead_at: Some("2024-05-01T12:00:00.123+00:00".into()),
            },
            DeadLetterSummary {
                key: "x".repeat(60),
                kind: "-".into(),
                reason: "-".into(),
                attempts: None,
                dead_at: None,
            },
        ];
        let out = table(&letters);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[0].starts_with("KEY"));
        assert!(lines[1].starts_with("k\\n1 "), "{out}");
        assert!(lines[1].contains("2024-05-01 12:00:00Z") && lines[1].ends_with("bad\\r\\nthing"));
        assert!(lines[2].contains('…'));
        let kind_column = lines[0].find("KIND").unwrap();
        assert_eq!(lines[1].chars().position(|c| c == 'i'), Some(kind_column));
    }
}
