//! `unsubscribe.*`: one-click unsubscribe (issue 50, RFC 8058): the link's base, the
//! optional mailto address, and the keys its tokens are signed with.
//!
//! ```toml
//! [unsubscribe]
//! url = "https://shop.example/u/"        # the token is appended
//! mailto = "unsubscribe@shop.example"     # optional
//! sign_with = "k2"
//! [unsubscribe.keys.k2]
//! secret = "…at least 32 bytes…"
//! [unsubscribe.keys.k1]                   # the previous key, in its grace
//! secret = "…"
//! accept_until = "2027-03-01T00:00:00Z"
//! ```

use std::collections::BTreeMap;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// The shortest secret a key may have (HMAC-SHA256's block wants 32 bytes of it).
pub(crate) const MIN_SECRET: usize = 32;
/// The longest key id (it is in every link).
const MAX_KEY_ID: usize = 16;

/// One-click unsubscribe: off unless a lane asks for it (`topology.lanes.<l>.
/// unsubscribe`) or a job does (`"unsubscribe"` in its body).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UnsubscribeSettings {
    /// The link's base: `https://…` (or `http://` to this machine, for tests), ending
    /// in `/`; the token is appended. Put postie's feedback listener's `/u/` behind
    /// it, on a host the recipients trust.
    pub url: Option<String>,
    /// An address for the `mailto:` form (`<mailto:ADDR?subject=TOKEN>`); unset: the
    /// header carries the HTTPS link only.
    pub mailto: Option<String>,
    /// The key that signs new links (one of `keys`).
    pub sign_with: String,
    /// The signing keys by id (1-16 lower-case ASCII letters and digits): each link
    /// names the key that signed it, so a key can be replaced without breaking the
    /// links already sent.
    pub keys: BTreeMap<String, UnsubscribeKey>,
}

/// One key of `unsubscribe.keys`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnsubscribeKey {
    /// The HMAC secret: at least 32 bytes, from a secret store (never logged).
    pub secret: SecretString,
    /// A retired key's grace: links it signed are accepted until this instant (RFC
    /// 3339), refused after. Unset: accepted for as long as the key is configured.
    #[serde(default)]
    pub accept_until: Option<String>,
}

impl UnsubscribeSettings {
    /// A key's grace as an instant, if it has one (checked by [`check`](Self::check)).
    pub(crate) fn accept_until(key: &UnsubscribeKey) -> Option<jiff::Timestamp> {
        key.accept_until.as_deref().and_then(|t| t.parse().ok())
    }

    /// The section checked; `wanted`: a lane asks for unsubscribe links, so the
    /// section must be configured. The line names the key.
    pub(super) fn check(&self, wanted: Option<&str>) -> Result<(), String> {
        let Some(url) = &self.url else {
            if let Some(lane) = wanted {
                return Err(format!(
                    "topology.lanes.{lane}.unsubscribe is on but unsubscribe.url is not set"
                ));
            }
            return Ok(());
        };
        check_base(url)?;
        if let Some(mailto) = &self.mailto {
            if !is_plain_address(mailto) {
                return Err(format!(
                    "unsubscribe.mailto {:?} is not an email address",
                    mailto.chars().take(80).collect::<String>()
                ));
            }
        }
        if self.keys.is_empty() {
            return Err("unsubscribe.url is set but unsubscribe.keys names no key".into());
        }
        for (id, key) in &self.keys {
            if id.is_empty()
                || id.len() > MAX_KEY_ID
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            {
                return Err(format!(
                    "unsubscribe.keys: {id:?} must be 1-{MAX_KEY_ID} lower-case ASCII letters and digits"
                ));
            }
            if key.secret.expose_secret().len() < MIN_SECRET {
                return Err(format!(
                    "unsubscribe.keys.{id}.secret must be at least {MIN_SECRET} bytes"
                ));
            }
            if let Some(until) = &key.accept_until {
                if until.parse::<jiff::Timestamp>().is_err() {
                    return Err(format!(
                        "unsubscribe.keys.{id}.accept_until {until:?} is not an RFC 3339 instant (2027-03-01T00:00:00Z)"
                    ));
                }
            }
        }
        match self.keys.get(&self.sign_with) {
            None => Err(format!(
                "unsubscribe.sign_with {:?} is not one of unsubscribe.keys ({})",
                self.sign_with,
                self.keys.keys().cloned().collect::<Vec<_>>().join(", ")
            )),
            Some(key) if key.accept_until.is_some() => Err(format!(
                "unsubscribe.sign_with {:?} is a retired key (it has accept_until): sign with a current one",
                self.sign_with
            )),
            Some(_) => Ok(()),
        }
    }
}

/// The link's base: `https://host/…/`, or `http://` to a loopback host; no query,
/// no fragment, no credentials.
fn check_base(url: &str) -> Result<(), String> {
    let parsed = url::Url::parse(url).map_err(|e| format!("unsubscribe.url is not a URL ({e})"))?;
    let loopback = parsed
        .host_str()
        .is_some_and(crate::endpoint::is_loopback_host);
    match parsed.scheme() {
        "https" => {}
        "http" if loopback => {}
        _ => {
            return Err(
                "unsubscribe.url must be https:// (recipients' mail providers post to it), or http:// to a loopback host for tests"
                    .into(),
            )
        }
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("unsubscribe.url must not carry credentials".into());
    }
    if parsed.query().is_some() || parsed.fragment().is_some() || !url.ends_with('/') {
        return Err("unsubscribe.url must end with '/' (the token is appended), without ?query or #fragment".into());
    }
    Ok(())
}

/// An address fit for a `mailto:` URI as it is: one `@` between non-empty parts of
/// printable ASCII, nothing a URI or a header would read otherwise.
fn is_plain_address(text: &str) -> bool {
    let plain = |part: &str| {
        !part.is_empty()
            && part
                .bytes()
                .all(|b| b.is_ascii_graphic() && !b"<>?&#%,;:\\\"()[]@".contains(&b))
    };
    match text.split_once('@') {
        Some((local, domain)) => text.len() <= 254 && plain(local) && plain(domain),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> UnsubscribeSettings {
        let key = |secret: &str, until: Option<&str>| UnsubscribeKey {
            secret: secret.to_string().into(),
            accept_until: until.map(str::to_owned),
        };
        UnsubscribeSettings {
            url: Some(url.into()),
            mailto: Some("unsubscribe@shop.example".into()),
            sign_with: "k2".into(),
            keys: [
                ("k2".to_string(), key(&"s".repeat(32), None)),
                (
                    "k1".to_string(),
                    key(&"t".repeat(40), Some("2027-01-01T00:00:00Z")),
                ),
            ]
            .into_iter()
            .collect(),
        }
    }

    #[test]
    fn a_good_section_passes_and_each_mistake_is_named() {
        assert_eq!(settings("https://shop.example/u/").check(None), Ok(()));
        assert_eq!(settings("http://127.0.0.1:8025/u/").check(None), Ok(()));
        assert_eq!(UnsubscribeSettings::default().check(None), Ok(()));
        let refused = |s: UnsubscribeSettings, wanted: Option<&str>, says: &str| {
            let error = s.check(wanted).unwrap_err();
            assert!(error.contains(says), "{error} (wanted {says:?})");
            assert!(!error.contains("sssssss"), "a secret in {error}");
        };
        refused(
            UnsubscribeSettings::default(),
            Some("bulk"),
            "topology.lanes.bulk.unsubscribe is on but unsubscribe.url is not set",
        );
        refused(settings("http://shop.example/u/"), None, "must be https://");
        refused(
            settings("https://shop.example/u"),
            None,
            "must end with '/'",
        );
        refused(
            settings("https://shop.example/u/?a=1"),
            None,
            "without ?query",
        );
        refused(
            settings("https://me:pw@shop.example/u/"),
            None,
            "credentials",
        );
        let mut s = settings("https://shop.example/u/");
        s.mailto = Some("not an address".into());
        refused(s, None, "unsubscribe.mailto");
        let mut s = settings("https://shop.example/u/");
        s.keys.get_mut("k2").unwrap().secret = "short".to_string().into();
        refused(
            s,
            None,
            "unsubscribe.keys.k2.secret must be at least 32 bytes",
        );
        let mut s = settings("https://shop.example/u/");
        s.sign_with = "k1".into();
        refused(s, None, "is a retired key");
        let mut s = settings("https://shop.example/u/");
        s.sign_with = "k9".into();
        refused(s, None, "is not one of unsubscribe.keys (k1, k2)");
        let mut s = settings("https://shop.example/u/");
        let key = s.keys.remove("k1").unwrap();
        s.keys.insert("K.1".into(), key);
        refused(s, None, "lower-case ASCII letters and digits");
        let mut s = settings("https://shop.example/u/");
        s.keys.get_mut("k1").unwrap().accept_until = Some("next week".into());
        refused(s, None, "is not an RFC 3339 instant");
    }
}
