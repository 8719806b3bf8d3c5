//! Who may see the console and who may act: credentials from the environment, the
//! role each one grants, the session a sign-in opens, and the CSRF token every
//! action carries. A request's principal is its session, else its token (throttled).
//!
//! - A credential is a token: `POSTIE_CONSOLE_TOKEN` (the `operator`: sees and acts)
//!   and `POSTIE_CONSOLE_READ_TOKEN` (the `viewer`: sees, gets 403 on actions), each
//!   judged at start-up and refused under 128 bits (`token.rs`). It comes as
//!   `Authorization: Bearer <token>`, as the password of HTTP Basic auth, or in the
//!   sign-in form, which opens a session (`session.rs`): the `postie_console` cookie
//!   holds the session, never the token. Only an HMAC of each token under a
//!   per-process random key is kept, and a token is checked by verifying its HMAC
//!   (`ring::hmac::verify`, constant time). A token that fails counts against its
//!   client (`throttle.rs`), which is made to wait after a few.
//! - With no credential configured, the console is open to whoever reaches it, as the
//!   `local` operator, and [`Auth::new`] allows that only on a loopback address
//!   (where `guard.rs` serves only requests for a loopback `Host`).
//! - `console.read_only` caps every role at viewing.
//! - An action's CSRF token is the HMAC of the principal's name and session under the
//!   same key, in a hidden form field, verified in constant time.

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::header;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use ring::hmac;
use secrecy::{ExposeSecret, SecretString};

use super::action::Refused;
use super::session::{Session, Sessions};
use super::throttle::{Client, SignInRefused, SignIns};
use super::{token, Console};
use crate::config::ConsoleSettings;

/// The environment variable holding the operator's token.
pub(crate) const TOKEN_ENV: &str = "POSTIE_CONSOLE_TOKEN";
/// The environment variable holding the viewer's (read-only) token.
pub(crate) const READ_TOKEN_ENV: &str = "POSTIE_CONSOLE_READ_TOKEN";
/// The cookie `POST /login` sets.
pub(super) const COOKIE: &str = "postie_console";

/// The console's credentials, from the environment ([`Credentials::from_env`]) or
/// given ([`Credentials::new`]).
#[derive(Default)]
pub struct Credentials {
    operator: Option<SecretString>,
    viewer: Option<SecretString>,
}

impl Credentials {
    /// `POSTIE_CONSOLE_TOKEN` and `POSTIE_CONSOLE_READ_TOKEN`; an empty one is unset.
    pub(crate) fn from_env() -> Self {
        let read = |name| std::env::var(name).ok().filter(|t| !t.is_empty());
        Self::new(read(TOKEN_ENV), read(READ_TOKEN_ENV))
    }

    /// The operator's and the viewer's tokens.
    pub fn new(operator: Option<String>, viewer: Option<String>) -> Self {
        Self {
            operator: operator.map(SecretString::from),
            viewer: viewer.map(SecretString::from),
        }
    }
}

/// What a principal may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// See every page.
    View,
    /// See every page and act (cancel, replay, suppress).
    Operate,
}

/// Whoever made the request: the credential's name (never its secret) and role.
#[derive(Debug, Clone)]
pub(super) struct Principal {
    /// `operator`, `viewer` or `local`.
    pub(super) name: &'static str,
    /// What they may do.
    pub(super) role: Role,
    /// The CSRF token their forms carry.
    pub(super) csrf: String,
    /// The session they came with, if they signed in with the form.
    pub(super) session: Option<Session>,
}

/// The credentials as kept (their HMACs under a per-process key), the sessions the
/// sign-ins opened, and the failed sign-ins.
pub(super) struct Auth {
    key: hmac::Key,
    tokens: Vec<(&'static str, Role, hmac::Tag)>,
    read_only: bool,
    sessions: Sessions,
    sign_ins: SignIns,
}

impl Auth {
    /// Refuses a token under 128 bits, and an address off loopback without a
    /// credential.
    pub(super) fn new(
        credentials: Credentials,
        listen: SocketAddr,
        settings: &ConsoleSettings,
    ) -> anyhow::Result<Self> {
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
            .map_err(|_| anyhow::anyhow!("no random numbers for the console's key"))?;
        let mut tokens = Vec::new();
        for (name, role, token, var) in [
            ("operator", Role::Operate, credentials.operator, TOKEN_ENV),
            ("viewer", Role::View, credentials.viewer, READ_TOKEN_ENV),
        ] {
            let Some(token) = token else { continue };
            if let Err(why) = token::judge(token.expose_secret()) {
                anyhow::bail!(
                    "{var} is too weak: {why}; use 32 hex characters or more, or 22 or more \
                     of mixed-case letters and digits (postie console --new-token makes one)"
                );
            }
            tokens.push((
                name,
                role,
                hmac::sign(&key, token.expose_secret().as_bytes()),
            ));
        }
        if tokens.is_empty() && !listen.ip().is_loopback() {
            anyhow::bail!(
                "the console listens on {listen}, off loopback, and no credentials are set: \
                 set {TOKEN_ENV} (and {READ_TOKEN_ENV} for read-only access), or listen on 127.0.0.1"
            );
        }
        Ok(Self {
            key,
            tokens,
            read_only: settings.read_only,
            sessions: Sessions::new(settings.session_ttl, settings.max_sessions)?,
            sign_ins: SignIns::new(settings.sign_in_clients),
        })
    }

    /// True if no credential is configured: whoever reaches the console is `local`.
    pub(super) fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The principal `name` (a configured credential's, or `local`) stands for.
    fn as_principal(&self, name: &'static str, role: Role, session: Option<Session>) -> Principal {
        let role = if self.read_only { Role::View } else { role };
        let id = session.as_ref().map_or("", |s| s.id.as_str());
        Principal {
            name,
            role,
            csrf: hex::encode(hmac::sign(&self.key, &csrf_message(name, id))),
            session,
        }
    }

    /// The configured credential `token` is, compared in constant time: every one is
    /// checked, so the time taken does not say which matched.
    fn credential(&self, token: &str) -> Option<(&'static str, Role)> {
        self.tokens.iter().fold(None, |found, (name, role, tag)| {
            let ok = hmac::verify(&self.key, token.as_bytes(), tag.as_ref()).is_ok();
            found.or(ok.then_some((*name, *role)))
        })
    }

    /// The principal a token from `client` stands for, throttled: refused unread
    /// while the client is made to wait; a failure counted, a success forgiving.
    pub(super) fn sign_in(&self, client: Client, token: &str) -> Result<Principal, SignInRefused> {
        let now = Instant::now();
        self.sign_ins
            .check(client, now)
            .map_err(SignInRefused::Throttled)?;
        let Some((name, role)) = self.credential(token) else {
            self.sign_ins.failed(client, now);
            tracing::warn!("console: a sign-in with an unknown token was refused");
            return Err(SignInRefused::Unknown);
        };
        self.sign_ins.succeeded(client);
        Ok(self.as_principal(name, role, None))
    }

    /// A new session for `who` (signed in with the form): the cookie's value.
    pub(super) fn open_session(&self, who: &Principal) -> anyhow::Result<String> {
        self.sessions.open(who.name, unix_now())
    }

    /// Ends `who`'s session, if they came with one (sign-out).
    pub(super) fn end_session(&self, who: &Principal) {
        if let Some(session) = &who.session {
            self.sessions.end(session);
        }
    }

    /// The principal of a live session's cookie, if its credential is still one.
    fn session_principal(&self, cookie: &str) -> Option<Principal> {
        let session = self.sessions.verify(cookie, unix_now())?;
        let (name, role) = self
            .tokens
            .iter()
            .find(|(name, _, _)| *name == session.name)
            .map(|(name, role, _)| (*name, *role))?;
        Some(self.as_principal(name, role, Some(session)))
    }

    /// The principal of a request: `local` on an open console; else its session, or
    /// the token it presents (throttled), or 401.
    fn principal(&self, parts: &Parts) -> Result<Principal, SignInRefused> {
        if self.is_open() {
            return Ok(self.as_principal("local", Role::Operate, None));
        }
        if let Some(who) = cookie(parts).and_then(|c| self.session_principal(c)) {
            return Ok(who);
        }
        match presented(parts) {
            Some(token) => self.sign_in(client(parts), &token),
            None => Err(SignInRefused::Missing),
        }
    }

    /// Ok if `principal` may act and `csrf` is their token; else the 403 to answer.
    pub(super) fn check_action(&self, principal: &Principal, csrf: &str) -> Result<(), Refused> {
        if principal.role != Role::Operate {
            return Err(Refused("read-only: this credential may look, not act"));
        }
        let given = hex::decode(csrf).unwrap_or_default();
        let id = principal.session.as_ref().map_or("", |s| s.id.as_str());
        if hmac::verify(&self.key, &csrf_message(principal.name, id), &given).is_err() {
            return Err(Refused(
                "the form's CSRF token is missing or wrong: reload the page and try again",
            ));
        }
        Ok(())
    }
}

fn unix_now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn csrf_message(name: &str, session: &str) -> Vec<u8> {
    format!("postie-console-csrf:{name}:{session}").into_bytes()
}

/// The client a request came from (its address, as `ops::http::serve` gives it).
pub(super) fn client(parts: &Parts) -> Client {
    let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>();
    Client::of(peer.map(|ConnectInfo(addr)| addr.ip()))
}

/// The token a request presents: a bearer token or Basic auth's password.
fn presented(parts: &Parts) -> Option<String> {
    let value = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())?;
    if let Some(token) = value.strip_prefix("Bearer ") {
        return Some(token.trim().to_owned());
    }
    let basic = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(basic.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    text.split_once(':')
        .map(|(_, password)| password.to_owned())
}

/// The session cookie's value, if the request has one.
pub(super) fn cookie(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then_some(value)
        })
}

impl FromRequestParts<std::sync::Arc<Console>> for Principal {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &std::sync::Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        console
            .auth
            .principal(parts)
            .map_err(IntoResponse::into_response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: &str = "q3Zk7Vd0r8QwL1mXp5sJt2nYb6cHf9gEa4uRiKoN0Ws";
    const VIEW: &str = "Zx8Lm2Qp7Rt4Vw1Ys6Bn3Cd9Fg5Hj0Kl8Mn2Pq4Rs6T";

    fn auth(
        operator: Option<&str>,
        viewer: Option<&str>,
        at: &str,
        read_only: bool,
    ) -> anyhow::Result<Auth> {
        let credentials = Credentials::new(operator.map(Into::into), viewer.map(Into::into));
        let settings = ConsoleSettings {
            read_only,
            ..ConsoleSettings::default()
        };
        Auth::new(credentials, at.parse().unwrap(), &settings)
    }

    fn client() -> Client {
        Client::of(Some([192, 0, 2, 1].into()))
    }

    #[test]
    fn off_loopback_needs_a_credential_and_loopback_without_one_is_open() {
        let refused = auth(None, None, "0.0.0.0:9092", false).err().unwrap();
        assert!(refused.to_string().contains(TOKEN_ENV), "{refused}");
        assert!(auth(None, Some(VIEW), "0.0.0.0:9092", false).is_ok());
        let open = auth(None, None, "127.0.0.1:9092", false).unwrap();
        assert!(open.is_open());
        assert!(
            open.sign_in(client(), "anything").is_err(),
            "no sign-in without credentials"
        );
    }

    #[test]
    fn a_weak_token_is_refused_naming_its_variable_not_its_value() {
        let weak = auth(Some("hunter2"), None, "127.0.0.1:1", false)
            .err()
            .unwrap();
        let text = weak.to_string();
        assert!(
            text.contains(TOKEN_ENV) && text.contains("128 bits"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        let weak = auth(Some(OP), Some("short"), "127.0.0.1:1", false)
            .err()
            .unwrap();
        assert!(weak.to_string().contains(READ_TOKEN_ENV), "{weak}");
    }

    #[test]
    fn tokens_name_their_role_and_read_only_caps_every_role() {
        let auth_ = auth(Some(OP), Some(VIEW), "0.0.0.0:1", false).unwrap();
        assert!(auth_.sign_in(client(), "nope").is_err());
        let op = auth_.sign_in(client(), OP).unwrap();
        assert_eq!((op.name, op.role), ("operator", Role::Operate));
        let viewer = auth_.sign_in(client(), VIEW).unwrap();
        assert_eq!((viewer.name, viewer.role), ("viewer", Role::View));
        assert!(auth_.check_action(&op, &op.csrf).is_ok());
        assert!(
            auth_.check_action(&viewer, &viewer.csrf).is_err(),
            "a viewer may not act"
        );
        assert!(
            auth_.check_action(&op, &viewer.csrf).is_err(),
            "another's CSRF token"
        );
        assert!(auth_.check_action(&op, "").is_err(), "no CSRF token");
        let capped = auth(Some(OP), None, "127.0.0.1:1", true).unwrap();
        let op = capped.sign_in(client(), OP).unwrap();
        assert_eq!(op.role, Role::View);
        assert!(capped.check_action(&op, &op.csrf).is_err());
    }

    #[test]
    fn a_session_has_its_own_csrf_token_which_dies_with_it() {
        let auth_ = auth(Some(OP), None, "127.0.0.1:1", false).unwrap();
        let signed_in = auth_.sign_in(client(), OP).unwrap();
        let cookie = auth_.open_session(&signed_in).unwrap();
        assert!(!cookie.contains(OP));
        let who = auth_.session_principal(&cookie).unwrap();
        assert_eq!((who.name, who.role), ("operator", Role::Operate));
        assert_ne!(who.csrf, signed_in.csrf, "bound to the session");
        assert!(auth_.check_action(&who, &who.csrf).is_ok());
        auth_.end_session(&who);
        assert!(auth_.session_principal(&cookie).is_none());
    }
}
