//! The four send endpoints (authentication, the request's shape, fault rules, the
//! quota, and the record of what was accepted) and the four account endpoints
//! (authentication and fault rules).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts as _, Path, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use serde_json::Value;

use crate::reply::{reply, Reply};
use crate::state::{Accepted, Action, AppState, Count, Provider};
use crate::{mime, sigv4, MAILGUN_KEY, POSTMARK_TOKEN, SENDGRID_KEY, SES_ACCESS_KEY, SES_SECRET};

/// Each provider's send endpoint and account endpoint (what postie's circuit-breaker
/// probe asks); Mailgun's name the sending domain.
const ENDPOINTS: [(Provider, &str, &str); 4] = [
    (
        Provider::Ses,
        "/v2/email/outbound-emails",
        "/v2/email/account",
    ),
    (Provider::Sendgrid, "/v3/mail/send", "/v3/scopes"),
    (Provider::Postmark, "/email", "/server"),
    (
        Provider::Mailgun,
        "/v3/{domain}/messages.mime",
        "/v3/domains/{domain}",
    ),
];

type Shared = State<Arc<AppState>>;

/// The API router.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    ENDPOINTS
        .into_iter()
        .fold(
            Router::new(),
            |router, (provider, send_path, probe_path)| {
                router
                    .route(
                        send_path,
                        post(
                            move |State(s): Shared, req: axum::extract::Request| async move {
                                if let Some(hold) = s.slow_read(provider) {
                                    tokio::time::sleep(hold).await;
                                }
                                match Request::from_request(req, &s).await {
                                    Ok(req) => send(s, provider, req).await,
                                    Err(refused) => refused,
                                }
                            },
                        ),
                    )
                    .route(
                        probe_path,
                        get(move |State(s): Shared, req: Request| probe(s, provider, req)),
                    )
            },
        )
        .merge(crate::files::router())
        // Emails with attachments: SES's 40 MB message is 54 MB of JSON.
        .layer(axum::extract::DefaultBodyLimit::max(96 * 1024 * 1024))
        .with_state(state)
}

/// A request as the handlers share it.
struct Request {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    /// Mailgun's sending domain, from the path.
    domain: Option<String>,
}

impl<S: Send + Sync> FromRequest<S> for Request {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let (mut parts, body) = req.into_parts();
        let domain = <Option<Path<String>>>::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?
            .map(|Path(domain)| domain);
        let (method, uri, headers) = (
            parts.method.clone(),
            parts.uri.clone(),
            parts.headers.clone(),
        );
        let body = Bytes::from_request(axum::extract::Request::from_parts(parts, body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self {
            method,
            uri,
            headers,
            body,
            domain,
        })
    }
}

/// What a valid request asks for.
struct Parsed {
    message_id: String,
    to: Vec<String>,
    raw: String,
}

/// A send request: credentials, the request's shape, the rules without `probe`, the
/// quota, and the record.
async fn send(state: Arc<AppState>, provider: Provider, req: Request) -> Response {
    state.count(Count::Requests);
    if let Err((kind, message)) = authenticate(provider, &req) {
        state.count(Count::AuthFailed);
        return reply(provider, Reply::Unauthorized(kind, &message));
    }
    let parsed = match parse(provider, &req) {
        Ok(parsed) => parsed,
        Err(why) => {
            state.count(Count::Rejected);
            return reply(provider, Reply::BadRequest(&why));
        }
    };
    if let Some(action) = state.fault(provider, false, &parsed.to) {
        let first = parsed.to.first().map(String::as_str).unwrap_or("");
        if let Some(answer) = fault(Some(&state), provider, action, first).await {
            return answer;
        }
    }
    let id = provider_id(provider, req.domain.as_deref());
    let accepted = Accepted {
        seq: 0,
        provider,
        message_id: parsed.message_id,
        provider_id: id.clone(),
        to: parsed.to,
        received_at_ms: 0,
        raw: parsed.raw,
    };
    match state.admit(accepted) {
        Some(accepted) => reply(
            provider,
            Reply::Accepted {
                id: &id,
                to: &accepted.to,
            },
        ),
        None => reply(provider, Reply::Throttled),
    }
}

/// An account request (postie's circuit-breaker probe): the send endpoint's
/// credentials, the rules with `probe`, and the provider's account answer. Counted as
/// `probes` only.
async fn probe(state: Arc<AppState>, provider: Provider, req: Request) -> Response {
    state.count(Count::Probes);
    if let Err((kind, message)) = authenticate(provider, &req) {
        return reply(provider, Reply::Unauthorized(kind, &message));
    }
    if let Some(action) = state.fault(provider, true, &[]) {
        if let Some(answer) = fault(None, provider, action, "").await {
            return answer;
        }
    }
    let sent = state.accepted_last_day(provider);
    let domain = req.domain.as_deref().unwrap_or("");
    reply(provider, Reply::Account { domain, sent })
}

/// What a fault rule's `action` makes of a request: `None` to go on as without it
/// (`delay_ms`, after the delay), else its counter in `counters` (none for probes) is
/// bumped and this is the reply; a hang never returns.
async fn fault(
    counters: Option<&Arc<AppState>>,
    provider: Provider,
    action: Action,
    first: &str,
) -> Option<Response> {
    let (count, answer) = match action {
        Action::DelayMs(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            return None;
        }
        Action::Hang(_) => (Count::Hung, None),
        Action::Throttle(_) => (Count::Throttled, Some(Reply::Throttled)),
        Action::Status(status) => (Count::ServerErrors, Some(Reply::ServerError(status))),
        Action::Suspended(_) => (Count::Rejected, Some(Reply::Suspended)),
        Action::Reject(_) => (Count::Rejected, Some(Reply::Rejected(first))),
        // Taken before the body was read (`AppState::slow_read`); never matched here.
        Action::SlowReadMs(_) => return None,
        Action::EndlessReply(_) => {
            let state = counters.cloned().unwrap_or_default();
            state.count(Count::Endless);
            return Some(endless(state));
        }
    };
    if let Some(state) = counters {
        state.count(count);
    }
    match answer {
        Some(answer) => Some(reply(provider, answer)),
        None => std::future::pending().await,
    }
}

/// A 200 whose JSON-looking body never ends, 64 KiB a chunk, each counted once it
/// is handed to the connection.
fn endless(state: Arc<AppState>) -> Response {
    const CHUNK: usize = 64 * 1024;
    let chunk = Bytes::from(vec![b' '; CHUNK]);
    let body = futures_util::stream::unfold((state, chunk), |(state, chunk)| async move {
        state.add_reply_bytes(CHUNK as u64);
        Some((Ok::<_, std::io::Error>(chunk.clone()), (state, chunk)))
    });
    let mut response = axum::body::Body::from_stream(body).into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    response
}

fn header<'a>(req: &'a Request, name: &str) -> &'a str {
    req.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Checks the provider's documented credentials; `Err((SES error type, message))`.
fn authenticate(provider: Provider, req: &Request) -> Result<(), (&'static str, String)> {
    let refused = || {
        Err((
            "UnrecognizedClientException",
            "credentials refused".to_string(),
        ))
    };
    match provider {
        Provider::Ses => sigv4::verify(
            &req.method,
            &req.uri,
            &req.headers,
            &req.body,
            (SES_ACCESS_KEY, SES_SECRET),
        )
        .map_err(|r| (r.kind, r.message)),
        Provider::Sendgrid if header(req, "authorization") == format!("Bearer {SENDGRID_KEY}") => {
            Ok(())
        }
        Provider::Postmark if header(req, "x-postmark-server-token") == POSTMARK_TOKEN => Ok(()),
        Provider::Mailgun => {
            let expected =
                base64::engine::general_purpose::STANDARD.encode(format!("api:{MAILGUN_KEY}"));
            if header(req, "authorization") == format!("Basic {expected}") {
                Ok(())
            } else {
                refused()
            }
        }
        _ => refused(),
    }
}

fn parse(provider: Provider, req: &Request) -> Result<Parsed, String> {
    match provider {
        Provider::Ses => parse_ses(&req.body),
        Provider::Sendgrid => parse_sendgrid(&req.body),
        Provider::Postmark => parse_postmark(&req.body),
        Provider::Mailgun => parse_mailgun(header(req, "content-type"), &req.body),
    }
}

fn json(body: &[u8]) -> Result<Value, String> {
    serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn check_addresses(to: &[String]) -> Result<(), String> {
    if to.is_empty() {
        return Err("no recipient".into());
    }
    match to.iter().find(|t| !t.contains('@')) {
        Some(bad) => Err(format!("{bad:?} is not a valid address")),
        None => Ok(()),
    }
}

/// SES `SendEmail` with `Content.Raw.Data` (base64) and `Destination.ToAddresses`.
fn parse_ses(body: &[u8]) -> Result<Parsed, String> {
    let v = json(body)?;
    let data = v["Content"]["Raw"]["Data"]
        .as_str()
        .ok_or("Content.Raw.Data is required")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| format!("Content.Raw.Data is not base64: {e}"))?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let d = &v["Destination"];
    let mut to = strings(&d["ToAddresses"]);
    to.extend(strings(&d["CcAddresses"]));
    to.extend(strings(&d["BccAddresses"]));
    check_addresses(&to)?;
    Ok(Parsed {
        message_id: mime::header(&raw, "message-id"),
        to,
        raw,
    })
}

/// SendGrid `mail/send`: personalizations, from, subject, content, headers.
fn parse_sendgrid(body: &[u8]) -> Result<Parsed, String> {
    let v = json(body)?;
    let p = &v["personalizations"][0];
    let to: Vec<String> = ["to", "cc", "bcc"]
        .iter()
        .flat_map(|k| p[*k].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["email"].as_str().map(str::to_string))
        .collect();
    check_addresses(&to)?;
    if v["from"]["email"].as_str().is_none() || v["content"].as_array().is_none_or(Vec::is_empty) {
        return Err("from and content are required".into());
    }
    let message_id = v["headers"]["Message-ID"]
        .as_str()
        .unwrap_or("")
        .to_string();
    Ok(Parsed {
        message_id,
        to,
        raw: String::from_utf8_lossy(body).into_owned(),
    })
}

/// Postmark `/email`: From, To/Cc/Bcc (comma-separated), Subject, bodies, Headers.
fn parse_postmark(body: &[u8]) -> Result<Parsed, String> {
    let v = json(body)?;
    let to: Vec<String> = ["To", "Cc", "Bcc"]
        .iter()
        .filter_map(|k| v[*k].as_str())
        .flat_map(|list| list.split(',').map(|a| a.trim().to_string()))
        .filter(|a| !a.is_empty())
        .collect();
    check_addresses(&to)?;
    if v["From"].as_str().is_none() || (v["TextBody"].is_null() && v["HtmlBody"].is_null()) {
        return Err("From and a TextBody or HtmlBody are required".into());
    }
    let message_id = v["Headers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|h| {
            h["Name"]
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case("message-id"))
        })
        .and_then(|h| h["Value"].as_str())
        .unwrap_or("")
        .to_string();
    Ok(Parsed {
        message_id,
        to,
        raw: String::from_utf8_lossy(body).into_owned(),
    })
}

/// Mailgun `messages.mime`: multipart/form-data with `to` fields and a `message` file.
fn parse_mailgun(content_type: &str, body: &[u8]) -> Result<Parsed, String> {
    let parts = mime::form_data(content_type, body)?;
    let to: Vec<String> = parts
        .iter()
        .filter(|(name, _)| name == "to")
        .flat_map(|(_, v)| {
            String::from_utf8_lossy(v)
                .split(',')
                .map(|a| a.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    check_addresses(&to)?;
    let message = parts
        .iter()
        .find(|(name, _)| name == "message")
        .ok_or("the message part is required")?;
    let raw = String::from_utf8_lossy(&message.1).into_owned();
    Ok(Parsed {
        message_id: mime::header(&raw, "message-id"),
        to,
        raw,
    })
}

/// An id in the provider's format, unique in this process.
fn provider_id(provider: Provider, domain: Option<&str>) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let ms = chrono::Utc::now().timestamp_millis();
    match provider {
        Provider::Ses => format!("0100{ms:012x}-{n:08x}-0000-0000-000000000000-000000"),
        Provider::Sendgrid => format!("sg{n:08}{ms:012x}"),
        Provider::Postmark => format!("{:08x}-0000-4000-8000-{n:012x}", ms as u32),
        Provider::Mailgun => format!("<{ms}.{n}@{}>", domain.unwrap_or("mailgun.test")),
    }
}
