//! One-click unsubscribe links (issue 50, RFC 8058): the `List-Unsubscribe` and
//! `List-Unsubscribe-Post` headers of an email, and the token in their link.
//!
//! A token is `<key id>.<payload>.<tag>`, the last two unpadded base64url: the
//! payload is the issue time (4 bytes, Unix seconds), the recipient's address and the
//! scope (each a length byte and its bytes) and the job's key (the rest); the tag is
//! the first 16 bytes of HMAC-SHA256, under the named key, over a domain label, the
//! key id and the payload. No row is written per email: the token is the whole
//! record, and only a holder of the key can make one. The key id lets a key be
//! replaced (`unsubscribe.sign_with`) while the links it signed still work until
//! its `accept_until`. A typical token is about 110 characters, so the header with
//! both URIs stays well under RFC 5322's 998 characters a line.
//!
//! The payload is signed, not encrypted: anyone holding the link can read the
//! address in it, as they can read the email it came in.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::hmac;
use secrecy::ExposeSecret;

use crate::config::UnsubscribeSettings;
use crate::contract::message_id_of;

/// The header that carries the links.
pub(crate) const LIST_UNSUBSCRIBE: &str = "List-Unsubscribe";
/// The header that says the HTTPS link takes a one-click POST.
pub(crate) const LIST_UNSUBSCRIBE_POST: &str = "List-Unsubscribe-Post";
/// Its only value, and the body of the one-click POST (RFC 8058 §3.1).
pub(crate) const ONE_CLICK: &str = "List-Unsubscribe=One-Click";

/// What the tag is computed over first: a token of another use or version of postie
/// never verifies as this one.
const DOMAIN: &[u8] = b"postie-unsubscribe-v1\0";
/// Bytes of the tag kept (128 bits).
const TAG: usize = 16;

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// The recipient's address, as the email was sent to it.
    pub address: String,
    /// What the recipient leaves: a job type, or the scope the job named.
    pub scope: String,
    /// The key of the job whose email carried the link.
    pub key: String,
    /// When the link was made (Unix seconds).
    pub issued: i64,
    /// The id of the key that signed it.
    pub key_id: String,
    /// The Message-ID of the job's email (derived from the key, as every email of it
    /// carries).
    pub message_id: String,
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not a token postie makes (400).
    Malformed(&'static str),
    /// Well formed, but not signed by a key accepted now (403).
    Forbidden(&'static str),
}

impl Refusal {
    /// The reason in words.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Malformed(why) | Self::Forbidden(why) => why,
        }
    }
}

/// One key: its id, its HMAC key, and its grace if retired.
struct Key {
    id: String,
    hmac: hmac::Key,
    accept_until: Option<jiff::Timestamp>,
}

impl Key {
    fn tag(&self, payload: &[u8]) -> [u8; TAG] {
        let mut ctx = hmac::Context::with_key(&self.hmac);
        ctx.update(DOMAIN);
        ctx.update(self.id.as_bytes());
        ctx.update(b"\0");
        ctx.update(payload);
        let full = ctx.sign();
        let mut tag = [0u8; TAG];
        tag.copy_from_slice(&full.as_ref()[..TAG]);
        tag
    }
}

/// Makes and reads links: built once from `unsubscribe.*` (checked at start-up).
pub struct Links {
    base: String,
    message_id_domain: String,
    mailto: Option<String>,
    signer: usize,
    keys: Vec<Key>,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secrets.
        f.debug_struct("Links")
            .field("base", &self.base)
            .field("keys", &self.keys.iter().map(|k| &k.id).collect::<Vec<_>>())
            .finish()
    }
}

impl Links {
    /// The links of `settings`, their jobs' Message-IDs in `message_id_domain`;
    /// `None` when `unsubscribe.url` is not set.
    pub fn new(settings: &UnsubscribeSettings, message_id_domain: &str) -> Option<Self> {
        let base = settings.url.clone()?;
        let keys: Vec<Key> = settings
            .keys
            .iter()
            .map(|(id, key)| Key {
                id: id.clone(),
                hmac: hmac::Key::new(hmac::HMAC_SHA256, key.secret.expose_secret().as_bytes()),
                accept_until: UnsubscribeSettings::accept_until(key),
            })
            .collect();
        let signer = keys.iter().position(|k| k.id == settings.sign_with)?;
        Some(Self {
            base,
            message_id_domain: message_id_domain.to_owned(),
            mailto: settings.mailto.clone(),
            signer,
            keys,
        })
    }

    /// A token for `address` leaving `scope`, in the email of the job `key`, made at
    /// `now_s`; `None` if the address or the scope is over 255 bytes (no address a
    /// job can have is).
    pub fn token(&self, address: &str, scope: &str, key: &str, now_s: i64) -> Option<String> {
        let (address, scope) = (address.as_bytes(), scope.as_bytes());
        let (a, s) = (
            u8::try_from(address.len()).ok()?,
            u8::try_from(scope.len()).ok()?,
        );
        let issued = u32::try_from(now_s.max(0)).unwrap_or(u32::MAX);
        let mut payload = Vec::with_capacity(6 + address.len() + scope.len() + key.len());
        payload.extend_from_slice(&issued.to_be_bytes());
        payload.push(a);
        payload.extend_from_slice(address);
        payload.push(s);
        payload.extend_from_slice(scope);
        payload.extend_from_slice(key.as_bytes());
        let signer = &self.keys[self.signer];
        Some(format!(
            "{}.{}.{}",
            signer.id,
            URL_SAFE_NO_PAD.encode(&payload),
            URL_SAFE_NO_PAD.encode(signer.tag(&payload))
        ))
    }

    /// The two headers for `address` (`List-Unsubscribe`, `List-Unsubscribe-Post`),
    /// with a fresh token; `None` as for [`token`](Self::token).
    pub fn headers(
        &self,
        address: &str,
        scope: &str,
        key: &str,
        now_s: i64,
    ) -> Option<[(String, String); 2]> {
        let token = self.token(address, scope, key, now_s)?;
        let mut value = format!("<{}{token}>", self.base);
        if let Some(mailto) = &self.mailto {
            value.push_str(&format!(", <mailto:{mailto}?subject={token}>"));
        }
        Some([
            (LIST_UNSUBSCRIBE.into(), value),
            (LIST_UNSUBSCRIBE_POST.into(), ONE_CLICK.into()),
        ])
    }

    /// Reads `token` at `now`: what it says if a key accepted now signed it.
    pub fn read(&self, token: &str, now: jiff::Timestamp) -> Result<Link, Refusal> {
        let malformed = Refusal::Malformed;
        if token.len() > 1024 {
            return Err(malformed("the token is too long"));
        }
        let mut parts = token.split('.');
        let (Some(id), Some(payload), Some(tag), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("not a token: it has three parts"));
        };
        let payload = URL_SAFE_NO_PAD
            .decode(payload)
            .map_err(|_| malformed("not a token: bad encoding"))?;
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| malformed("not a token: bad encoding"))?;
        if tag.len() != TAG {
            return Err(malformed("not a token: bad signature length"));
        }
        let key = self
            .keys
            .iter()
            .find(|k| k.id == id)
            .ok_or(Refusal::Forbidden("signed by a key that is not configured"))?;
        if !same(&key.tag(&payload), &tag) {
            return Err(Refusal::Forbidden("the signature does not match"));
        }
        if key.accept_until.is_some_and(|until| now > until) {
            return Err(Refusal::Forbidden("signed by a retired key past its grace"));
        }
        let mut link =
            decode(&payload, id).ok_or(malformed("a signed token that does not read"))?;
        link.message_id = message_id_of(&link.key, &self.message_id_domain);
        Ok(link)
    }
}

/// The payload's fields (its tag already verified).
fn decode(payload: &[u8], key_id: &str) -> Option<Link> {
    let issued = u32::from_be_bytes(payload.get(..4)?.try_into().ok()?);
    let rest = &payload[4..];
    let (address, rest) = field(rest)?;
    let (scope, key) = field(rest)?;
    Some(Link {
        address: String::from_utf8(address.to_vec()).ok()?,
        scope: String::from_utf8(scope.to_vec()).ok()?,
        key: String::from_utf8(key.to_vec()).ok()?,
        issued: i64::from(issued),
        key_id: key_id.to_owned(),
        message_id: String::new(),
    })
}

/// A length byte and that many bytes; the rest.
fn field(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&n, rest) = bytes.split_first()?;
    (rest.len() >= n as usize).then(|| rest.split_at(n as usize))
}

/// Equal in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::UnsubscribeKey;

    fn settings(sign_with: &str, keys: &[(&str, &str, Option<&str>)]) -> UnsubscribeSettings {
        UnsubscribeSettings {
            url: Some("https://shop.example/u/".into()),
            mailto: Some("unsubscribe@shop.example".into()),
            sign_with: sign_with.into(),
            keys: keys
                .iter()
                .map(|(id, secret, until)| {
                    let key = UnsubscribeKey {
                        secret: secret.to_string().into(),
                        accept_until: until.map(str::to_owned),
                    };
                    (id.to_string(), key)
                })
                .collect::<BTreeMap<_, _>>(),
        }
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn now() -> jiff::Timestamp {
        "2026-12-04T12:00:00Z".parse().unwrap()
    }

    #[test]
    fn a_token_reads_back_what_it_was_made_of() {
        let links = Links::new(&settings("k1", &[("k1", A, None)]), "example.com").unwrap();
        let token = links
            .token("ann@example.com", "digest", "42:digest", 1_800_000_000)
            .unwrap();
        assert!(token.starts_with("k1."), "{token}");
        assert!(token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)));
        assert!(token.len() < 120, "{} characters", token.len());
        let link = links.read(&token, now()).unwrap();
        assert_eq!(
            link,
            Link {
                address: "ann@example.com".into(),
                scope: "digest".into(),
                key: "42:digest".into(),
                issued: 1_800_000_000,
                key_id: "k1".into(),
                message_id: message_id_of("42:digest", "example.com"),
            }
        );
    }

    #[test]
    fn a_changed_byte_anywhere_is_refused() {
        let links = Links::new(&settings("k1", &[("k1", A, None)]), "example.com").unwrap();
        let token = links.token("ann@example.com", "digest", "k", 1).unwrap();
        for i in 3..token.len() {
            let mut bytes = token.clone().into_bytes();
            if bytes[i] == b'.' {
                continue;
            }
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let tampered = String::from_utf8(bytes).unwrap();
            assert!(links.read(&tampered, now()).is_err(), "accepted {tampered}");
        }
        for bad in ["", "k1", "k1..", "k1.a.b.c", "k1.!!.AA", &"x".repeat(2000)] {
            assert!(
                matches!(links.read(bad, now()), Err(Refusal::Malformed(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn keys_rotate_with_a_grace_and_an_unknown_key_is_forbidden() {
        let old = Links::new(&settings("k1", &[("k1", A, None)]), "example.com").unwrap();
        let token = old.token("ann@example.com", "digest", "k", 1).unwrap();
        // k2 signs now; k1 is accepted until its grace ends.
        let rotated = Links::new(
            &settings(
                "k2",
                &[("k2", B, None), ("k1", A, Some("2026-12-31T00:00:00Z"))],
            ),
            "example.com",
        )
        .unwrap();
        assert_eq!(rotated.read(&token, now()).unwrap().key_id, "k1");
        let after: jiff::Timestamp = "2027-01-01T00:00:00Z".parse().unwrap();
        assert_eq!(
            rotated.read(&token, after),
            Err(Refusal::Forbidden("signed by a retired key past its grace"))
        );
        assert!(rotated
            .token("ann@example.com", "digest", "k", 1)
            .unwrap()
            .starts_with("k2."));
        // k1 removed: its links are refused.
        let without = Links::new(&settings("k2", &[("k2", B, None)]), "example.com").unwrap();
        assert_eq!(
            without.read(&token, now()),
            Err(Refusal::Forbidden("signed by a key that is not configured"))
        );
        // Another secret under the same id: the signature does not match.
        let other = Links::new(&settings("k1", &[("k1", B, None)]), "example.com").unwrap();
        assert_eq!(
            other.read(&token, now()),
            Err(Refusal::Forbidden("the signature does not match"))
        );
    }

    #[test]
    fn the_headers_carry_both_uris_and_the_one_click_post() {
        let links = Links::new(&settings("k1", &[("k1", A, None)]), "example.com").unwrap();
        let [(name, value), post] = links.headers("ann@example.com", "digest", "k", 1).unwrap();
        assert_eq!(name, "List-Unsubscribe");
        let token = links.token("ann@example.com", "digest", "k", 1).unwrap();
        assert_eq!(
            value,
            format!(
                "<https://shop.example/u/{token}>, <mailto:unsubscribe@shop.example?subject={token}>"
            )
        );
        assert_eq!(post, ("List-Unsubscribe-Post".into(), ONE_CLICK.into()));
        assert!(links.headers(&"a".repeat(256), "digest", "k", 1).is_none());
    }

    #[test]
    fn the_debug_form_shows_no_secret() {
        let links = Links::new(&settings("k1", &[("k1", A, None)]), "example.com").unwrap();
        let shown = format!("{links:?}");
        assert!(!shown.contains(A) && shown.contains("k1"), "{shown}");
    }
}
