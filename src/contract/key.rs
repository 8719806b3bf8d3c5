//! The idempotency key: the business key that makes two publishes of one event collide.

use std::fmt;

use sha2::{Digest, Sha256};

use super::{check_token, InvalidJob};

/// The business key that makes two publishes of one event collide.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Checks length and characters.
    pub fn parse(raw: &str) -> Result<Self, InvalidJob> {
        check_token("key", raw)?;
        Ok(Self(raw.to_owned()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// This key in the key space of the RabbitMQ user `user` (`worker.key_namespace =
    /// "user_id"`): `user:key`, with `%` and `:` in `user` percent-encoded so that no
    /// two (user, key) pairs give the same text.
    pub fn in_namespace(&self, user: &str) -> Self {
        let user = user.replace('%', "%25").replace(':', "%3A");
        Self(format!("{user}:{}", self.0))
    }

    /// The Message-ID every attempt of this key carries: the same key always gives
    /// the same id, so even a duplicate that slips through can be recognised.
    pub fn message_id(&self, domain: &str) -> String {
        let digest = Sha256::digest(self.0.as_bytes());
        format!("<{}@{domain}>", hex::encode(&digest[..16]))
    }
}

/// The RabbitMQ user whose key space a key stored under `worker.key_namespace =
/// "user_id"` lives in: what [`IdempotencyKey::in_namespace`] put before the first
/// `:`, decoded. For re-publishing a stored job with the `user_id` it came with.
pub fn key_owner(stored_key: &str) -> Option<String> {
    let (user, _) = stored_key.split_once(':')?;
    Some(crate::endpoint::percent_decode(user))
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
