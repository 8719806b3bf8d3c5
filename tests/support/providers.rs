//! Client for the `postie-provider-server` process (tests/provider-server): build it,
//! start it, name the `transport.url` of each provider's API on it, read what it accepted,
//! inject faults (on sends, or with `"probe": true` on the account endpoints postie's
//! circuit-breaker probe asks), set its quota and take its API down (connections refused for a while). Like the SMTP sink ([`super::sink`]), it is a
//! workspace crate of its own that the tests build once per test process.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// The credentials the server accepts (tests/provider-server/src/main.rs).
pub const SES_ACCESS_KEY: &str = "AKIAPOSTIETEST000001";
/// The SES secret the server checks signatures with.
pub const SES_SECRET: &str = "postie-test-ses-secret-key/0000000000000";
/// SendGrid's API key.
pub const SENDGRID_KEY: &str = "SG.postie-test.sendgrid-key";
/// Postmark's server token.
pub const POSTMARK_TOKEN: &str = "postie-test-postmark-token";
/// Mailgun's API key.
pub const MAILGUN_KEY: &str = "postie-test-mailgun-key";

/// The four providers, as the server names them.
pub const PROVIDERS: [&str; 4] = ["ses", "sendgrid", "postmark", "mailgun"];

/// One request the server accepted.
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderMessage {
    /// Arrival order.
    pub seq: u64,
    /// Which API took it.
    pub provider: String,
    /// The email's Message-ID.
    pub message_id: String,
    /// The id the server answered with.
    pub provider_id: String,
    /// Recipients.
    pub to: Vec<String>,
    /// Unix ms.
    pub received_at_ms: i64,
    /// The raw MIME (SES, Mailgun) or JSON (SendGrid, Postmark), when asked for.
    #[serde(default)]
    pub raw: String,
}

/// The server's counters (`GET /stats`).
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderStats {
    pub requests: u64,
    pub accepted: u64,
    pub throttled: u64,
    pub server_errors: u64,
    pub rejected: u64,
    pub auth_failed: u64,
    pub hung: u64,
    /// Requests to the account endpoints (the probe's); not in `requests`.
    #[serde(default)]
    pub probes: u64,
    /// Requests answered with an endless body, and the bytes of it written.
    #[serde(default)]
    pub endless: u64,
    #[serde(default)]
    pub reply_bytes: u64,
}

/// Byte `i` of the provider server's file `seed` (its `files.rs` makes the same).
pub fn file_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 56) as u8
}

/// The provider server's file `seed` of `size` bytes.
pub fn file_bytes(seed: u64, size: u64) -> Vec<u8> {
    (0..size).map(|i| file_byte(seed, i)).collect()
}

/// The executable, built on first use (`POSTIE_PROVIDER_SERVER` names one instead).
pub fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| match std::env::var_os("POSTIE_PROVIDER_SERVER") {
        Some(path) => PathBuf::from(path),
        None => super::sink::build_binary("postie-provider-server"),
    })
}

/// A running server, killed on drop.
pub struct ProviderServer {
    child: Child,
    api: String,
    control: String,
    http: reqwest::Client,
}

impl ProviderServer {
    /// Starts a server on ephemeral ports.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// Starts a server on ephemeral ports with extra arguments (`--keep-bytes N`).
    pub async fn start_with(args: &[&str]) -> Self {
        let mut child = Command::new(binary())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn postie-provider-server");
        let stdout = child.stdout.take().unwrap();
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map(|_| line)
        })
        .await
        .unwrap()
        .expect("the server announces its ports");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("server line {line:?} has no {name}="))
                .to_string()
        };
        Self {
            api: field("api"),
            control: field("control"),
            child,
            http: reqwest::Client::new(),
        }
    }

    /// The URL of the server's file `seed` of `size` bytes ([`file_bytes`] makes the
    /// same bytes), on host `host` (`127.0.0.1` or `localhost`).
    pub fn file_url(&self, host: &str, seed: u64, size: u64) -> String {
        let port = self.api.rsplit(':').next().unwrap();
        format!("http://{host}:{port}/files/{seed}/{size}")
    }

    /// The raw MIME or JSON of the accepted request for job `key` (its Message-ID).
    pub async fn raw_of(&self, key: &str) -> String {
        let id = super::message_id(key);
        self.messages(true)
            .await
            .into_iter()
            .find(|m| m.message_id == id)
            .unwrap_or_else(|| panic!("no request for {key}"))
            .raw
    }

    /// The API's address, `127.0.0.1:PORT`.
    pub fn api_addr(&self) -> &str {
        &self.api
    }

    /// `transport.url` for `provider`'s API on this server, with the accepted credentials.
    pub fn url(&self, provider: &str) -> String {
        self.url_with_keys(provider, true)
    }

    /// Like [`ProviderServer::url`]; with `right_keys` false, credentials the server
    /// refuses.
    pub fn url_with_keys(&self, provider: &str, right_keys: bool) -> String {
        let endpoint = format!("endpoint=http://{}", self.api);
        let wrong = |key: &str| {
            if right_keys {
                key.to_string()
            } else {
                format!("{key}-wrong")
            }
        };
        match provider {
            "ses" => format!(
                "ses://{SES_ACCESS_KEY}:{}@eu-west-1?{endpoint}",
                wrong(SES_SECRET).replace('/', "%2F")
            ),
            "sendgrid" => format!(
                "sendgrid://apikey:{}@api.sendgrid.com?{endpoint}",
                wrong(SENDGRID_KEY)
            ),
            "postmark" => format!(
                "postmark://token:{}@api.postmarkapp.com?{endpoint}",
                wrong(POSTMARK_TOKEN)
            ),
            "mailgun" => format!(
                "mailgun://api:{}@mg.postie.test?{endpoint}",
                wrong(MAILGUN_KEY)
            ),
            other => panic!("no provider {other}"),
        }
    }

    /// `transport.url` for `provider` without credentials, and the environment variables
    /// that carry them instead (`SENDGRID_API_KEY`, `AWS_ACCESS_KEY_ID`…).
    pub fn url_and_env(&self, provider: &str) -> (String, Vec<(&'static str, String)>) {
        let endpoint = format!("endpoint=http://{}", self.api);
        match provider {
            "ses" => (
                format!("ses://eu-west-1?{endpoint}"),
                vec![
                    ("AWS_ACCESS_KEY_ID", SES_ACCESS_KEY.to_string()),
                    ("AWS_SECRET_ACCESS_KEY", SES_SECRET.to_string()),
                ],
            ),
            "sendgrid" => (
                format!("sendgrid://api.sendgrid.com?{endpoint}"),
                vec![("SENDGRID_API_KEY", SENDGRID_KEY.to_string())],
            ),
            "postmark" => (
                format!("postmark://api.postmarkapp.com?{endpoint}"),
                vec![("POSTMARK_SERVER_TOKEN", POSTMARK_TOKEN.to_string())],
            ),
            "mailgun" => (
                format!("mailgun://mg.postie.test?{endpoint}"),
                vec![("MAILGUN_API_KEY", MAILGUN_KEY.to_string())],
            ),
            other => panic!("no provider {other}"),
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        self.http
            .get(format!("http://{}{path}", self.control))
            .send()
            .await
            .expect("provider server control")
            .json()
            .await
            .expect("provider server JSON")
    }

    async fn put(&self, path: &str, body: Value) {
        let request = self.http.put(self.control_url(path)).json(&body);
        self.control(request, path).await;
    }

    async fn delete(&self, path: &str) {
        let request = self.http.delete(self.control_url(path));
        self.control(request, &format!("DELETE {path}")).await;
    }

    fn control_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.control)
    }

    /// Sends a control request (`what`, for the failure) and asserts it was taken.
    async fn control(&self, request: reqwest::RequestBuilder, what: &str) {
        let status = request
            .send()
            .await
            .expect("provider server control")
            .status();
        assert!(
            status.is_success(),
            "the provider server refused {what}: {status}"
        );
    }

    /// Everything accepted so far (with the raw request if `raw`).
    pub async fn messages(&self, raw: bool) -> Vec<ProviderMessage> {
        self.get(&format!("/messages?raw={raw}")).await
    }

    /// The counters.
    pub async fn stats(&self) -> ProviderStats {
        self.get("/stats").await
    }

    /// Replaces the fault rules (see the server's module docs).
    pub async fn set_faults(&self, rules: Value) {
        self.put("/faults", rules).await;
    }

    /// The quota: at most `per_second` accepted in any second, 429 beyond (`None`: off).
    pub async fn set_quota(&self, per_second: Option<u32>) {
        self.put("/quota", serde_json::json!({ "per_second": per_second }))
            .await;
    }

    /// Takes the provider APIs down for `seconds`: connects are refused (ECONNREFUSED)
    /// and open connections, hung ones included, are closed; then the same address
    /// serves again, with what was recorded, the faults and the quota kept. Returns once
    /// the API is down (0: once it is back). A new call replaces the window.
    pub async fn go_down(&self, seconds: u64) {
        self.put("/down", serde_json::json!({ "seconds": seconds }))
            .await;
    }

    /// Ends a [`ProviderServer::go_down`] window now; returns once the API listens.
    pub async fn come_back(&self) {
        self.delete("/down").await;
    }
}

impl Drop for ProviderServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
