//! The console tried as an attacker would (issue 45, item 3), against a real broker,
//! PostgreSQL and SMTP sink: a web page that rebinds its name to 127.0.0.1, a weak
//! token, a brute-force of the sign-in, a stolen or signed-out cookie, framing and
//! caching, a huge page number. Each test failed on the console as it was before.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use postie::testing::console::{self, Credentials};
use reqwest::{Client, StatusCode};
use support::{run_postie, TestEnv};
use tokio_util::sync::CancellationToken;

/// Tokens as `postie console --new-token` makes them (32 random bytes, base64url).
const OPERATOR: &str = "q3Zk7Vd0r8QwL1mXp5sJt2nYb6cHf9gEa4uRiKoN0Ws";
const VIEWER: &str = "Zx8Lm2Qp7Rt4Vw1Ys6Bn3Cd9Fg5Hj0Kl8Mn2Pq4Rs6T";

fn http() -> Client {
    Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The same client, connecting from `from` (another loopback address: another
/// client as the console sees it).
fn http_from(from: [u8; 4]) -> Client {
    Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .local_address(std::net::IpAddr::from(from))
        .build()
        .unwrap()
}

async fn start(
    env: &TestEnv,
    credentials: Credentials,
    stop: &CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    console::start(env.settings(), listen, credentials, stop.clone()).await
}

fn form(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// The CSRF token in a page's first action form.
fn csrf(page: &str) -> String {
    let start = page.find("name=\"csrf\" value=\"").expect("an action form") + 19;
    page[start..start + 64].to_owned()
}

async fn suppressed(env: &TestEnv, address: &str) -> i64 {
    env.db()
        .await
        .query_one(
            "SELECT count(*) FROM postie_suppression WHERE address = $1",
            &[&address],
        )
        .await
        .unwrap()
        .get(0)
}

/// The response's headers that forbid framing, caching and sniffing, or what is
/// missing.
fn guarded(response: &reqwest::Response) -> Result<(), String> {
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase()
    };
    let checks = [
        ("x-frame-options", header("x-frame-options") == "deny"),
        (
            "content-security-policy frame-ancestors 'none'",
            header("content-security-policy").contains("frame-ancestors 'none'"),
        ),
        (
            "cache-control no-store",
            header("cache-control").contains("no-store"),
        ),
        (
            "x-content-type-options nosniff",
            header("x-content-type-options") == "nosniff",
        ),
    ];
    let missing: Vec<_> = checks
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} {}: lacks {missing:?}",
            response.url(),
            response.status()
        ))
    }
}

/// Without a token on loopback: a page whose name re-resolved to 127.0.0.1 (DNS
/// rebinding) sends `Host: rebind.attacker.example`; it must read nothing and
/// change nothing. A cross-site POST with the right Host is refused too. Every
/// answer forbids framing and caching; a huge page number is a clear 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_only_a_loopback_host_is_served() {
    let env = TestEnv::new("consatk-open").await;
    let stop = CancellationToken::new();
    let bound = start(&env, Credentials::default(), &stop).await.unwrap();
    let port = bound.port();
    let base = format!("http://{bound}");
    let http = http();

    // The operator's own browser: 127.0.0.1, localhost and [::1] with the port.
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ] {
        let response = http
            .get(format!("{base}/suppression"))
            .header("host", &host)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "Host: {host}");
    }
    let page = http
        .get(format!("{base}/suppression"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let token = csrf(&page);

    // The rebinding page: its own name, with and without the port; another port.
    for host in [
        format!("rebind.attacker.example:{port}"),
        "rebind.attacker.example".to_owned(),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
        format!("0.0.0.0:{port}"),
    ] {
        let response = http
            .get(format!("{base}/suppression"))
            .header("host", &host)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let body = response.text().await.unwrap();
        assert_eq!(
            status,
            StatusCode::MISDIRECTED_REQUEST,
            "GET with Host: {host}: {body}"
        );
        assert!(
            !body.contains("name=\"csrf\""),
            "a CSRF token leaked: {body}"
        );
    }
    // It POSTs with a CSRF token (had it read one): refused, nothing changed.
    let response = http
        .post(format!("{base}/suppression/add"))
        .header("host", format!("rebind.attacker.example:{port}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[
            ("csrf", &token),
            ("address", "ceo@customer.example"),
            ("reason", "manual"),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(suppressed(&env, "ceo@customer.example").await, 0);

    // Another site's page posting to the right Host (a form aimed at 127.0.0.1):
    // its Origin or its Sec-Fetch-Site gives it away.
    for (name, value) in [
        ("origin", "http://rebind.attacker.example".to_owned()),
        ("origin", "null".to_owned()),
        (
            "origin",
            format!("http://localhost:{}", port.wrapping_add(1)),
        ),
        ("sec-fetch-site", "cross-site".to_owned()),
        ("sec-fetch-site", "same-site".to_owned()),
    ] {
        let response = http
            .post(format!("{base}/suppression/add"))
            .header(name, &value)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&[
                ("csrf", &token),
                ("address", "cfo@customer.example"),
                ("reason", "manual"),
            ]))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{name}: {value}");
        guarded(&response).unwrap();
    }
    assert_eq!(suppressed(&env, "cfo@customer.example").await, 0);
    // The console's own form (same origin) still acts.
    let response = http
        .post(format!("{base}/suppression/add"))
        .header("origin", &base)
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[
            ("csrf", &token),
            ("address", "own@customer.example"),
            ("reason", "manual"),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(suppressed(&env, "own@customer.example").await, 1);

    // Every answer forbids framing and caching: pages, the script, a refusal, a 404.
    for (path, host) in [
        ("/", format!("127.0.0.1:{port}")),
        ("/pending", format!("127.0.0.1:{port}")),
        ("/assets/htmx.min.js", format!("127.0.0.1:{port}")),
        ("/nowhere", format!("127.0.0.1:{port}")),
        ("/", format!("rebind.attacker.example:{port}")),
    ] {
        let response = http
            .get(format!("{base}{path}"))
            .header("host", host)
            .send()
            .await
            .unwrap();
        guarded(&response).unwrap();
    }

    // A huge page number: a clear 400, never a panic or a huge OFFSET.
    for page in ["9223372036854775807", "4294967295", "-1", "x"] {
        let response = http
            .get(format!("{base}/pending?page={page}"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("page={page}: no answer: {e}"));
        let status = response.status();
        let body = response.text().await.unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "page={page}: {body}");
        assert!(body.contains("page"), "page={page}: {body}");
    }
    let response = http
        .get(format!("{base}/pending?page=3"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    stop.cancel();
}

/// A token under 128 bits is refused at start-up, for either role; a generated one
/// is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weak_token_is_refused_at_start_up() {
    let env = TestEnv::new("consatk-weak").await;
    let stop = CancellationToken::new();
    for (operator, viewer) in [
        (Some("a"), None),
        (Some("correct-horse"), None),
        (Some(OPERATOR), Some("0123456789abcdef0123456789abcde")),
        (
            Some("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
            None,
        ),
    ] {
        let credentials = Credentials::new(operator.map(Into::into), viewer.map(Into::into));
        let refused = start(&env, credentials, &stop).await;
        let error = refused.expect_err(&format!("{operator:?} {viewer:?} accepted"));
        let text = error.to_string();
        assert!(text.contains("128 bits"), "{text}");
        for secret in [operator, viewer].into_iter().flatten() {
            assert!(
                secret.len() < 2 || !text.contains(secret),
                "the token is in the error: {text}"
            );
        }
    }
    let strong = Credentials::new(Some(OPERATOR.into()), Some(VIEWER.into()));
    start(&env, strong, &stop).await.unwrap();
    stop.cancel();
}

/// As a command: one line on stderr naming the variable; `--new-token` prints a new
/// random token of 43 base64url characters (256 bits).
#[test]
fn a_weak_token_stops_the_command_with_one_line_and_new_token_makes_a_strong_one() {
    // Nothing listens at these: a console that went further would stop at once,
    // without touching the shared services.
    let nowhere = [
        (
            "POSTIE__DATABASE__URL",
            "postgres://postgres@127.0.0.1:1/none",
        ),
        ("POSTIE__DATABASE__CONNECT_TIMEOUT", "1s"),
        ("POSTIE__AMQP__URL", "amqp://guest:guest@127.0.0.1:1/%2f"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let mut weak = nowhere.to_vec();
    weak.push(("POSTIE_CONSOLE_TOKEN".to_owned(), "a".to_owned()));
    let run = run_postie(&["console", "--listen", "127.0.0.1:0"], &weak);
    assert_ne!(run.code, Some(0), "{}", run.stdout);
    let lines: Vec<_> = run
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "one line: {}", run.stderr);
    assert!(
        lines[0].contains("POSTIE_CONSOLE_TOKEN") && lines[0].contains("128 bits"),
        "{}",
        lines[0]
    );

    let made = run_postie(&["console", "--new-token"], &nowhere);
    assert_eq!(made.code, Some(0), "{}", made.stderr);
    let token = made.stdout.trim().to_owned();
    assert!(
        token.len() >= 43
            && token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "{token:?}"
    );
    let again = run_postie(&["console", "--new-token"], &nowhere);
    assert_ne!(again.stdout.trim(), token, "a token is random");
}

/// Guessing the token: after a few failures a client is made to wait (429), the
/// right token included, by the sign-in form and by a bearer token alike; another
/// client is not held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_sign_ins_are_throttled_per_client() {
    let env = TestEnv::new("consatk-brute").await;
    let stop = CancellationToken::new();
    let credentials = Credentials::new(Some(OPERATOR.into()), None);
    let bound = start(&env, credentials, &stop).await.unwrap();
    let base = format!("http://{bound}");
    let attacker = http();
    let mut statuses = Vec::new();
    for guess in 0..20 {
        let response = attacker
            .post(format!("{base}/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&[("token", &format!("guess-{guess}"))]))
            .send()
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
    }
    let refused = statuses.iter().filter(|s| **s == 401).count();
    let throttled = statuses.iter().filter(|s| **s == 429).count();
    assert!(
        refused <= 6 && throttled >= 14,
        "20 guesses in a row: {statuses:?}"
    );
    // While throttled, the right token does not get in either (no oracle), and a
    // bearer token is a sign-in too.
    let right = attacker
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("token", OPERATOR)]))
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(right.headers().contains_key("retry-after"));
    let bearer = attacker
        .get(format!("{base}/"))
        .bearer_auth("another-guess")
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), StatusCode::TOO_MANY_REQUESTS);
    // Another client (127.0.0.2) signs in at once.
    let operator = http_from([127, 0, 0, 2]);
    let response = operator
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("token", OPERATOR)]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    stop.cancel();
}

fn cookie_of(response: &reqwest::Response) -> String {
    response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned()
}

async fn sign_in(http: &Client, base: &str, token: &str) -> String {
    let response = http
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("token", token)]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    cookie_of(&response)
}

async fn with_cookie(http: &Client, url: &str, cookie: &str) -> StatusCode {
    http.get(url)
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .status()
}

/// The cookie is a signed, expiring session, not the token: tampering with it, a
/// sign-out and its expiry each end it; another console process does not take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cookie_is_a_session_that_dies_at_sign_out_and_at_expiry() {
    let env =
        TestEnv::with_settings("consatk-cookie", &[("POSTIE__CONSOLE__SESSION_TTL", "3s")]).await;
    let stop = CancellationToken::new();
    let credentials = || Credentials::new(Some(OPERATOR.into()), Some(VIEWER.into()));
    let bound = start(&env, credentials(), &stop).await.unwrap();
    let other = start(&env, credentials(), &stop).await.unwrap();
    let base = format!("http://{bound}");
    let http = http();

    let cookie = sign_in(&http, &base, OPERATOR).await;
    let value = cookie.split_once('=').unwrap().1.to_owned();
    assert!(
        !value.contains(OPERATOR) && !value.contains(&OPERATOR[..16]),
        "the cookie carries the token: {cookie}"
    );
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &cookie).await,
        StatusCode::OK
    );
    // The token itself is no cookie.
    let raw = format!("postie_console={OPERATOR}");
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &raw).await,
        StatusCode::UNAUTHORIZED
    );
    // A viewer's cookie edited to say operator, or any byte changed: refused.
    let viewer = sign_in(&http, &base, VIEWER).await;
    let forged = viewer.replace("viewer", "operator");
    assert_ne!(
        forged, viewer,
        "the role is readable in the cookie: {viewer}"
    );
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &forged).await,
        StatusCode::UNAUTHORIZED
    );
    // One character of the signature changed (not the last: its low bits are padding).
    let mut flipped = cookie.clone().into_bytes();
    let at = flipped.len() - 5;
    flipped[at] = if flipped[at] == b'A' { b'B' } else { b'A' };
    let flipped = String::from_utf8(flipped).unwrap();
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &flipped).await,
        StatusCode::UNAUTHORIZED
    );
    // Another console process (its own key) does not take this one's session.
    assert_eq!(
        with_cookie(&http, &format!("http://{other}/"), &cookie).await,
        StatusCode::UNAUTHORIZED
    );

    // Sign-out ends the session on the server: the same cookie, replayed, is refused.
    let out = http
        .post(format!("{base}/logout"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &cookie).await,
        StatusCode::UNAUTHORIZED,
        "a signed-out cookie still works"
    );

    // Expiry: a new session works, then not past console.session_ttl (3 s).
    let fresh = sign_in(&http, &base, OPERATOR).await;
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &fresh).await,
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        with_cookie(&http, &format!("{base}/"), &fresh).await,
        StatusCode::UNAUTHORIZED,
        "an expired session still works"
    );
    stop.cancel();
}
