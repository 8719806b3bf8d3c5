//! Sign-in sessions: what the `postie_console` cookie holds instead of the token.
//!
//! A cookie is `<credential>.<session id>.<expiry>.<HMAC>`: the credential's name
//! (`operator` or `viewer`), 128 random bits, the Unix second it ends, and an
//! HMAC-SHA256 of the three under a key drawn at random when the process starts. A
//! session is also kept here, in a table of at most `console.max_sessions` (the
//! oldest ends when a sign-in finds it full): sign-out removes it, so a copied
//! cookie dies with it, and a restart (a new key, an empty table) ends every
//! session. There is deliberately no configured key: a session shared by several
//! console processes would need the sign-outs shared too (a table in PostgreSQL),
//! and a browser keeps a cookie per host anyway, so consoles at different addresses
//! never see each other's. Behind a load balancer, make it sticky or sign in per
//! instance (a bearer token works on every instance).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// A live session, as a request presents it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Session {
    /// The credential it was opened with: `operator` or `viewer`.
    pub(super) name: String,
    /// Its id (hex), which its CSRF token is bound to.
    pub(super) id: String,
}

/// The sessions of this process.
pub(super) struct Sessions {
    key: hmac::Key,
    ttl: Duration,
    max: usize,
    /// Live session ids and their expiry (Unix seconds).
    live: Mutex<HashMap<String, i64>>,
}

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

impl Sessions {
    /// A new key; sessions lasting `ttl`, at most `max` at once.
    pub(super) fn new(ttl: Duration, max: usize) -> anyhow::Result<Self> {
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &SystemRandom::new())
            .map_err(|_| anyhow::anyhow!("no random numbers for the console's session key"))?;
        Ok(Self {
            key,
            ttl,
            max,
            live: Mutex::new(HashMap::new()),
        })
    }

    fn sign(&self, claims: &str) -> String {
        B64.encode(hmac::sign(&self.key, claims.as_bytes()))
    }

    /// Opens a session for the credential `name` at `now` (Unix seconds): the
    /// cookie's value.
    pub(super) fn open(&self, name: &str, now: i64) -> anyhow::Result<String> {
        let mut id = [0u8; 16];
        SystemRandom::new()
            .fill(&mut id)
            .map_err(|_| anyhow::anyhow!("no random numbers for a session id"))?;
        let id = hex::encode(id);
        let expires = now.saturating_add(self.ttl.as_secs() as i64);
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if live.len() >= self.max {
            live.retain(|_, until| *until > now);
        }
        if live.len() >= self.max {
            // Full of live sessions: the one ending first goes.
            if let Some(oldest) = live.iter().min_by_key(|(_, until)| **until) {
                let oldest = oldest.0.clone();
                live.remove(&oldest);
            }
        }
        live.insert(id.clone(), expires);
        let claims = format!("{name}.{id}.{expires}");
        Ok(format!("{claims}.{}", self.sign(&claims)))
    }

    /// The session a cookie's value stands for at `now`, if its signature holds, it
    /// has not expired and it has not ended.
    pub(super) fn verify(&self, cookie: &str, now: i64) -> Option<Session> {
        let (claims, tag) = cookie.rsplit_once('.')?;
        let tag = B64.decode(tag).ok()?;
        hmac::verify(&self.key, claims.as_bytes(), &tag).ok()?;
        let mut parts = claims.split('.');
        let (name, id, expires) = (parts.next()?, parts.next()?, parts.next()?);
        let expires: i64 = expires.parse().ok()?;
        if parts.next().is_some() || expires <= now {
            return None;
        }
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        (live.get(id) == Some(&expires)).then(|| Session {
            name: name.to_owned(),
            id: id.to_owned(),
        })
    }

    /// Ends the session (sign-out): its cookie is refused from now on.
    pub(super) fn end(&self, session: &Session) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.remove(&session.id);
    }

    /// The sessions kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.live.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_signed_expires_and_ends() {
        let sessions = Sessions::new(Duration::from_secs(60), 10).unwrap();
        let cookie = sessions.open("viewer", 1_000).unwrap();
        let session = sessions.verify(&cookie, 1_001).unwrap();
        assert_eq!(session.name, "viewer");
        assert!(sessions.verify(&cookie, 1_060).is_none(), "expired");
        let forged = cookie.replacen("viewer", "operator", 1);
        assert!(sessions.verify(&forged, 1_001).is_none(), "another role");
        let later = cookie.replacen(".1060.", ".9999.", 1);
        assert!(sessions.verify(&later, 1_001).is_none(), "a later expiry");
        let other = Sessions::new(Duration::from_secs(60), 10).unwrap();
        assert!(other.verify(&cookie, 1_001).is_none(), "another key");
        for garbage in ["", ".", "a.b.c.d", "viewer.x.1060.!!", &cookie[1..]] {
            assert!(sessions.verify(garbage, 1_001).is_none(), "{garbage}");
        }
        sessions.end(&session);
        assert!(sessions.verify(&cookie, 1_001).is_none(), "signed out");
    }

    #[test]
    fn the_table_is_bounded_and_the_oldest_session_goes_first() {
        let sessions = Sessions::new(Duration::from_secs(60), 3).unwrap();
        let cookies: Vec<_> = (0..5)
            .map(|i| sessions.open("operator", 1_000 + i).unwrap())
            .collect();
        assert_eq!(sessions.len(), 3);
        assert!(sessions.verify(&cookies[0], 1_010).is_none());
        assert!(sessions.verify(&cookies[1], 1_010).is_none());
        assert!(sessions.verify(&cookies[4], 1_010).is_some());
        // Expired ones make room first.
        sessions.open("operator", 2_000).unwrap();
        assert_eq!(sessions.len(), 1);
    }
}
