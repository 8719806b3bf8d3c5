//! The idempotency key: the business key that makes two publishes of one event collide.
//!
//! `key_text` is the one key rule: `key`, else `order_id:type`; a present member is
//! never passed over, and `null` counts as absent. The job, the peek (and so the DLQ)
//! use it. Also here: the key's per-user namespace and `key_owner`, with which the
//! reconciler re-publishes a stored job under its `user_id`; and the Message-ID,
//! its digest computed once per key.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use super::{check_token, InvalidJob};

/// The key rule of the contract (DESIGN.md §1), the one place it is written: a body's
/// `key` when it has one, else `"{order_id}:{type}"` when it has both, else none.
/// Absent means absent or `null` (the schema's rule for every field); a member that is
/// there is never passed over for the next, so a blank `key` is the body's key (which
/// [`IdempotencyKey::parse`] then refuses as empty), not a reason to fall back to
/// `order_id:type`. The text is as published: validating it is the caller's step.
pub(crate) fn key_text<'a>(
    key: Option<Cow<'a, str>>,
    order_id: Option<&str>,
    kind: Option<&str>,
) -> Option<Cow<'a, str>> {
    match (key, order_id, kind) {
        (Some(key), _, _) => Some(key),
        (None, Some(order_id), Some(kind)) => Some(Cow::Owned(format!("{order_id}:{kind}"))),
        _ => None,
    }
}

/// The business key that makes two publishes of one event collide.
#[derive(Clone)]
pub struct IdempotencyKey {
    text: String,
    /// The SHA-256 of the key behind its Message-ID, computed once, when first asked
    /// for: the message and its `sent` record carry the same id.
    digest: OnceLock<String>,
}

impl IdempotencyKey {
    /// Checks length and characters.
    pub fn parse(raw: &str) -> Result<Self, InvalidJob> {
        check_token("key", raw)?;
        Ok(Self::from_text(raw.to_owned()))
    }

    fn from_text(text: String) -> Self {
        Self {
            text,
            digest: OnceLock::new(),
        }
    }

    /// The key as text.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }

    /// This key in the key space of the RabbitMQ user `user` (`worker.key_namespace =
    /// "user_id"`): `user:key`, with `%` and `:` in `user` percent-encoded so that no
    /// two (user, key) pairs give the same text.
    pub fn in_namespace(&self, user: &str) -> Self {
        let user = user.replace('%', "%25").replace(':', "%3A");
        Self::from_text(format!("{user}:{}", self.text))
    }

    /// The Message-ID every attempt of this key carries: the same key always gives
    /// the same id, so even a duplicate that slips through can be recognised. The
    /// digest is computed once per key (the email and its `sent` record both ask).
    pub fn message_id(&self, domain: &str) -> String {
        let digest = self.digest.get_or_init(|| digest_of(&self.text));
        format!("<{digest}@{domain}>")
    }
}

/// The Message-ID of the key stored as `text` (as the inbox holds it), computed as
/// [`IdempotencyKey::message_id`] does: for a delivery event whose job recorded none
/// (dead, suppressed, cancelled), the id its email carried or would have carried.
pub(crate) fn message_id_of(text: &str, domain: &str) -> String {
    format!("<{}@{domain}>", digest_of(text))
}

fn digest_of(text: &str) -> String {
    hex::encode(&Sha256::digest(text.as_bytes())[..16])
}

// Equality, order and hash are the key text's: the cached digest follows from it.
impl PartialEq for IdempotencyKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}
impl Eq for IdempotencyKey {}
impl PartialOrd for IdempotencyKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for IdempotencyKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.text.cmp(&other.text)
    }
}
impl Hash for IdempotencyKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.text).finish()
    }
}

/// The RabbitMQ user whose key space a key stored under `worker.key_namespace =
/// "user_id"` lives in: what [`IdempotencyKey::in_namespace`] put before the first
/// `:`, decoded. For re-publishing a stored job with the `user_id` it came with.
pub(crate) fn key_owner(stored_key: &str) -> Option<String> {
    let (user, _) = stored_key.split_once(':')?;
    Some(crate::endpoint::percent_decode(user))
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
