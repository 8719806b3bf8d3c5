//! Who may see the console and who may act: credentials from the environment, the
//! role each one grants, and the CSRF token every action carries.
//!
//! - A credential is a token: `POSTIE_CONSOLE_TOKEN` (the `operator`: sees and acts)
//!   and `POSTIE_CONSOLE_READ_TOKEN` (the `viewer`: sees, gets 403 on actions). It
//!   comes as `Authorization: Bearer <token>`, as the password of HTTP Basic auth, or
//!   in the `postie_console` cookie that `POST /login` sets. Only an HMAC of each token
//!   under a per-process random key is kept, and a token is checked by verifying its
//!   HMAC (`ring::hmac::verify`, constant time).
//! - With no credential configured, the console is open to whoever reaches it, as the
//!   `local` operator, and [`Auth::new`] allows that only on a loopback address.
//! - `console.read_only` caps every role at viewing.
//! - An action's CSRF token is the HMAC of the principal's name under the same key, in
//!   a hidden form field, verified in constant time.

use std::net::SocketAddr;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Form;
use base64::Engine as _;
use ring::hmac;
use secrecy::{ExposeSecret, SecretString};

use super::{page, Console};

/// The environment variable holding the operator's token.
pub const TOKEN_ENV: &str = "POSTIE_CONSOLE_TOKEN";
/// The environment variable holding the viewer's (read-only) token.
pub const READ_TOKEN_ENV: &str = "POSTIE_CONSOLE_READ_TOKEN";
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
    pub fn from_env() -> Self {
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
}

/// The credentials as kept: their HMACs under a per-process key.
pub(super) struct Auth {
    key: hmac::Key,
    tokens: Vec<(&'static str, Role, hmac::Tag)>,
    read_only: bool,
}

impl Auth {
    /// Refuses an address off loopback without a credential.
    pub(super) fn new(
        credentials: Credentials,
        listen: SocketAddr,
        read_only: bool,
    ) -> anyhow::Result<Self> {
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
            .map_err(|_| anyhow::anyhow!("no random numbers for the console's key"))?;
        let tokens: Vec<_> = [
            ("operator", Role::Operate, credentials.operator),
            ("viewer", Role::View, credentials.viewer),
        ]
        .into_iter()
        .filter_map(|(name, role, token)| {
            let tag = hmac::sign(&key, token?.expose_secret().as_bytes());
            Some((name, role, tag))
        })
        .collect();
        if tokens.is_empty() && !listen.ip().is_loopback() {
            anyhow::bail!(
                "the console listens on {listen}, off loopback, and no credentials are set: \
                 set {TOKEN_ENV} (and {READ_TOKEN_ENV} for read-only access), or listen on 127.0.0.1"
            );
        }
        Ok(Self {
            key,
            tokens,
            read_only,
        })
    }

    /// The principal a presented token (or none) stands for, if any.
    fn principal(&self, token: Option<&str>) -> Option<Principal> {
        let (name, role) = if self.tokens.is_empty() {
            ("local", Role::Operate)
        } else {
            let token = token?;
            // Every credential is checked, so the time taken does not say which matched.
            let matched = self.tokens.iter().fold(None, |found, (name, role, tag)| {
                let ok = hmac::verify(&self.key, token.as_bytes(), tag.as_ref()).is_ok();
                found.or(ok.then_some((*name, *role)))
            });
            matched?
        };
        let role = if self.read_only { Role::View } else { role };
        Some(Principal {
            name,
            role,
            csrf: hex::encode(hmac::sign(&self.key, &csrf_message(name))),
        })
    }

    /// True if `token` is a configured credential (for `POST /login`).
    pub(super) fn accepts(&self, token: &str) -> bool {
        !self.tokens.is_empty() && self.principal(Some(token)).is_some()
    }

    /// Ok if `principal` may act and `csrf` is their token; else the 403 to answer.
    pub(super) fn check_action(&self, principal: &Principal, csrf: &str) -> Result<(), Refused> {
        if principal.role != Role::Operate {
            return Err(Refused("read-only: this credential may look, not act"));
        }
        let given = hex::decode(csrf).unwrap_or_default();
        if hmac::verify(&self.key, &csrf_message(principal.name), &given).is_err() {
            return Err(Refused(
                "the form's CSRF token is missing or wrong: reload the page and try again",
            ));
        }
        Ok(())
    }
}

fn csrf_message(name: &str) -> Vec<u8> {
    format!("postie-console-csrf:{name}").into_bytes()
}

/// An action refused (403), and why.
#[derive(Debug)]
pub(super) struct Refused(&'static str);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (StatusCode::FORBIDDEN, page::notice("Forbidden", self.0)).into_response()
    }
}

/// The token a request presents: a bearer token, Basic auth's password, or the cookie.
fn presented(parts: &Parts) -> Option<String> {
    let authorization = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if let Some(value) = authorization {
        if let Some(token) = value.strip_prefix("Bearer ") {
            return Some(token.trim().to_owned());
        }
        if let Some(basic) = value.strip_prefix("Basic ") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(basic.trim())
                .ok()?;
            let text = String::from_utf8(decoded).ok()?;
            return text
                .split_once(':')
                .map(|(_, password)| password.to_owned());
        }
    }
    parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then(|| value.to_owned())
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
            .principal(presented(parts).as_deref())
            // No Basic challenge: a browser shows the sign-in form instead of its own
            // dialog; `curl -u :TOKEN` still sends Basic auth unasked.
            .ok_or_else(|| (StatusCode::UNAUTHORIZED, page::login(None)).into_response())
    }
}

/// A form that carries the CSRF token.
pub(super) trait Csrf {
    /// The form's `csrf` field.
    fn csrf(&self) -> &str;
}

/// An action's request: its principal, who may act, and its form, whose CSRF token is
/// theirs; else 401, or 403 ([`Auth::check_action`]).
pub(super) struct Action<F>(pub(super) Principal, pub(super) F);

impl<F> FromRequest<std::sync::Arc<Console>> for Action<F>
where
    F: serde::de::DeserializeOwned + Csrf + Send,
{
    type Rejection = Response;

    async fn from_request(
        request: Request,
        console: &std::sync::Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        let who = Principal::from_request_parts(&mut parts, console).await?;
        let Form(form) = Form::<F>::from_request(Request::from_parts(parts, body), console)
            .await
            .map_err(IntoResponse::into_response)?;
        console
            .auth
            .check_action(&who, form.csrf())
            .map_err(IntoResponse::into_response)?;
        Ok(Self(who, form))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(
        operator: Option<&str>,
        viewer: Option<&str>,
        at: &str,
        read_only: bool,
    ) -> anyhow::Result<Auth> {
        let credentials = Credentials::new(operator.map(Into::into), viewer.map(Into::into));
        Auth::new(credentials, at.parse().unwrap(), read_only)
    }

    #[test]
    fn off_loopback_needs_a_credential_and_loopback_without_one_is_open() {
        let refused = auth(None, None, "0.0.0.0:9092", false).err().unwrap();
        assert!(refused.to_string().contains(TOKEN_ENV), "{refused}");
        assert!(auth(None, Some("v"), "0.0.0.0:9092", false).is_ok());
        let open = auth(None, None, "127.0.0.1:9092", false).unwrap();
        let local = open.principal(None).unwrap();
        assert_eq!((local.name, local.role), ("local", Role::Operate));
        assert!(!open.accepts("anything"), "no sign-in without credentials");
    }

    #[test]
    fn tokens_name_their_role_and_read_only_caps_every_role() {
        let auth_ = auth(Some("op"), Some("view"), "0.0.0.0:1", false).unwrap();
        assert!(auth_.principal(None).is_none());
        assert!(auth_.principal(Some("nope")).is_none());
        let op = auth_.principal(Some("op")).unwrap();
        assert_eq!((op.name, op.role), ("operator", Role::Operate));
        let viewer = auth_.principal(Some("view")).unwrap();
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
        let capped = auth(Some("op"), None, "127.0.0.1:1", true).unwrap();
        let op = capped.principal(Some("op")).unwrap();
        assert_eq!(op.role, Role::View);
        assert!(capped.check_action(&op, &op.csrf).is_err());
    }
}
