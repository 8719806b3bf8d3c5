//! The job body (version 1) and cancel requests: parsing and validation.
//!
//! A body is read in one pass into a borrowed `RawJob`, which also notes a `cancel`
//! member; only cancels and refused bodies are read again, as a `CancelRequest`, for
//! their own reasons.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};

use super::attachment::{read_all, Attachment, RawAttachment};
use super::debounce::{Debounce, RawDebounce};
use super::key::key_text;
use super::local::ClockTime;
use super::rules::ParseRules;
use super::{
    check_header_value, check_token, invalid, readable, Address, IdempotencyKey, InvalidJob,
};
#[cfg(test)]
use super::{peek_key, peek_key_text};
use crate::config::Window;

/// Most recipients (to + cc + bcc) on one job.
const MAX_RECIPIENTS: usize = 100;

/// A validated email job.
#[derive(Debug, Clone)]
pub struct EmailJob {
    /// The idempotency key (`key`, else `order_id:type`: [`key_text`]).
    pub key: IdempotencyKey,
    /// Notification type, if given.
    pub kind: Option<String>,
    /// The user the email concerns, if given.
    pub user_id: Option<String>,
    /// Sender (from the job, else `transport.default_from`).
    pub from: Address,
    /// Recipients.
    pub to: Vec<Address>,
    /// Carbon copies.
    pub cc: Vec<Address>,
    /// Blind copies: envelope only, never a header.
    pub bcc: Vec<Address>,
    /// Reply-To.
    pub reply_to: Option<Address>,
    /// Subject, a single line.
    pub subject: String,
    /// Plain-text body.
    pub text: Option<String>,
    /// HTML body.
    pub html: Option<String>,
    /// Extra headers the producer asked for, names checked against the reserved list.
    pub headers: Vec<(String, String)>,
    /// Reschedule revision (default 0): a newer revision of the key supersedes this one.
    pub revision: i32,
    /// `ignore_suppression`: send even to suppressed recipients (a password reset to
    /// an address that once complained); logged when it matters. Default false.
    pub ignore_suppression: bool,
    /// The lane the job asks for (`topology.lanes`); none: the default lane.
    pub lane: Option<String>,
    /// The tenant (fairness group) it is sent for, inside its lane; none: `default`.
    pub tenant: Option<String>,
    /// Its clock time, Unix ms (`send_at`, or `send_at_local` in `time_zone`): not
    /// sent before this instant (with `x-delay`, the later).
    pub send_at_ms: Option<i64>,
    /// The recipient's time zone (an IANA name, checked), if given.
    pub time_zone: Option<String>,
    /// The send window it asks for (`window`).
    pub window: JobWindow,
    /// Its debounce (`debounce`), if any: a later version with its key replaces it.
    pub debounce: Option<Debounce>,
    /// `"unsubscribe": {"scope": "…"}`: the email carries a one-click unsubscribe
    /// link for its recipient, leaving this scope (`None`: the job's type). A lane
    /// can ask the same of all its jobs (`topology.lanes.<l>.unsubscribe`).
    pub unsubscribe: Option<Unsubscribe>,
    /// The files the email carries (`attachments`), checked against
    /// `attachments.*`; inline ones decoded, fetched ones named by URL.
    pub attachments: Vec<Attachment>,
}

/// The send window (quiet hours) a job asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum JobWindow {
    /// No `window` member: its lane's, if the lane has one.
    #[default]
    Lane,
    /// `"window": null`: none, where its lane allows that (`window_optional`); else the
    /// lane's.
    Off,
    /// A window of its own, instead of the lane's.
    Own(Window),
}

impl EmailJob {
    /// The recipient the throttle counts against: `user_id`, else the first
    /// recipient's address, lower-cased.
    pub(crate) fn throttle_recipient(&self) -> String {
        match &self.user_id {
            Some(user) => format!("user:{user}"),
            None => self
                .to
                .iter()
                .chain(&self.cc)
                .chain(&self.bcc)
                .next()
                .map(|m| format!("addr:{}", m.email.to_lowercase()))
                .unwrap_or_default(),
        }
    }
}

/// A cancel request: `{"cancel": "KEY", "revision": N}` (revision optional: the
/// newest seen). Published like a job, without `x-delay`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CancelRequest {
    /// The idempotency key to cancel.
    pub cancel: String,
    /// The highest revision the cancel covers.
    #[serde(default)]
    pub revision: Option<i32>,
}

/// What a message on the contract exchange asks for.
#[derive(Debug, Clone)]
pub enum Request {
    /// Send an email.
    Job(Box<EmailJob>),
    /// Cancel a key.
    Cancel {
        /// The key.
        key: IdempotencyKey,
        /// Covered revision (None: the newest seen).
        revision: Option<i32>,
    },
}

/// Whether a body is a JSON object with a `cancel` member (even `null`), read without
/// building the values: only the member names are kept. An array is no object, even
/// though serde would read a struct from one. Asked only of a body that failed to read
/// as a job, to tell which reasons it gets.
fn asks_cancel(body: &[u8]) -> bool {
    serde_json::from_slice::<std::collections::HashMap<String, IgnoredAny>>(body)
        .is_ok_and(|members| members.contains_key("cancel"))
}

/// A member that may be there as `null`: absent is `None`, `null` is `Some(None)`.
fn even_null<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    member: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(member).map(Some)
}

/// A member that is there, whatever its value (even `null`).
pub(super) fn present<'de, D: Deserializer<'de>>(
    member: D,
) -> Result<Option<IgnoredAny>, D::Error> {
    IgnoredAny::deserialize(member).map(Some)
}

/// A member that may be absent but, when there, must be a string (`null` refused, as
/// for a required field).
fn text_if_present<'de, D: Deserializer<'de>>(member: D) -> Result<Option<String>, D::Error> {
    String::deserialize(member).map(Some)
}

impl Request {
    /// Parses a job or a cancel request, its key in the namespace `rules` give.
    /// Public for `tests/properties.rs`.
    pub fn parse(body: &[u8], rules: &ParseRules<'_>) -> Result<Self, InvalidJob> {
        match Self::parse_as_published(body, rules)? {
            Self::Job(mut job) => {
                job.key = rules.namespaced(&job.key)?;
                Ok(Self::Job(job))
            }
            Self::Cancel { key, revision } => Ok(Self::Cancel {
                key: rules.namespaced(&key)?,
                revision,
            }),
        }
    }

    /// [`Request::parse`] with the key as published. A job is read in one pass
    /// ([`RawJob::read`]). A body with a `cancel` member is read again as a
    /// [`CancelRequest`], and so is a body that failed as a job and has one, so that
    /// a cancel request's reasons are its own: only cancels and refused bodies are
    /// read twice.
    fn parse_as_published(body: &[u8], rules: &ParseRules<'_>) -> Result<Self, InvalidJob> {
        rules.check_size(body)?;
        match RawJob::read(body, rules) {
            Ok(raw) if raw.cancel.is_none() => {
                EmailJob::from_raw(raw, rules).map(|job| Self::Job(Box::new(job)))
            }
            Ok(_) => Self::parse_cancel(body),
            Err(_) if asks_cancel(body) => Self::parse_cancel(body),
            Err(not_a_job) => Err(not_a_job),
        }
    }

    fn parse_cancel(body: &[u8]) -> Result<Self, InvalidJob> {
        let cancel: CancelRequest = serde_json::from_slice(body)
            .map_err(|e| InvalidJob(format!("not a valid cancel request: {e}")))?;
        if cancel.revision.is_some_and(|r| r < 0) {
            return invalid("cancel revision must not be negative");
        }
        Ok(Self::Cancel {
            key: IdempotencyKey::parse(&cancel.cancel)?,
            revision: cancel.revision,
        })
    }
}

/// The JSON body as producers send it (version 1), read in one pass: a job's members,
/// and whether a `cancel` member is there. Unknown fields are rejected so that a typo
/// (`"htm"`) cannot silently drop part of an email. The key and address members are
/// borrowed from the body where they hold no escapes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob<'a> {
    #[serde(default)]
    version: Option<u32>,
    #[serde(default, borrow)]
    key: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    order_id: Option<Cow<'a, str>>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    user_id: Option<String>,
    #[serde(default, borrow)]
    from: Option<Cow<'a, str>>,
    #[serde(default)]
    to: Vec<String>,
    #[serde(default)]
    cc: Vec<String>,
    #[serde(default)]
    bcc: Vec<String>,
    #[serde(default, borrow)]
    reply_to: Option<Cow<'a, str>>,
    /// Required of a job; optional here only because a cancel request has none.
    #[serde(default, deserialize_with = "text_if_present")]
    subject: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    html: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    revision: Option<i32>,
    #[serde(default)]
    ignore_suppression: Option<bool>,
    #[serde(default)]
    lane: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    send_at: Option<String>,
    #[serde(default)]
    send_at_local: Option<String>,
    #[serde(default)]
    time_zone: Option<String>,
    /// Absent, `null`, or a window.
    #[serde(default, deserialize_with = "even_null")]
    window: Option<Option<String>>,
    #[serde(default)]
    debounce: Option<RawDebounce>,
    #[serde(default)]
    unsubscribe: Option<RawUnsubscribe>,
    #[serde(default)]
    attachments: Vec<RawAttachment>,
    #[serde(default, deserialize_with = "present")]
    cancel: Option<IgnoredAny>,
}

impl<'a> RawJob<'a> {
    /// Reads a body in one pass, after the checks that need no parse: empty, size,
    /// UTF-8, an object. The error is the reason a job is refused for.
    fn read(body: &'a [u8], rules: &ParseRules<'_>) -> Result<Self, InvalidJob> {
        if body.is_empty() {
            return invalid("empty body");
        }
        rules.check_size(body)?;
        let text = std::str::from_utf8(body).map_err(|e| {
            InvalidJob(format!(
                "body is not UTF-8 (invalid byte at {})",
                e.valid_up_to()
            ))
        })?;
        // serde would also read a struct from a JSON array in field order: refuse it.
        if !text.trim_start().starts_with('{') {
            return invalid("body is not a JSON object");
        }
        serde_json::from_str(text).map_err(|e| not_a_job(&e))
    }
}

impl RawJob<'_> {
    /// The version, the identity members (in the order their reasons have always
    /// come) and the key by the contract's rule ([`key_text`]).
    fn key_and_revision(&self) -> Result<(IdempotencyKey, i32), InvalidJob> {
        if let Some(v) = self.version {
            if v != 1 {
                return invalid(format!("unsupported version {v} (this postie reads 1)"));
            }
        }
        if let Some(order_id) = &self.order_id {
            check_token("order_id", order_id)?;
        }
        let revision = self.revision.unwrap_or(0);
        if revision < 0 {
            return invalid("\"revision\" must not be negative");
        }
        if let Some(kind) = &self.kind {
            check_token("type", kind)?;
        }
        if let Some(user_id) = &self.user_id {
            check_token("user_id", user_id)?;
        }
        if let Some(tenant) = &self.tenant {
            check_token("tenant", tenant)?;
        }
        if let Some(lane) = &self.lane {
            if !crate::config::is_lane_name(lane) {
                return invalid(format!(
                    "\"lane\" {:?} must be 1-32 lower-case ASCII letters, digits, '_' or '-'",
                    lane.chars().take(40).collect::<String>()
                ));
            }
        }
        let key = self.key.as_deref().map(Cow::Borrowed);
        match key_text(key, self.order_id.as_deref(), self.kind.as_deref()) {
            Some(key) => Ok((IdempotencyKey::parse(&key)?, revision)),
            None => invalid("no idempotency key: give \"key\", or both \"order_id\" and \"type\""),
        }
    }
}

/// The reason for a body serde cannot read as a job. serde_json's message can quote
/// the producer's field names and values: kept short and free of line breaks, since
/// it ends up in a header.
fn not_a_job(error: &impl std::fmt::Display) -> InvalidJob {
    InvalidJob(format!(
        "body is not a valid job: {}",
        readable(&error.to_string(), 300)
    ))
}

/// A job's one-click unsubscribe (`"unsubscribe"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    /// What the recipient leaves; `None`: the job's type.
    pub scope: Option<String>,
}

/// The member as producers write it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUnsubscribe {
    #[serde(default)]
    scope: Option<String>,
}

impl RawUnsubscribe {
    /// The scope checked as a type is: one unsubscribe must not leave every email
    /// (`*`, the password resets included).
    fn read(self) -> Result<Unsubscribe, InvalidJob> {
        if let Some(scope) = &self.scope {
            check_token("unsubscribe.scope", scope)?;
            if scope == "*" {
                return invalid(
                    "\"unsubscribe.scope\" must name what the recipient leaves, not \"*\" (every email)",
                );
            }
        }
        Ok(Unsubscribe { scope: self.scope })
    }
}

/// Headers a producer may not set: postie owns them, or they would change who
/// receives the email or how it is parsed.
const RESERVED_HEADERS: &[&str] = &[
    "from",
    "to",
    "cc",
    "bcc",
    "reply-to",
    "sender",
    "subject",
    "date",
    "message-id",
    "mime-version",
    "return-path",
    "received",
    "in-reply-to",
    "references",
    "content-type",
    "content-transfer-encoding",
    "content-disposition",
    "content-id",
    "dkim-signature",
    "resent-from",
    "resent-to",
    "resent-cc",
    "resent-bcc",
    "resent-sender",
    "resent-date",
    "resent-message-id",
];

impl EmailJob {
    /// Parses and validates one job body; a cancel request is no job.
    pub fn parse(body: &[u8], rules: &ParseRules<'_>) -> Result<Self, InvalidJob> {
        let raw = RawJob::read(body, rules)?;
        if raw.cancel.is_some() {
            return Err(not_a_job(
                &"unknown field `cancel` (a cancel request is no job)",
            ));
        }
        Self::from_raw(raw, rules)
    }

    fn from_raw(mut raw: RawJob<'_>, rules: &ParseRules<'_>) -> Result<Self, InvalidJob> {
        let Some(subject) = raw.subject.take() else {
            return Err(not_a_job(&"missing field `subject`"));
        };
        let (key, revision) = raw.key_and_revision()?;

        let from = match raw.from.as_deref().or(rules.default_from) {
            Some(from) => Address::parse("from", from)?,
            None => return invalid("no \"from\" and no transport.default_from configured"),
        };
        let to = Address::parse_all("to", &raw.to)?;
        let cc = Address::parse_all("cc", &raw.cc)?;
        let bcc = Address::parse_all("bcc", &raw.bcc)?;
        let recipients = to.len() + cc.len() + bcc.len();
        if recipients == 0 {
            return invalid("no recipient in \"to\", \"cc\" or \"bcc\"");
        }
        if recipients > MAX_RECIPIENTS {
            return invalid(format!(
                "{recipients} recipients, over the limit of {MAX_RECIPIENTS}"
            ));
        }
        let reply_to = raw
            .reply_to
            .as_deref()
            .map(|r| Address::parse("reply_to", r))
            .transpose()?;

        check_header_value("subject", &subject)?;
        if raw.text.is_none() && raw.html.is_none() {
            return invalid("neither \"text\" nor \"html\" given");
        }
        for (field, body) in [("text", &raw.text), ("html", &raw.html)] {
            if body.as_deref().is_some_and(|b| b.contains('\0')) {
                return invalid(format!("\"{field}\" contains a NUL character"));
            }
        }

        let send_at_ms = ClockTime {
            send_at: raw.send_at.as_deref(),
            send_at_local: raw.send_at_local.as_deref(),
            time_zone: raw.time_zone.as_deref(),
        }
        .due_ms()?;

        let window = match raw.window.take() {
            None => JobWindow::Lane,
            Some(None) => JobWindow::Off,
            Some(Some(text)) => JobWindow::Own(Window::parse(&text).map_err(InvalidJob)?),
        };

        let debounce = raw.debounce.as_ref().map(RawDebounce::read).transpose()?;
        let unsubscribe = raw
            .unsubscribe
            .take()
            .map(RawUnsubscribe::read)
            .transpose()?;

        let attachments = read_all(std::mem::take(&mut raw.attachments), &rules.attachments)?;

        let mut headers = Vec::with_capacity(raw.headers.len());
        for (name, value) in raw.headers {
            check_header_name(&name)?;
            check_header_value(&format!("headers.{name}"), &value)?;
            headers.push((name, value));
        }

        Ok(Self {
            key,
            kind: raw.kind,
            user_id: raw.user_id,
            from,
            to,
            cc,
            bcc,
            reply_to,
            subject,
            text: raw.text,
            html: raw.html,
            headers,
            revision,
            ignore_suppression: raw.ignore_suppression.unwrap_or(false),
            lane: raw.lane,
            tenant: raw.tenant,
            send_at_ms,
            time_zone: raw.time_zone,
            window,
            debounce,
            unsubscribe,
            attachments,
        })
    }
}

fn check_header_name(name: &str) -> Result<(), InvalidJob> {
    let valid_chars = !name.is_empty()
        && name.len() <= 76
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid_chars {
        return invalid(format!(
            "header name {:?} must be 1-76 ASCII letters, digits, '-' or '_'",
            name.chars().take(80).collect::<String>()
        ));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str())
        || lower.starts_with("content-")
        || lower.starts_with("resent-")
    {
        return invalid(format!("header {name:?} is set by postie, not by the job"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
