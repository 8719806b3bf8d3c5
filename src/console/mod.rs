//! The operator console: a small server-rendered web UI (`postie console`) over what
//! the CLI commands reach: the overview (inbox counts, queue depths, the maintenance
//! leader, the last hour's sends), one job's story by key, the pending jobs (ladder
//! mode), the dead letters (through `dlq`) and the suppression list.
//!
//! - `auth.rs`: credentials, roles, the CSRF token of every action; `token.rs` how
//!   strong a token is, `session.rs` the sessions sign-ins open, `throttle.rs` the
//!   failed sign-ins per client; `action.rs` an action's request.
//! - `guard.rs`: before every handler, the `Host` (without a token) and a POST's
//!   origin; on every answer, no framing and no caching.
//! - `page.rs`: the page frame and shared pieces (maud templates, compiled in).
//! - `overview.rs`: the overview, its live part and chart.
//! - `job.rs`: a job by key; Cancel, Reschedule.
//! - `lists.rs`: pending jobs and dead letters, and their actions.
//! - `suppression.rs`: the suppression list: search, add, remove.
//!
//! Every page is a GET that reads fine without JavaScript; htmx (vendored:
//! `assets/htmx.min.js`, htmx 2.0.11, 0BSD licence, from the npm package `htmx.org`)
//! only refreshes the overview's live part. Every action is a POST with a CSRF token,
//! refused to a read-only principal, bounded by `console.max_batch`, confirmed with
//! its count first when it touches many, and logged with the principal's name. Served
//! by `ops::http::serve` under `http.*`'s connection cap and deadlines.
//!
//! This file holds the routes: `POST /login` opens a session and sets its cookie
//! (`Secure` when a proxy says the browser spoke HTTPS), `POST /logout` ends it and
//! clears the cookie.

mod action;
mod auth;
mod guard;
mod job;
mod lists;
mod overview;
mod page;
mod session;
mod suppression;
mod throttle;
mod token;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Form, FromRequest, FromRequestParts, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::inbox::Inbox;
use crate::topology::Topology;

pub use auth::Credentials;

/// htmx 2.0.11 (0BSD), `dist/htmx.min.js` of the npm package `htmx.org`.
const HTMX: &[u8] = include_bytes!("assets/htmx.min.js");

/// The largest request body the console reads: its forms are a few fields.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// What every handler shares.
pub(crate) struct Console {
    settings: Settings,
    inbox: Inbox,
    topology: Topology,
    auth: auth::Auth,
    /// The port it listens on, which a loopback `Host` must name.
    port: u16,
}

/// A new console token (`postie console --new-token`): 32 random bytes, base64url.
pub(crate) fn new_token() -> anyhow::Result<String> {
    token::generate()
}

/// Binds `listen` (refusing an address off loopback without credentials) and serves
/// the console until `stop`. Returns the bound address (useful with port 0).
pub async fn start(
    settings: Settings,
    listen: SocketAddr,
    credentials: Credentials,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let auth = auth::Auth::new(credentials, listen, &settings.console)?;
    note_secrets(settings.passwords());
    let inbox = Inbox::connect(&settings.database)
        .await?
        .with_events(settings.events.enabled);
    inbox.migrate().await?;
    let topology = crate::broker::resolve_topology(&settings).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for the console on {listen}: {e}"))?;
    let bound = listener.local_addr()?;
    let limits = crate::ops::http::Limits::new(&settings.http, MAX_BODY_BYTES);
    let console = Arc::new(Console {
        settings,
        inbox,
        topology,
        auth,
        port: bound.port(),
    });
    crate::ops::http::serve(listener, router(console), limits, stop, "console");
    tracing::info!(%bound, "console: http://{bound}/");
    Ok(bound)
}

fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(overview::overview))
        .route("/overview/live", get(overview::live))
        .route("/job", get(job::job))
        .route("/job/cancel", post(job::cancel_job))
        .route("/job/reschedule", post(job::reschedule))
        .route("/pending", get(lists::pending))
        .route(
            "/pending/cancel",
            get(lists::confirm_cancel).post(lists::cancel),
        )
        .route("/dead", get(lists::dead))
        .route("/dead/letter", get(lists::letter))
        .route(
            "/dead/replay",
            get(lists::confirm_replay).post(lists::replay),
        )
        .route("/suppression", get(suppression::suppression))
        .route("/suppression/add", post(suppression::suppress))
        .route("/suppression/remove", post(suppression::unsuppress))
        .route("/login", get(|| async { page::login(None) }).post(login))
        .route("/logout", post(logout))
        .route("/assets/htmx.min.js", get(htmx))
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            guard::guard,
        ))
        .with_state(console)
}

/// The script, not cached either (`guard`): 50 KB from a console on loopback.
async fn htmx() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        HTMX,
    )
}

#[derive(serde::Deserialize)]
struct LoginForm {
    token: String,
}

/// `POST /login`: a configured token (throttled per client) opens a session, whose
/// cookie it sets (`Secure` when the request came through a proxy that says it
/// spoke HTTPS); the cookie holds the session, never the token.
async fn login(State(console): State<Arc<Console>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let client = auth::client(&parts);
    let headers = parts.headers.clone();
    let form = Form::<LoginForm>::from_request(Request::from_parts(parts, body), &()).await;
    let Ok(Form(form)) = form else {
        return throttle::SignInRefused::Unknown.into_response();
    };
    let who = match console.auth.sign_in(client, &form.token) {
        Ok(who) => who,
        Err(refused) => return refused.into_response(),
    };
    let cookie = match console.auth.open_session(&who) {
        Ok(value) => value,
        Err(error) => return Failure(error).into_response(),
    };
    let max_age = console.settings.console.session_ttl.as_secs();
    let cookie = session_cookie(&cookie, &format!("Max-Age={max_age}; "), &headers);
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

/// `POST /logout`: the session ends on the server (its cookie, even copied, is
/// refused from now on), the browser's cookie is cleared, then the sign-in page. A
/// request without a live session only has the cookie cleared.
async fn logout(State(console): State<Arc<Console>>, request: Request) -> Response {
    let (mut parts, _) = request.into_parts();
    if auth::cookie(&parts).is_some() {
        if let Ok(who) = auth::Principal::from_request_parts(&mut parts, &console).await {
            console.auth.end_session(&who);
            tracing::info!(who = who.name, action = "sign_out", "console action");
        }
    }
    let cookie = session_cookie("", "Max-Age=0; ", &parts.headers);
    ([(header::SET_COOKIE, cookie)], Redirect::to("/login")).into_response()
}

/// The session cookie holding `value`, with `attributes` before the ones it always has.
fn session_cookie(value: &str, attributes: &str, headers: &HeaderMap) -> String {
    format!(
        "{}={value}; {attributes}HttpOnly; SameSite=Strict; Path=/{}",
        auth::COOKIE,
        secure_flag(headers)
    )
}

/// `; Secure` when a proxy in front says the browser spoke HTTPS (`X-Forwarded-Proto`
/// or `Forwarded: proto=https`): the browser then sends the cookie over HTTPS only.
/// The console itself speaks plain HTTP, where a Secure cookie would not be kept.
fn secure_flag(headers: &HeaderMap) -> &'static str {
    let values = |name: &'static str| {
        headers
            .get_all(name)
            .into_iter()
            .filter_map(|value| value.to_str().ok())
    };
    let https = |proto: &str| proto.trim().eq_ignore_ascii_case("https");
    let forwarded_proto =
        values("x-forwarded-proto").any(|value| value.split(',').next().is_some_and(https));
    let forwarded = values("forwarded").any(|value| {
        value.split([';', ',']).any(|pair| {
            pair.split_once('=').is_some_and(|(key, proto)| {
                key.trim().eq_ignore_ascii_case("proto") && https(proto)
            })
        })
    });
    if forwarded_proto || forwarded {
        "; Secure"
    } else {
        ""
    }
}

/// The passwords of every console's settings in this process, scrubbed from the
/// error a failed page shows (as `main` scrubs the last error line).
static SECRETS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn note_secrets(found: Vec<String>) {
    let mut secrets = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    for secret in found {
        if !secrets.contains(&secret) {
            secrets.push(secret);
        }
    }
}

/// An error on one line, every configured password scrubbed.
pub(crate) fn scrubbed(error: &anyhow::Error) -> String {
    let secrets = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    crate::endpoint::scrub(&crate::describe_error(error), &secrets)
}

/// A handler's failure: logged, and answered 500 with the error on one line, every
/// configured password scrubbed.
pub(crate) struct Failure(anyhow::Error);

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(error: E) -> Self {
        Self(error.into())
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let text = scrubbed(&self.0);
        tracing::warn!(error = %text, "console: a page failed");
        (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            page::notice("Something failed", &text),
        )
            .into_response()
    }
}

/// A handler's answer.
type Answer = Result<Response, Failure>;

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn the_cookie_is_secure_only_when_a_proxy_says_https() {
        assert_eq!(secure_flag(&headers(&[])), "");
        assert_eq!(secure_flag(&headers(&[("x-forwarded-proto", "http")])), "");
        assert_eq!(
            secure_flag(&headers(&[("x-forwarded-proto", "HTTPS")])),
            "; Secure"
        );
        // The first proxy's word counts: the browser spoke to it.
        assert_eq!(
            secure_flag(&headers(&[("x-forwarded-proto", "https, http")])),
            "; Secure"
        );
        assert_eq!(
            secure_flag(&headers(&[("forwarded", "for=192.0.2.1;proto=https;by=x")])),
            "; Secure"
        );
        assert_eq!(
            secure_flag(&headers(&[("forwarded", "for=192.0.2.1;proto=http")])),
            ""
        );
    }
}
