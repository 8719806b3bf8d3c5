//! The producers' contract: one AMQP message in, one validated [`EmailJob`] (or a
//! cancel [`Request`]) out, or an [`InvalidJob`] whose text a person can read; and
//! the `x-delay` header's and the clock times' meaning.
//!
//! Parse, don't validate: every field of [`EmailJob`] can only hold a value that is
//! safe to put into an email, so later stages never re-check. The types here are
//! postie's own: nothing of the mail transport leaks into the job model.
//!
//! - `job.rs`: the body (v1) and cancel requests; `rules.rs`: `ParseRules` (size,
//!   default sender, key space); `peek.rs`: a body's key (and lane, and clock time)
//!   without a parse;
//!   `key.rs`: the one key rule, the idempotency key, the Message-ID.
//! - `attachment.rs`: a job's `attachments` (name, type, size, SHA-256, an inline
//!   or URL source), checked against `attachments.*`.
//! - `address.rs`: mailboxes; `delay.rs`: `x-delay`, `send_at` and the due time (the
//!   later of the two); `local.rs`: `send_at_local` in `time_zone`, with the
//!   compiled-in time-zone database (gaps and folds); `debounce.rs`: a job's
//!   `debounce` (`wait`, `max_wait`); `terms.rs`: the window and zone a job is sent
//!   under (its own, else its lane's), for the worker and for the views that show it.

mod address;
mod attachment;
mod debounce;
mod delay;
mod job;
mod key;
mod local;
mod peek;
mod rules;
mod terms;

pub(crate) use address::Address;
pub use attachment::AttachmentLimits;
pub(crate) use attachment::{Attachment, Source};
pub(crate) use debounce::Debounce;
pub use delay::{due_at, x_delay};
pub(crate) use delay::{with_send_at, PLUGIN_MAX_DELAY};
pub(crate) use job::Unsubscribe;
pub use job::{EmailJob, Request};
pub(crate) use key::key_owner;
pub(crate) use key::message_id_of;
pub use key::IdempotencyKey;
pub(crate) use local::{next_open, tzdb_version};
pub use peek::peek_key_text;
pub(crate) use peek::{peek_job, peek_key, peek_relay, Peeked};
pub use rules::ParseRules;
pub(crate) use terms::{describe_pending, Terms};

/// Longest accepted key, order id or type.
const MAX_KEY_LEN: usize = 200;
/// Longest accepted header value (RFC 5322 line limit).
const MAX_HEADER_LEN: usize = 998;

/// Why a message cannot become an email. Its `Display` is the reason stored with
/// the dead letter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidJob(pub String);

fn invalid<T>(reason: impl Into<String>) -> Result<T, InvalidJob> {
    Err(InvalidJob(reason.into()))
}

/// A character that would end or fold a header line, or hide in one.
fn is_line_breaking(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

fn check_token(field: &str, value: &str) -> Result<(), InvalidJob> {
    if value.trim().is_empty() {
        return invalid(format!("\"{field}\" is empty"));
    }
    if value.len() > MAX_KEY_LEN {
        return invalid(format!(
            "\"{field}\" is {} bytes, over the limit of {MAX_KEY_LEN}",
            value.len()
        ));
    }
    if value.chars().any(is_line_breaking) {
        return invalid(format!("\"{field}\" contains a control character"));
    }
    Ok(())
}

fn check_header_value(field: &str, value: &str) -> Result<(), InvalidJob> {
    if let Some(c) = value.chars().find(|&c| is_line_breaking(c)) {
        let what = match c {
            '\r' | '\n' => "CR/LF".to_string(),
            '\0' => "NUL".to_string(),
            other => format!("control character U+{:04X}", other as u32),
        };
        return invalid(format!("\"{field}\" contains {what}"));
    }
    if value.len() > MAX_HEADER_LEN {
        return invalid(format!(
            "\"{field}\" is {} bytes, over the limit of {MAX_HEADER_LEN}",
            value.len()
        ));
    }
    Ok(())
}
/// `text` made safe for a log line and an AMQP header: control characters and line
/// separators escaped, and at most `max` bytes (cut on a character boundary).
pub(crate) fn readable(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let piece = if is_line_breaking(c) || c == '\u{85}' {
            format!("\\u{{{:04x}}}", c as u32)
        } else {
            c.to_string()
        };
        if out.len() + piece.len() > max.saturating_sub(3) {
            out.push('…');
            break;
        }
        out.push_str(&piece);
    }
    out
}

/// At most 80 characters of an offending value for a reason line.
fn shorten(value: &str) -> String {
    let mut s: String = value.chars().take(80).collect();
    if s.len() < value.len() {
        s.push('…');
    }
    s
}
