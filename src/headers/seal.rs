//! postie's own headers, sealed: the `postie-*` headers postie writes on the copies it
//! republishes (`postie-attempt`, `postie-provider`, `postie-tenant-slot`, `postie-revision`,
//! `postie-due-at`, `postie-last-error`, the dead letters' `postie-dead-*`) steer the
//! worker, so a producer must not be able to set them (issue 45, item 4). A header is
//! trusted only with its seal: an HMAC-SHA256, under a key the fleet shares through
//! its database (`postie_header_key`), over the body's SHA-256, the header's name and
//! its value, kept in the `postie-seal` table beside it.
//!
//! Every delivery postie consumes passes [`Seal::admit`] first (the send loops and
//! the relay's intake): an unsealed or wrongly sealed `postie-*` header is dropped,
//! whichever door the message came through (`<p>.delayed` in either delay mode,
//! `<p>.work`, a queue by the default exchange), and every copy postie publishes is
//! sealed again ([`Seal::seal`]). Each header has a seal of its own, so that a copy
//! that loses one (a dead letter has no `postie-attempt`; a replay drops the
//! `postie-dead-*`) keeps the others. A producer may set only [`PRODUCER_HEADERS`]
//! (`postie-published-at`); anything else named `postie-*` is postie's: a producer's
//! header steers nothing.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use ring::hmac;
use sha2::{Digest, Sha256};

use super::{header_i64, HEADER_PUBLISHED_AT};

/// The header holding the seals: a table from each sealed header's name to its tag
/// (hex).
pub(crate) const HEADER_SEAL: &str = "postie-seal";
/// The prefix of postie's own headers.
const NAMESPACE: &str = "postie-";
/// The `postie-*` headers a producer may set (the contract, README).
pub(crate) const PRODUCER_HEADERS: &[&str] = &[HEADER_PUBLISHED_AT];
/// Bound into every tag, so that a tag is never valid for anything else.
const CONTEXT: &[u8] = b"postie header seal v1\0";

/// The fleet's header key; cheap to share by reference. Public, with [`Seal::admit`]
/// and [`Seal::seal`], for `tests/properties.rs`.
pub struct Seal {
    key: hmac::Key,
    /// Keep unsealed headers (`worker.trust_unsealed_headers`, for an upgrade from a
    /// postie that did not seal): nothing is dropped.
    trust_unsealed: bool,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seal")
            .field("trust_unsealed", &self.trust_unsealed)
            .finish_non_exhaustive()
    }
}

/// What [`Seal::admit`] made of a delivery's headers.
#[derive(Debug, Default)]
pub struct Admitted {
    /// The headers to use instead of the delivery's, if any had to go.
    pub headers: Option<FieldTable>,
    /// How many `postie-*` headers were dropped for want of a valid seal.
    pub dropped: usize,
}

/// Whether `name` is postie's and sealed (not a producer's, not the seal table).
fn is_sealed_kind(name: &str) -> bool {
    name.starts_with(NAMESPACE) && name != HEADER_SEAL && !PRODUCER_HEADERS.contains(&name)
}

impl Seal {
    /// A seal under `key` (the fleet's, from its database).
    pub fn new(key: &[u8], trust_unsealed: bool) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
            trust_unsealed,
        }
    }

    /// What the tag of header `name` with `value`, on a message whose body has
    /// `digest`, is computed over; `None` for a value of a type postie never writes.
    fn message(digest: &[u8], name: &str, value: &AMQPValue) -> Option<Vec<u8>> {
        let text;
        let (kind, bytes): (&[u8], &[u8]) = match value {
            AMQPValue::LongString(s) => (b"s", s.as_bytes()),
            AMQPValue::ShortString(s) => (b"s", s.as_str().as_bytes()),
            other => {
                text = header_i64(other)?.to_string();
                (b"i", text.as_bytes())
            }
        };
        // The name's length first: no two (name, value) pairs give one message.
        let name_len = (name.len() as u32).to_be_bytes();
        let parts = [CONTEXT, digest, &name_len, name.as_bytes(), kind, bytes];
        let mut message = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for part in parts {
            message.extend_from_slice(part);
        }
        Some(message)
    }

    /// Seals every `postie-*` header of `headers` that is postie's, for `body`, in a
    /// fresh `postie-seal` table (one it had is replaced): what a republished copy
    /// carries.
    pub fn seal(&self, headers: &mut FieldTable, body: &[u8]) {
        let mut seals = FieldTable::default();
        let mut digest = None;
        for (name, value) in headers.inner() {
            if !is_sealed_kind(name.as_str()) {
                continue;
            }
            let digest = digest.get_or_insert_with(|| Sha256::digest(body));
            if let Some(message) = Self::message(digest, name.as_str(), value) {
                let hex = hex::encode(hmac::sign(&self.key, &message).as_ref());
                seals.insert(name.clone(), AMQPValue::LongString(LongString::from(hex)));
            }
        }
        if !seals.inner().is_empty() {
            headers.insert(HEADER_SEAL.into(), AMQPValue::FieldTable(seals));
        } else if headers.contains_key(HEADER_SEAL) {
            *headers = super::without(Some(headers), &[HEADER_SEAL]);
        }
    }

    /// The headers of a delivery with body `body` as postie may trust them: every
    /// `postie-*` header that is postie's and has no valid seal for this body
    /// removed, and the seal table with them. `headers: None` when nothing had to
    /// go (the common case of a producer's job: no hashing at all).
    pub fn admit(&self, headers: Option<&FieldTable>, body: &[u8]) -> Admitted {
        let Some(table) = headers else {
            return Admitted::default();
        };
        let ours =
            |name: &ShortString| name.as_str() == HEADER_SEAL || is_sealed_kind(name.as_str());
        if self.trust_unsealed || !table.inner().keys().any(ours) {
            return Admitted::default();
        }
        let seals = match table.inner().get(HEADER_SEAL) {
            Some(AMQPValue::FieldTable(seals)) => Some(seals),
            _ => None,
        };
        let digest = seals.map(|_| Sha256::digest(body));
        let mut kept = FieldTable::default();
        let mut dropped = 0;
        for (name, value) in table.inner() {
            if name.as_str() == HEADER_SEAL {
                continue;
            }
            if is_sealed_kind(name.as_str()) {
                let valid = match (seals, &digest) {
                    (Some(seals), Some(digest)) => self.verify(seals, digest, name, value),
                    _ => false,
                };
                if !valid {
                    dropped += 1;
                    continue;
                }
            }
            kept.insert(name.clone(), value.clone());
        }
        Admitted {
            headers: Some(kept),
            dropped,
        }
    }

    /// Whether `seals` holds a valid tag for header `name` with `value`.
    fn verify(
        &self,
        seals: &FieldTable,
        digest: &[u8],
        name: &ShortString,
        value: &AMQPValue,
    ) -> bool {
        let Some(AMQPValue::LongString(hex)) = seals.inner().get(name) else {
            return false;
        };
        let Ok(claimed) = hex::decode(hex.as_bytes()) else {
            return false;
        };
        // Recomputed and compared in constant time by ring.
        Self::message(digest, name.as_str(), value)
            .is_some_and(|message| hmac::verify(&self.key, &message, &claimed).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        header_int, header_text, set_int, set_text, HEADER_ATTEMPT, HEADER_PROVIDER,
    };
    use super::*;

    const BODY: &[u8] = br#"{"key":"k"}"#;

    fn seal() -> Seal {
        Seal::new(&[7; 32], false)
    }

    fn producers() -> FieldTable {
        let mut h = FieldTable::default();
        set_int(&mut h, "x-delay", 5);
        set_int(&mut h, HEADER_PUBLISHED_AT, 1_000);
        set_text(&mut h, "traceparent", "00-abc");
        h
    }

    #[test]
    fn a_producers_own_headers_pass_untouched_and_unhashed() {
        let h = producers();
        let admitted = seal().admit(Some(&h), BODY);
        assert!(admitted.headers.is_none());
        assert_eq!(admitted.dropped, 0);
        assert!(seal().admit(None, BODY).headers.is_none());
    }

    #[test]
    fn unsealed_or_forged_postie_headers_are_dropped_and_the_rest_kept() {
        let mut h = producers();
        set_int(&mut h, HEADER_ATTEMPT, 9);
        set_text(&mut h, HEADER_PROVIDER, "cheap");
        set_int(&mut h, "postie-tenant-slot", 1);
        // A seal table of the producer's own making.
        let mut forged = FieldTable::default();
        forged.insert(
            HEADER_ATTEMPT.into(),
            AMQPValue::LongString("00".repeat(32).into()),
        );
        h.insert(HEADER_SEAL.into(), AMQPValue::FieldTable(forged));
        let admitted = seal().admit(Some(&h), BODY);
        let kept = admitted.headers.expect("some dropped");
        assert_eq!(admitted.dropped, 3);
        assert_eq!(kept, producers());
    }

    #[test]
    fn postie_sealed_headers_are_kept_for_that_body_only() {
        let mut h = producers();
        set_int(&mut h, HEADER_ATTEMPT, 2);
        set_text(&mut h, HEADER_PROVIDER, "ses");
        seal().seal(&mut h, BODY);
        let admitted = seal().admit(Some(&h), BODY);
        let kept = admitted.headers.expect("the seal table goes");
        assert_eq!(admitted.dropped, 0);
        assert_eq!(header_int(Some(&kept), HEADER_ATTEMPT), Some(2));
        assert_eq!(
            header_text(Some(&kept), HEADER_PROVIDER).as_deref(),
            Some("ses")
        );
        assert!(!kept.contains_key(HEADER_SEAL));
        // Another body, another value or another key: not postie's seal.
        assert_eq!(seal().admit(Some(&h), b"{}").dropped, 2);
        let mut changed = h.clone();
        set_int(&mut changed, HEADER_ATTEMPT, 0);
        let admitted = seal().admit(Some(&changed), BODY);
        assert_eq!(admitted.dropped, 1);
        assert_eq!(
            header_text(admitted.headers.as_ref(), HEADER_PROVIDER).as_deref(),
            Some("ses")
        );
        assert_eq!(Seal::new(&[8; 32], false).admit(Some(&h), BODY).dropped, 2);
        // Unsealed headers trusted for an upgrade: nothing dropped.
        let mut unsealed = producers();
        set_int(&mut unsealed, HEADER_ATTEMPT, 2);
        assert!(Seal::new(&[7; 32], true)
            .admit(Some(&unsealed), BODY)
            .headers
            .is_none());
    }

    #[test]
    fn each_header_keeps_its_own_seal_when_another_is_removed() {
        let mut h = producers();
        set_int(&mut h, HEADER_ATTEMPT, 2);
        set_text(&mut h, HEADER_PROVIDER, "ses");
        seal().seal(&mut h, BODY);
        // A dead letter drops the attempt; its other headers stay sealed.
        let without = super::super::without(Some(&h), &[HEADER_ATTEMPT]);
        let admitted = seal().admit(Some(&without), BODY);
        assert_eq!(admitted.dropped, 0);
        assert_eq!(
            header_text(admitted.headers.as_ref(), HEADER_PROVIDER).as_deref(),
            Some("ses")
        );
        // Sealing a table without postie's headers leaves no seal table.
        let mut plain = producers();
        seal().seal(&mut plain, BODY);
        assert_eq!(plain, producers());
    }
}
