//! What every console request passes before its handler, and what every answer
//! carries.
//!
//! - Without a credential (the console open on loopback), a request is served only
//!   if its `Host` names this machine as a literal, `127.x.y.z`, `[::1]` or
//!   `localhost`, with the console's port: a page whose name an attacker re-resolved
//!   to 127.0.0.1 (DNS rebinding) sends its own name and is answered 421, before
//!   any handler reads or changes anything. With a credential the browser never
//!   sends another site's name with the console's cookie, so `Host` is not checked.
//! - A POST whose `Origin` is not the console's own (`http(s)://` and its `Host`, or
//!   `X-Forwarded-Host` from a proxy in front) or whose `Sec-Fetch-Site` is neither
//!   `same-origin` nor `none` is refused (403): another site's form, even aimed at
//!   127.0.0.1. A client that sends neither (curl) passes; it has no cookie to ride.
//! - Every answer, refusals included: `X-Frame-Options: DENY`, a CSP with
//!   `frame-ancestors 'none'` (and only the console's own scripts),
//!   `Cache-Control: no-store`, `X-Content-Type-Options: nosniff`,
//!   `Referrer-Policy: same-origin` (job keys are in the URLs; not `no-referrer`,
//!   under which a browser sends `Origin: null` with the console's own forms).

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{page, Console};

/// The console's Content-Security-Policy: its own script (htmx) only, inline styles
/// (the frame's `<style>`, htmx's indicator), inline SVG; never framed.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'; object-src 'none'";

/// The middleware: the checks above, then the handler, then the headers.
pub(super) async fn guard(
    State(console): State<Arc<Console>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let refusal = if console.auth.is_open() && !is_loopback_host(headers, console.port) {
        tracing::warn!("console: a request for another host than this machine was refused");
        Some((
            StatusCode::MISDIRECTED_REQUEST,
            "This console answers to 127.0.0.1, [::1] or localhost with its port only \
             (it has no token): open it at that address.",
        ))
    } else if request.method() == Method::POST && !same_origin(headers) {
        tracing::warn!("console: a POST from another site was refused");
        Some((
            StatusCode::FORBIDDEN,
            "This form was sent from another site.",
        ))
    } else {
        None
    };
    let mut response = match refusal {
        Some((status, why)) => (status, page::notice("Refused", why)).into_response(),
        None => next.run(request).await,
    };
    let answer = response.headers_mut();
    for (name, value) in [
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        answer.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// True if `Host` is a loopback literal or `localhost`, with `port` (or none when
/// `port` is 80). Only one `Host`, and no other authority in the request line
/// (hyper puts an absolute-form target's authority in `Host`'s place).
fn is_loopback_host(headers: &HeaderMap, port: u16) -> bool {
    let mut hosts = headers.get_all(header::HOST).iter();
    let (Some(host), None) = (hosts.next(), hosts.next()) else {
        return false;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let (name, given_port) = split_port(host);
    let port_ok = match given_port {
        Some(text) => text.parse::<u16>().ok() == Some(port),
        None => port == 80,
    };
    let name_ok = name.eq_ignore_ascii_case("localhost")
        || name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .unwrap_or(name)
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback());
    port_ok && name_ok
}

/// `host:port` into its name and port text (`[v6]:port` kept bracketed).
fn split_port(host: &str) -> (&str, Option<&str>) {
    match host.rfind(':') {
        Some(at)
            if !host[at..].contains(']')
                && (host.starts_with('[') || !host[..at].contains(':')) =>
        {
            (&host[..at], Some(&host[at + 1..]))
        }
        _ => (host, None),
    }
}

/// False if the request says it came from another site: an `Origin` other than
/// this `Host`'s (or a proxy's `X-Forwarded-Host`), or a `Sec-Fetch-Site` other than
/// `same-origin` or `none`.
fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    if let Some(site) = headers.get("sec-fetch-site") {
        if !matches!(site.to_str(), Ok("same-origin" | "none")) {
            return false;
        }
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let Some(authority) = origin.to_str().ok().and_then(|o| {
        o.strip_prefix("http://")
            .or_else(|| o.strip_prefix("https://"))
    }) else {
        return false;
    };
    let forwarded = text("x-forwarded-host").map(|h| h.split(',').next().unwrap_or("").trim());
    [text("host"), forwarded]
        .into_iter()
        .flatten()
        .any(|host| !host.is_empty() && host.eq_ignore_ascii_case(authority))
}

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
    fn only_loopback_literals_and_localhost_with_the_port_are_this_machine() {
        let host = |h: &str| headers(&[("host", h)]);
        for ok in [
            "127.0.0.1:9092",
            "127.1.2.3:9092",
            "localhost:9092",
            "LocalHost:9092",
            "[::1]:9092",
            "[::ffff:127.0.0.1]:9092",
        ] {
            assert!(is_loopback_host(&host(ok), 9092), "{ok}");
        }
        for refused in [
            "rebind.attacker.example:9092",
            "rebind.attacker.example",
            "127.0.0.1:9093",
            "127.0.0.1",
            "localhost",
            "0.0.0.0:9092",
            "localhost.attacker.example:9092",
            "127.0.0.1.nip.io:9092",
            "[::1]",
            "::1:9092",
            "10.0.0.1:9092",
            "",
        ] {
            assert!(!is_loopback_host(&host(refused), 9092), "{refused}");
        }
        assert!(is_loopback_host(&host("localhost"), 80));
        assert!(!is_loopback_host(&HeaderMap::new(), 9092), "no Host");
        let two = headers(&[("host", "127.0.0.1:9092"), ("host", "evil:9092")]);
        assert!(!is_loopback_host(&two, 9092), "two Hosts");
    }

    #[test]
    fn a_post_from_another_site_is_told_apart() {
        let h = |pairs: &[(&'static str, &str)]| same_origin(&headers(pairs));
        assert!(h(&[("host", "127.0.0.1:9092")]), "curl: neither header");
        assert!(h(&[
            ("host", "127.0.0.1:9092"),
            ("origin", "http://127.0.0.1:9092")
        ]));
        assert!(h(&[
            ("host", "c.example"),
            ("origin", "https://c.example"),
            ("sec-fetch-site", "same-origin")
        ]));
        assert!(h(&[
            ("host", "127.0.0.1:9092"),
            ("x-forwarded-host", "console.example"),
            ("origin", "https://console.example")
        ]));
        assert!(!h(&[
            ("host", "127.0.0.1:9092"),
            ("origin", "http://attacker.example")
        ]));
        assert!(!h(&[("host", "127.0.0.1:9092"), ("origin", "null")]));
        assert!(!h(&[
            ("host", "127.0.0.1:9092"),
            ("origin", "http://127.0.0.1:9093")
        ]));
        assert!(!h(&[
            ("host", "127.0.0.1:9092"),
            ("sec-fetch-site", "cross-site")
        ]));
        assert!(!h(&[
            ("host", "127.0.0.1:9092"),
            ("sec-fetch-site", "same-site")
        ]));
    }
}
