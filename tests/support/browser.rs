//! A real browser for tests: Debian's headless Chromium driven through chromedriver's
//! W3C WebDriver protocol (JSON over HTTP, spoken here with reqwest: a handful of
//! commands need no client crate). scripts/test-setup.sh installs both.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

/// A chromedriver process and one browser session, both ended when dropped.
pub struct Browser {
    driver: Child,
    base: String,
    http: reqwest::Client,
    profile: std::path::PathBuf,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session.
    pub async fn start() -> Self {
        let port = super::free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (scripts/test-setup.sh installs chromium-driver)");
        let profile =
            std::env::temp_dir().join(format!("postie-chromium-{}", uuid::Uuid::new_v4()));
        let mut browser = Self {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            profile,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while browser
            .http
            .get(format!("{}/status", browser.base))
            .send()
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not answer within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--disable-background-networking", "--disable-component-update",
                         "--disable-sync", "--no-first-run", "--window-size=1280,900",
                         format!("--user-data-dir={}", browser.profile.display())]
            }
        }}});
        let session = browser.command("POST", "/session", capabilities).await;
        let id = session["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        browser.base = format!("{}/session/{id}", browser.base);
        browser
    }

    async fn command(&self, method: &str, path: &str, body: Value) -> Value {
        self.try_command(method, path, body)
            .await
            .unwrap_or_else(|error| panic!("WebDriver {method} {path}: {error}"))
    }

    async fn try_command(&self, method: &str, path: &str, body: Value) -> Result<Value, Value> {
        let url = format!("{}{path}", self.base);
        let request = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body),
        };
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        let value = answer["value"].clone();
        match value.get("error") {
            Some(_) => Err(value),
            None => Ok(value),
        }
    }

    /// Runs `script` (a function body) in the page until it returns something other
    /// than null, for at most 30 s (a page being replaced by a navigation answers
    /// errors meanwhile).
    async fn until(&self, script: &str) -> Value {
        self.until_with(script, json!([])).await
    }

    async fn until_with(&self, script: &str, args: Value) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let body = json!({ "script": script, "args": args });
            match self.try_command("POST", "/execute/sync", body).await {
                Ok(value) if !value.is_null() => return value,
                result => assert!(Instant::now() < deadline, "{script}: {result:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Opens `url` and waits for its load.
    pub async fn open(&self, url: &str) {
        self.command("POST", "/url", json!({ "url": url })).await;
    }

    /// The page as the browser holds it now (after any script).
    pub async fn source(&self) -> String {
        self.command("GET", "/source", Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The visible text of the page's body, once the page has loaded.
    pub async fn text(&self) -> String {
        let script = "return document.readyState === 'complete' && document.body \
                      ? document.body.innerText : null";
        self.until(script)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Waits (up to 30 s) until the page, as scripts change it, shows `text`; the
    /// page is not reloaded.
    pub async fn wait_for_text(&self, text: &str) {
        let script = "return document.body && document.body.innerText.includes(arguments[0]) \
                      ? true : null";
        self.until_with(script, json!([text])).await;
    }

    /// The first element matching a CSS selector.
    pub async fn find(&self, css: &str) -> String {
        let found = self
            .command(
                "POST",
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        found
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_owned()
    }

    /// Clicks the first element matching `css` (a link, or a form's button) and
    /// waits for the page it leads to.
    pub async fn click(&self, css: &str) {
        self.until("window.__postie_old_page = true; return true;")
            .await;
        let element = self.find(css).await;
        self.command("POST", &format!("/element/{element}/click"), json!({}))
            .await;
        // The old page's mark is gone once the new page is there.
        self.until("return window.__postie_old_page ? null : true;")
            .await;
    }

    /// Types `text` into the first element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.find(css).await;
        self.command(
            "POST",
            &format!("/element/{element}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    /// A PNG of the window, written to `path`.
    pub async fn screenshot(&self, path: &std::path::Path) {
        let png = self.command("GET", "/screenshot", Value::Null).await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap_or_default())
            .unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    /// Ends the session and chromedriver.
    pub async fn close(mut self) {
        let _ = self.http.delete(&self.base).send().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
