//! The operator console over HTTP against a real broker, PostgreSQL and SMTP sink:
//! every page shows what a person needs, every action does what it says in RabbitMQ
//! and PostgreSQL, and is refused without credentials, without the CSRF token, or to
//! the read-only credential; off loopback without credentials it does not start.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use postie::testing::console::{self, Credentials};
use reqwest::{Client, StatusCode};
use serde_json::json;
use support::{delayed_properties, eventually, free_port, job, run_postie, TestEnv};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);
/// Tokens as `postie console --new-token` makes them.
const OPERATOR: &str = "Kd2mX9qL4vR7tW1zB8nC5pF3hJ6sG0yQaE4uT7iO2rU";
const VIEWER: &str = "Vb7Nc1Xz4Lk8Jh2Gf5Ds9Ap3Qw6Er0Ty7Ui1Op4As8D";

struct Site {
    base: String,
    http: Client,
}

impl Site {
    async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, String) {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        (response.status(), response.text().await.unwrap())
    }

    /// A page as the operator sees it, which must answer 200.
    async fn page(&self, path: &str) -> String {
        let (status, body) = self.get(path, Some(OPERATOR)).await;
        assert_eq!(status, StatusCode::OK, "GET {path}: {body}");
        body
    }

    async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        form: &[(&str, &str)],
    ) -> (StatusCode, String) {
        let body: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        (response.status(), response.text().await.unwrap())
    }
}

impl Site {
    /// An action as the operator, with `csrf` and `fields`, which must answer 200:
    /// the result page.
    async fn act(&self, path: &str, csrf: &str, fields: &[(&str, &str)]) -> String {
        let mut form = vec![("csrf", csrf)];
        form.extend_from_slice(fields);
        let (status, body) = self.post(path, Some(OPERATOR), &form).await;
        assert_eq!(status, StatusCode::OK, "POST {path} {fields:?}: {body}");
        body
    }
}

/// The CSRF token in a page's first action form.
fn csrf(page: &str) -> String {
    let start = page.find("name=\"csrf\" value=\"").expect("an action form") + 19;
    page[start..start + 64].to_owned()
}

async fn start(env: &TestEnv, stop: &CancellationToken) -> Site {
    let credentials = Credentials::new(Some(OPERATOR.into()), Some(VIEWER.into()));
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let bound = console::start(env.settings(), listen, credentials, stop.clone())
        .await
        .unwrap();
    Site {
        base: format!("http://{bound}"),
        http: Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_and_action_over_http_with_its_guards() {
    let env = TestEnv::new("console").await;
    // 5.7.1, a policy refusal that does not suppress the address: its job dies, and
    // once the fault is lifted a replay sends it.
    env.sink
        .set_faults(json!([{"stage": "rcpt", "rcpt_contains": "nobody", "action": {"reply": "550 5.7.1 rejected by policy"}}]))
        .await;
    let serving = env.serve(env.settings());
    env.publish(&job("c-sent", "alice@example.com")).await;
    env.publish(&job("c-nobody", "nobody@example.com")).await;
    let now = chrono::Utc::now().timestamp_millis();
    for key in ["c-later-1", "c-later-2", "d-later"] {
        let mut body = job(key, "bob@example.com");
        body["type"] = json!("reminder");
        env.publish_raw(
            body.to_string().as_bytes(),
            delayed_properties(300_000, now),
        )
        .await;
    }
    env.wait_for_status("c-sent", "sent", WAIT).await;
    env.wait_for_status("c-nobody", "dead", WAIT).await;
    for key in ["c-later-1", "c-later-2", "d-later"] {
        env.wait_for_status(key, "scheduled", WAIT).await;
    }
    let dead = env.topology.dead_queue().to_owned();
    eventually("the dead letter", WAIT, || async {
        (env.depth(&dead).await == 1).then_some(())
    })
    .await;

    let stop = CancellationToken::new();
    let site = start(&env, &stop).await;

    // No credentials: 401 with the sign-in form; a wrong token too.
    let (status, body) = site.get("/", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body.contains("Sign in"), "{body}");
    assert_eq!(
        site.get("/pending", Some("wrong")).await.0,
        StatusCode::UNAUTHORIZED
    );

    // An instance's open breaker, as its prober writes it (sql/0018).
    let (status, overview) = site.get("/", Some(VIEWER)).await;
    assert!(overview.contains("No breaker has opened"), "{overview}");
    env.db()
        .await
        .execute(
            "INSERT INTO postie_breakers (owner, provider, open) VALUES ('host-1', 'smtp', true)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);

    // Overview: rows by status, the queues, the chart, the breakers; the viewer sees
    // it too.
    let (status, overview) = site.get("/", Some(VIEWER)).await;
    assert_eq!(status, StatusCode::OK, "{overview}");
    for text in [
        "Inbox rows by status",
        "scheduled",
        &dead,
        "<svg",
        "1 sent in the last hour",
        "<td>smtp</td>",
        "<td>1</td><td>none</td>",
        "<td>smtp</td><td>host-1</td><td><strong>open</strong></td>",
        "read-only",
    ] {
        assert!(
            overview.contains(text),
            "overview lacks {text:?}: {overview}"
        );
    }
    assert!(
        !overview.contains("name=\"csrf\""),
        "a read-only page offers actions"
    );
    assert!(site
        .page("/overview/live")
        .await
        .contains("hx-trigger=\"every 5s\""));
    let script = site.get("/assets/htmx.min.js", None).await;
    assert!(script.1.starts_with("var htmx="), "htmx is served");

    // A job by key: its row, its event, its Message-ID.
    let sent = site.page("/job?key=c-sent").await;
    assert!(
        sent.contains("<strong id=\"status\">sent</strong>"),
        "{sent}"
    );
    assert!(sent.contains("message_id") && sent.contains("@"), "{sent}");
    let nobody = site.page("/job?key=c-nobody").await;
    assert!(
        nobody.contains("rejected by policy"),
        "its last error and dead letter: {nobody}"
    );
    assert!(nobody.contains("its body and headers"), "{nobody}");

    // Pending: filtered by type and key prefix.
    let pending = site.page("/pending?type=reminder").await;
    assert!(
        pending.contains("3 pending") && pending.contains("c-later-2"),
        "{pending}"
    );
    let filtered = site.page("/pending?prefix=c-later").await;
    assert!(
        filtered.contains("2 pending") && !filtered.contains("d-later"),
        "{filtered}"
    );

    // Dead letters: grouped, and one letter's body and headers. The job page just
    // looked at the letter and gave it back with a requeueing nack, which the broker
    // may not have applied yet (the queue's depth counts ready letters): the page
    // shows it again within moments, and a letter lost would never show.
    let letters = eventually("the dead letter listed again", WAIT, || async {
        let letters = site.page("/dead").await;
        letters.contains("1 dead letter(s)").then_some(letters)
    })
    .await;
    assert!(letters.contains("c-nobody"), "{letters}");
    let letter = site.page("/dead/letter?key=c-nobody").await;
    assert!(
        letter.contains("nobody@example.com") && letter.contains("postie-dead-reason"),
        "{letter}"
    );

    // Actions are refused without credentials, without or with a wrong CSRF token,
    // and to the viewer even with the operator's token.
    let token = csrf(&site.page("/pending").await);
    let wrong = "0".repeat(64);
    let refused = [
        (
            None,
            vec![("csrf", token.as_str()), ("key", "c-later-1")],
            StatusCode::UNAUTHORIZED,
        ),
        (
            Some(OPERATOR),
            vec![("key", "c-later-1")],
            StatusCode::FORBIDDEN,
        ),
        (
            Some(OPERATOR),
            vec![("csrf", wrong.as_str()), ("key", "c-later-1")],
            StatusCode::FORBIDDEN,
        ),
        (
            Some(VIEWER),
            vec![("csrf", token.as_str()), ("key", "c-later-1")],
            StatusCode::FORBIDDEN,
        ),
    ];
    for (who, form, expected) in refused {
        assert_eq!(
            site.post("/job/cancel", who, &form).await.0,
            expected,
            "{who:?} {form:?}"
        );
    }
    assert_eq!(
        env.inbox_row("c-later-1").await.unwrap().status,
        "scheduled"
    );

    // Cancel one.
    site.act("/job/cancel", &token, &[("key", "c-later-1")])
        .await;
    assert_eq!(
        env.inbox_row("c-later-1").await.unwrap().status,
        "cancelled"
    );

    // Cancel all matching, after a confirm step with the count.
    let confirm = site.page("/pending/cancel?prefix=c-later").await;
    assert!(confirm.contains("1 pending job(s) match"), "{confirm}");
    let body = site
        .act(
            "/pending/cancel",
            &token,
            &[("prefix", "c-later"), ("count", "1")],
        )
        .await;
    assert!(body.contains("Cancelled 1 pending job(s)"), "{body}");
    assert_eq!(
        env.inbox_row("c-later-2").await.unwrap().status,
        "cancelled"
    );
    assert_eq!(
        env.inbox_row("d-later").await.unwrap().status,
        "scheduled",
        "outside the filter"
    );

    // Reschedule: published again under the next revision, due in 1 s, and sent.
    assert!(site.page("/job?key=d-later").await.contains("Reschedule"));
    let body = site
        .act(
            "/job/reschedule",
            &token,
            &[("key", "d-later"), ("delay", "1s")],
        )
        .await;
    assert!(body.contains("published again as revision 1"), "{body}");
    env.wait_for_status("d-later", "sent", WAIT).await;

    // Replay, after a confirm step with the count: the fault lifted, the job is sent.
    env.sink.set_faults(json!([])).await;
    let confirm = site.page("/dead/replay?reason=policy").await;
    assert!(confirm.contains("1 dead letter(s) match"), "{confirm}");
    let body = site
        .act(
            "/dead/replay",
            &token,
            &[("reason", "policy"), ("count", "1")],
        )
        .await;
    assert!(body.contains("Replayed 1 dead letter(s)"), "{body}");
    env.wait_for_status("c-nobody", "sent", WAIT).await;
    assert_eq!(env.depth(&dead).await, 0);

    // Suppression: add, find, remove.
    site.act(
        "/suppression/add",
        &token,
        &[
            ("address", "Carol@Example.com"),
            ("reason", "manual"),
            ("note", "asked by phone"),
        ],
    )
    .await;
    let list = site.page("/suppression?address=carol@example.com").await;
    assert!(
        list.contains("carol@example.com")
            && list.contains("console:operator")
            && list.contains("asked by phone"),
        "{list}"
    );
    let body = site
        .act(
            "/suppression/remove",
            &token,
            &[("address", "carol@example.com")],
        )
        .await;
    assert!(body.contains("Removed 1 row(s)"), "{body}");
    assert!(!site
        .page("/suppression?address=carol@example.com")
        .await
        .contains("asked by phone"));

    // Sign-in: a cookie that holds a session (tests/console_attacks.rs tries it); an
    // unknown token is refused.
    assert_eq!(
        site.post("/login", None, &[("token", "nope")]).await.0,
        StatusCode::UNAUTHORIZED
    );
    let response = site
        .http
        .post(format!("{}/login", site.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={OPERATOR}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let with_cookie = site
        .http
        .get(format!("{}/", site.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(with_cookie.status(), StatusCode::OK);
    assert!(
        !response.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Secure"),
        "plain HTTP: a Secure cookie would not be kept"
    );

    // Behind a proxy that speaks HTTPS, the cookie is Secure.
    let proxied = site
        .http
        .post(format!("{}/login", site.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("x-forwarded-proto", "https")
        .body(format!("token={OPERATOR}"))
        .send()
        .await
        .unwrap();
    let set = proxied.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(set.contains("; Secure"), "{set}");

    // Sign out: the session ends and the cookie is cleared; the page offers the button.
    assert!(with_cookie.text().await.unwrap().contains("Sign out"));
    let out = site
        .http
        .post(format!("{}/logout", site.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    assert_eq!(out.headers()["location"], "/login");
    let cleared = out.headers()["set-cookie"].to_str().unwrap();
    assert!(
        cleared.starts_with("postie_console=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );

    stop.cancel();
    serving.stop().await;
}

#[test]
fn off_loopback_without_credentials_it_refuses_to_start() {
    let run = run_postie(&["console", "--listen", "0.0.0.0:0"], &[]);
    assert_ne!(run.code, Some(0), "{}", run.stdout);
    assert!(
        run.stderr
            .contains("off loopback, and no credentials are set"),
        "{}",
        run.stderr
    );
    assert_eq!(
        run.stderr.lines().filter(|l| !l.trim().is_empty()).count(),
        1,
        "one line: {}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_also_serves_the_console_at_console_listen() {
    let env = TestEnv::new("consolesrv").await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut serving = env.spawn_process(&[("POSTIE__CONSOLE__LISTEN", &listen)]);
    // On loopback without credentials: open, as the `local` operator.
    let http = Client::new();
    let page = eventually("the console in serve", WAIT, || {
        let (http, url) = (&http, format!("http://{listen}/"));
        async move {
            let response = http.get(url).send().await.ok()?;
            (response.status() == StatusCode::OK).then_some(response.text().await.ok()?)
        }
    })
    .await;
    assert!(
        page.contains("local · may act") && page.contains(env.topology.send_queue()),
        "{page}"
    );
    // A job sent by this serve shows on its console.
    env.publish(&job("srv-1", "alice@example.com")).await;
    env.wait_for_status("srv-1", "sent", WAIT).await;
    let job_page = http
        .get(format!("http://{listen}/job?key=srv-1"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        job_page.contains("<strong id=\"status\">sent</strong>"),
        "{job_page}"
    );
    // An action is logged with who did it (the `local` operator here), and the
    // address it suppressed is not.
    let form = http
        .get(format!("http://{listen}/suppression"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let body = format!(
        "csrf={}&address=dave%40example.com&reason=manual",
        csrf(&form)
    );
    let added = http
        .post(format!("http://{listen}/suppression/add"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), StatusCode::OK);
    let line = eventually("the action's log line", WAIT, || async {
        serving
            .log()
            .lines()
            .find(|l| l.contains("console action"))
            .map(str::to_owned)
    })
    .await;
    assert!(
        line.contains("local") && line.contains("suppress"),
        "{line}"
    );
    assert!(!line.contains("dave@example.com"), "{line}");
    assert!(
        serving
            .terminate(Duration::from_secs(60))
            .is_some_and(|s| s.success()),
        "{}",
        serving.log()
    );

    // Off loopback without credentials, serve does not start either.
    let mut vars = env.env_vars();
    vars.push(("POSTIE__CONSOLE__LISTEN".into(), "0.0.0.0:0".into()));
    let run = run_postie(&["serve"], &vars);
    assert_ne!(run.code, Some(0));
    assert!(
        run.stderr
            .contains("off loopback, and no credentials are set"),
        "{}",
        run.stderr
    );
}
