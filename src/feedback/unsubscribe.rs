//! One-click unsubscribe's endpoint (issue 50, RFC 8058) on the feedback listener:
//!
//! - `POST /u/TOKEN` with `List-Unsubscribe=One-Click` in the body (form-urlencoded
//!   or multipart, as RFC 8058 allows): the token read (`mail::unsubscribe`), then the
//!   address suppressed for its scope with the job's `unsubscribed` event, in one
//!   transaction (`Inbox::unsubscribe`); 200 whether it was new or already so. This
//!   is what Gmail and Yahoo send: no cookie, no session; the token is the whole
//!   authority, and only postie's key makes one.
//! - `GET /u/TOKEN`: a page naming what is left, with a button that sends that POST.
//!   A GET changes nothing: mail scanners and link previewers fetch every link.
//!
//! Who can reach it: anyone on the internet, by design (the recipients' mail
//! providers). What they could try: forge or alter a token (403: a 128-bit tag),
//! replay a link (idempotent: the same suppression), use a retired key's link past
//! its grace (403), send junk (400, bounded by `feedback.max_body_bytes` and
//! `feedback.request_timeout` like every request of the listener), frame the page to
//! trick a click (`frame-ancestors 'none'`). Every answer is counted in
//! `postie_unsubscribe_requests_total{result}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::inbox::{DbError, Inbox, Unsubscribing};
use crate::mail::unsubscribe::{Link, Links, Refusal, ONE_CLICK};
use crate::ops::metrics::{SharedMetrics, UnsubscribeResult};

/// The endpoint's state.
pub(super) struct Unsubscribe {
    pub(super) links: Links,
    pub(super) inbox: Inbox,
    pub(super) metrics: SharedMetrics,
}

/// `GET /u/{token}`: the confirmation page.
pub(super) async fn page(State(u): State<Arc<Unsubscribe>>, Path(token): Path<String>) -> Response {
    match u.read(&token) {
        Ok(link) => {
            u.count(UnsubscribeResult::Page);
            let body = format!(
                "<h1>Unsubscribe</h1>\
                 <p>Stop sending <b>{scope}</b> emails to <b>{address}</b>?</p>\
                 <form method=\"post\"><input type=\"hidden\" name=\"List-Unsubscribe\" value=\"One-Click\">\
                 <button type=\"submit\" id=\"unsubscribe\">Unsubscribe</button></form>",
                scope = escape(&link.scope),
                address = escape(&masked(&link.address)),
            );
            html(StatusCode::OK, "Unsubscribe", &body)
        }
        Err(refusal) => u.refuse(&refusal),
    }
}

/// `POST /u/{token}`: the one-click unsubscribe.
pub(super) async fn post(
    State(u): State<Arc<Unsubscribe>>,
    Path(token): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let link = match u.read(&token) {
        Ok(link) => link,
        Err(refusal) => return u.refuse(&refusal),
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !is_one_click(content_type, &body) {
        return u.refuse(&Refusal::Malformed(
            "the body must be List-Unsubscribe=One-Click (RFC 8058)",
        ));
    }
    match record(&u.inbox, &link, "one-click").await {
        Ok(added) => {
            let result = if added {
                UnsubscribeResult::Unsubscribed
            } else {
                UnsubscribeResult::Duplicate
            };
            u.count(result);
            tracing::info!(scope = %link.scope, key = %link.key, result = result.as_str(), "one-click unsubscribe");
            let body = format!(
                "<h1>Unsubscribed</h1><p>You will get no more <b>{}</b> emails at <b>{}</b>.</p>",
                escape(&link.scope),
                escape(&masked(&link.address)),
            );
            html(StatusCode::OK, "Unsubscribed", &body)
        }
        Err(error) => {
            u.count(UnsubscribeResult::Unavailable);
            tracing::warn!(error = %error.cause(), "one-click unsubscribe not recorded: database");
            html(
                StatusCode::SERVICE_UNAVAILABLE,
                "Try again",
                "<h1>Please try again later</h1>",
            )
        }
    }
}

/// Records what the verified `link` asks, from `source` (`one-click`, `mailto`):
/// true if it suppressed the address, false if it already was for that scope.
pub(crate) async fn record(inbox: &Inbox, link: &Link, source: &str) -> Result<bool, DbError> {
    let issued = jiff::Timestamp::from_second(link.issued)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| link.issued.to_string());
    let evidence = format!("link signed by key {} at {issued}", link.key_id);
    let request = Unsubscribing {
        address: &link.address,
        scope: &link.scope,
        key: &link.key,
        message_id: &link.message_id,
        source,
        evidence: &evidence,
    };
    inbox.unsubscribe(&request).await
}

/// The token in an email sent to the `mailto:` form's address: the last word of its
/// `Subject` (a client may put `Re:` or the like before it).
pub(crate) fn token_in_subject(message: &[u8]) -> Option<String> {
    // Read as the reports are (`mail-parser`: folding, encoded words).
    let parsed = mail_parser::MessageParser::new().parse_headers(message)?;
    let word = parsed.subject()?.split_whitespace().last()?;
    Some(word.to_owned())
}

impl Unsubscribe {
    fn read(&self, token: &str) -> Result<Link, Refusal> {
        self.links.read(token, jiff::Timestamp::now())
    }

    fn count(&self, result: UnsubscribeResult) {
        self.metrics.unsubscribe_requests.inc(result);
    }

    /// Counts and answers a refusal (its reason in the log and the page; never the
    /// token).
    fn refuse(&self, refusal: &Refusal) -> Response {
        let (status, result) = match refusal {
            Refusal::Malformed(_) => (StatusCode::BAD_REQUEST, UnsubscribeResult::Malformed),
            Refusal::Forbidden(_) => (StatusCode::FORBIDDEN, UnsubscribeResult::Forbidden),
        };
        self.count(result);
        tracing::warn!(
            status = status.as_u16(),
            reason = refusal.reason(),
            "unsubscribe refused"
        );
        let body = format!(
            "<h1>This link does not work</h1><p>{}.</p>",
            escape(refusal.reason())
        );
        html(status, "Link not valid", &body)
    }
}

/// Whether `body` carries RFC 8058's `List-Unsubscribe=One-Click`, form-urlencoded
/// (what Gmail, Yahoo and the page's button send) or as a multipart/form-data field.
fn is_one_click(content_type: &str, body: &[u8]) -> bool {
    let (key, value) = ONE_CLICK.split_once('=').expect("the constant has one '='");
    if content_type
        .to_ascii_lowercase()
        .starts_with("multipart/form-data")
    {
        let text = String::from_utf8_lossy(body);
        let name = format!("name=\"{key}\"");
        return text.split("\r\n--").any(|part| {
            part.split_once("\r\n\r\n")
                .is_some_and(|(head, content)| head.contains(&name) && content.trim_end() == value)
        });
    }
    url::form_urlencoded::parse(body).any(|(k, v)| k == key && v == value)
}

/// `ann@example.com` as `a…@example.com`: the page says whose subscription it is
/// without spelling the address out to whoever holds the link.
fn masked(address: &str) -> String {
    match address.split_once('@') {
        Some((local, domain)) => {
            let first: String = local.chars().take(1).collect();
            format!("{first}…@{domain}")
        }
        None => "…".into(),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// A small page: no script, no outside resource, never framed, never cached, no
/// referrer sent from it.
fn html(status: StatusCode, title: &str, body: &str) -> Response {
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;max-width:32em;margin:3em auto;padding:0 1em}}\
         button{{font-size:1.1em;padding:.5em 1.5em}}</style></head><body>{body}</body></html>"
    );
    let mut response = (status, page).into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_click_body_is_read_in_both_encodings_and_nothing_else() {
        let form = "application/x-www-form-urlencoded";
        assert!(is_one_click(form, b"List-Unsubscribe=One-Click"));
        assert!(is_one_click("", b"List-Unsubscribe=One-Click"));
        assert!(!is_one_click(form, b""));
        assert!(!is_one_click(form, b"List-Unsubscribe=Other"));
        assert!(!is_one_click(form, b"unsubscribe=One-Click"));
        let multipart = "multipart/form-data; boundary=XyZ";
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"List-Unsubscribe\"\r\n\r\nOne-Click\r\n--XyZ--\r\n";
        assert!(is_one_click(multipart, body));
        let other =
            b"--XyZ\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\nOne-Click\r\n--XyZ--\r\n";
        assert!(!is_one_click(multipart, other));
    }

    #[test]
    fn the_mailto_token_is_the_subjects_last_word() {
        let message =
            b"From: ann@example.com\r\nSubject: Re:\r\n k1.AAAA.BBBB\r\n\r\nbody k1.x.y\r\n";
        assert_eq!(token_in_subject(message).as_deref(), Some("k1.AAAA.BBBB"));
        let bare = b"subject: k1.A.B\n\n";
        assert_eq!(token_in_subject(bare).as_deref(), Some("k1.A.B"));
        assert_eq!(token_in_subject(b"From: a@b\r\n\r\nSubject: k1.A.B"), None);
        assert_eq!(token_in_subject(b"Subject:\r\n\r\n"), None);
    }

    #[test]
    fn the_page_masks_the_address_and_escapes_what_it_shows() {
        assert_eq!(masked("ann@example.com"), "a…@example.com");
        assert_eq!(masked("nobody"), "…");
        assert_eq!(escape("<b>\"x\"&'"), "&lt;b&gt;&quot;x&quot;&amp;&#39;");
    }
}
