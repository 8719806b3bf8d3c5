//! Reading a body's key without validating it: the relay's scheduled record, the send
//! path's arrival marks, the DLQ's table.
//!
//! `peek_key` / `peek_key_text` read the key through a borrowed struct and build
//! nothing else; `peek_relay` reads what the relay needs of an intake delivery (its
//! clock time, key, revision and lane) in one pass.

use std::borrow::Cow;

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::job::present;
use super::key::key_text;
use super::local::ClockTime;
use super::{IdempotencyKey, InvalidJob};

/// The members [`peek_key`] reads, the key fields borrowed from the body where they
/// hold no escapes; every other member is skipped without being built.
#[derive(Deserialize)]
struct Peek<'a> {
    #[serde(default, borrow)]
    key: Option<KeyMember<'a>>,
    #[serde(default, borrow)]
    order_id: Option<KeyMember<'a>>,
    #[serde(default, borrow, rename = "type")]
    kind: Option<KeyMember<'a>>,
    /// Any JSON value; only an integer counts (small, and the body's size is
    /// checked before any parse).
    #[serde(default)]
    revision: Option<serde_json::Value>,
    #[serde(default, borrow)]
    lane: Option<KeyMember<'a>>,
    #[serde(default, borrow)]
    send_at: Option<KeyMember<'a>>,
    #[serde(default, borrow)]
    send_at_local: Option<KeyMember<'a>>,
    #[serde(default, borrow)]
    time_zone: Option<KeyMember<'a>>,
    #[serde(default, deserialize_with = "present")]
    cancel: Option<IgnoredAny>,
}

/// A key member as the peek reads it: text, or any other value, which is there (so
/// the key rule does not pass it over) but names no key.
#[derive(Deserialize)]
#[serde(untagged)]
enum KeyMember<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Other(IgnoredAny),
}

impl<'a> KeyMember<'a> {
    fn text(member: Option<&Self>) -> Option<&str> {
        match member? {
            Self::Text(text) => Some(text),
            Self::Other(_) => None,
        }
    }
}

impl<'a> Peek<'a> {
    /// Reads a body's members, or `None` for a body that is no JSON object.
    fn parse(body: &'a [u8]) -> Option<Self> {
        // serde reads a struct from an array too, by position: only an object is a job.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return None;
        }
        serde_json::from_slice(body).ok()
    }

    /// Reads a body's key members, or `None` for a cancel request or a body that is
    /// no JSON object.
    fn read(body: &'a [u8]) -> Option<Self> {
        Self::parse(body).filter(|peek| peek.cancel.is_none())
    }

    /// What the relay needs of a job: its key, revision and lane; `None` for a cancel
    /// or a body with no usable key.
    fn job(&self) -> Option<Peeked> {
        if self.cancel.is_some() {
            return None;
        }
        let key = IdempotencyKey::parse(&self.key()?).ok()?;
        let revision = self
            .revision
            .as_ref()
            .and_then(|r| r.as_i64())
            .unwrap_or(0)
            .clamp(0, i32::MAX as i64) as i32;
        let lane = KeyMember::text(self.lane.as_ref()).map(str::to_owned);
        Some(Peeked {
            key,
            revision,
            lane,
        })
    }

    /// The body's clock time (`send_at`, or `send_at_local` in `time_zone`): `None`
    /// when it has none; else the instant, or why it is none.
    fn clock(&self) -> Option<Result<i64, InvalidJob>> {
        fn text<'m>(
            name: &str,
            member: &'m Option<KeyMember<'_>>,
        ) -> Result<Option<&'m str>, InvalidJob> {
            match member {
                None => Ok(None),
                Some(KeyMember::Text(text)) => Ok(Some(text)),
                Some(KeyMember::Other(_)) => Err(InvalidJob(format!("{name} is not a string"))),
            }
        }
        let clock = (|| {
            ClockTime {
                send_at: text("send_at", &self.send_at)?,
                send_at_local: text("send_at_local", &self.send_at_local)?,
                time_zone: text("time_zone", &self.time_zone)?,
            }
            .due_ms()
        })();
        clock.transpose()
    }

    /// The key text by [`key_text`]; `None` when the member it picks is no string.
    fn key(&self) -> Option<Cow<'_, str>> {
        let key = match &self.key {
            Some(KeyMember::Text(key)) => Some(Cow::Borrowed(&**key)),
            Some(KeyMember::Other(_)) => return None,
            None => None,
        };
        let (order_id, kind) = (self.order_id.as_ref(), self.kind.as_ref());
        key_text(key, KeyMember::text(order_id), KeyMember::text(kind))
    }
}

/// The key and revision of a job body, without validating the rest (the relay
/// records scheduled jobs; the worker validates). `None` for cancels and bodies
/// with no usable key. No tree of the body is built: the key fields are borrowed
/// and the others skipped.
pub(crate) fn peek_key(body: &[u8]) -> Option<(IdempotencyKey, i32)> {
    peek_job(body).map(|job| (job.key, job.revision))
}

/// What the relay reads of a job body: [`peek_key`]'s key and revision, and the lane
/// it names (a string member, unvalidated: the worker validates).
pub(crate) struct Peeked {
    pub(crate) key: IdempotencyKey,
    pub(crate) revision: i32,
    pub(crate) lane: Option<String>,
}

/// [`peek_key`] and the lane, in the same pass.
pub(crate) fn peek_job(body: &[u8]) -> Option<Peeked> {
    Peek::read(body)?.job()
}

/// What the relay reads of an intake delivery's body, in one pass: its clock time
/// (`send_at`, or `send_at_local` in `time_zone`: `None` when there is none or the
/// body is no JSON object, else the instant or why it is none), and the job's key,
/// revision and lane ([`peek_job`]; `None` for a cancel or a body with no usable
/// key). A body that fails to read is left to the worker.
pub(crate) fn peek_relay(body: &[u8]) -> (Option<Result<i64, InvalidJob>>, Option<Peeked>) {
    match Peek::parse(body) {
        Some(peek) => (peek.clock(), peek.job()),
        None => (None, None),
    }
}

/// The key a body names by the contract's rule, as published and unvalidated (so that
/// an operator can tell invalid jobs apart): `None` for cancels, bodies that are no
/// JSON object, and bodies whose key members name none. Public for
/// `tests/properties.rs`.
pub fn peek_key_text(body: &[u8]) -> Option<String> {
    Some(Peek::read(body)?.key()?.into_owned())
}
