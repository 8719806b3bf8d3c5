//! The rows of an outbox batch as the relay publishes them: screened first (one that
//! can never be published is refused without a publish), each with the properties a
//! producer would give it.

use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::broker;
use crate::headers::{HEADER_PUBLISHED_AT, HEADER_X_DELAY};
use crate::outbox::{Refused, Row};

/// A row the relay can publish: its times known, its body within the limit.
pub(super) struct Ready<'a> {
    pub(super) id: i64,
    pub(super) body: &'a [u8],
    enqueued_ms: i64,
    delay_ms: i64,
}

/// The rows the relay can publish, and those it refuses for good without a publish:
/// over `max_body` (postie would refuse them unread), or with a time `postie.take`
/// could not compute (not finite).
pub(super) fn screen(rows: &[Row], max_body: usize) -> (Vec<Ready<'_>>, Vec<Refused>) {
    let mut ready = Vec::with_capacity(rows.len());
    let mut refused = Vec::new();
    for row in rows {
        let reason = match (row.enqueued_ms, row.delay_ms) {
            _ if row.body.len() > max_body => format!(
                "the job is {} bytes, over worker.max_body_bytes ({max_body}): postie would refuse it",
                row.body.len()
            ),
            (Some(enqueued_ms), Some(delay_ms)) => {
                ready.push(Ready {
                    id: row.id,
                    body: &row.body,
                    enqueued_ms,
                    delay_ms,
                });
                continue;
            }
            _ => "its due time or enqueue time is not finite".to_string(),
        };
        refused.push(Refused { id: row.id, reason });
    }
    (ready, refused)
}

impl Ready<'_> {
    /// A producer's properties: persistent JSON, the key as `message_id`, `x-delay`
    /// and `postie-published-at` so that the job is due when its row said.
    pub(super) fn properties(&self) -> lapin::BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_X_DELAY.into(),
            AMQPValue::LongLongInt(self.delay_ms.max(0)),
        );
        headers.insert(
            HEADER_PUBLISHED_AT.into(),
            AMQPValue::LongLongInt(self.enqueued_ms),
        );
        let mut properties = broker::job_properties()
            .with_headers(headers)
            .with_timestamp((self.enqueued_ms / 1000).max(0) as u64);
        if let Some((key, _)) = crate::contract::peek_key(self.body) {
            properties = properties.with_message_id(ShortString::from(key.as_str().to_owned()));
        }
        properties
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_is_published_as_a_producer_would() {
        let row = Row {
            id: 1,
            body: br#"{"order_id":"42","type":"receipt","to":["a@x.example"]}"#.to_vec(),
            enqueued_ms: Some(1_700_000_000_123),
            delay_ms: Some(5_000),
        };
        let (ready, refused) = screen(std::slice::from_ref(&row), 1024);
        assert!(refused.is_empty());
        let props = ready[0].properties();
        assert_eq!(
            props.message_id().as_ref().map(|m| m.as_str()),
            Some("42:receipt")
        );
        assert_eq!(props.delivery_mode(), &Some(2));
        let headers = props.headers().as_ref().unwrap();
        assert_eq!(
            crate::headers::header_int(Some(headers), HEADER_PUBLISHED_AT),
            Some(1_700_000_000_123)
        );
        assert_eq!(
            crate::headers::header_int(Some(headers), HEADER_X_DELAY),
            Some(5_000)
        );
        let late = Row {
            delay_ms: Some(-3),
            ..row
        };
        let (ready, _) = screen(std::slice::from_ref(&late), 1024);
        let headers = ready[0].properties().headers().clone().unwrap();
        assert_eq!(
            crate::headers::header_int(Some(&headers), HEADER_X_DELAY),
            Some(0)
        );
    }

    #[test]
    fn rows_that_can_never_be_published_are_refused_without_a_publish() {
        let row = |id, len, delay_ms| Row {
            id,
            body: vec![b' '; len],
            enqueued_ms: Some(1_700_000_000_000),
            delay_ms,
        };
        let rows = [
            row(1, 10, Some(0)),
            row(2, 11, Some(0)),
            row(3, 5, None),
            row(4, 10, Some(7)),
        ];
        let (ready, refused) = screen(&rows, 10);
        let ids: Vec<i64> = ready.iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 4]);
        assert_eq!(refused.iter().map(|r| r.id).collect::<Vec<_>>(), [2, 3]);
        assert!(refused[0]
            .reason
            .contains("11 bytes, over worker.max_body_bytes (10)"));
        assert!(refused[1].reason.contains("not finite"));
    }
}
