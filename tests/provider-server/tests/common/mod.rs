//! The provider server as a child process, and a raw HTTP/1.1 client for it (one
//! request per connection, `connection: close`), so that the tests see exactly what
//! crosses the socket and need no HTTP client crate.

#![allow(dead_code)]

use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The credentials the server accepts (src/main.rs).
pub const SES_ACCESS_KEY: &str = "AKIAPOSTIETEST000001";
pub const SES_SECRET: &str = "postie-test-ses-secret-key/0000000000000";
pub const SENDGRID_KEY: &str = "SG.postie-test.sendgrid-key";
pub const POSTMARK_TOKEN: &str = "postie-test-postmark-token";
pub const MAILGUN_KEY: &str = "postie-test-mailgun-key";

/// The four providers, as the server names them.
pub const PROVIDERS: [&str; 4] = ["ses", "sendgrid", "postmark", "mailgun"];

/// The Mailgun domain the tests send from.
pub const DOMAIN: &str = "mg.postie.test";

/// How long a reply may take before a test calls the request hung.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// An HTTP reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// The header section, lowercased names, as `name: value` lines.
    pub head: String,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "reply body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// One HTTP request, to be written to a socket.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: &'static str,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn new(method: &'static str, path: impl Into<String>) -> Self {
        Self {
            method,
            path: path.into(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    pub fn json(mut self, body: &Value) -> Self {
        self.body = serde_json::to_vec(body).unwrap();
        self.header("content-type", "application/json")
    }

    /// The bytes on the wire, for `host`.
    pub fn bytes(&self, host: &str) -> Vec<u8> {
        let mut out = format!("{} {} HTTP/1.1\r\nhost: {host}\r\n", self.method, self.path);
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        if !self.body.is_empty() || self.method != "GET" {
            out.push_str(&format!("content-length: {}\r\n", self.body.len()));
        }
        out.push_str("connection: close\r\n\r\n");
        let mut out = out.into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// Parses a whole HTTP/1.1 reply (read to EOF).
pub fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header section in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let (_, head) = head.split_once("\r\n").unwrap_or((&head, ""));
    let head = head.replace("\r\n", "\n");
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "a chunked reply; the tests expect a length: {head}"
    );
    Reply {
        status,
        head,
        body: raw[split + 4..].to_vec(),
    }
}

/// Sends `request` to `addr` on a new connection and reads the reply to EOF.
pub async fn exchange(addr: &str, request: &Request) -> Reply {
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.write_all(&request.bytes(addr)).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    parse_reply(&raw)
}

/// Like [`exchange`], but `None` when no reply came within `wait`.
pub async fn exchange_within(addr: &str, request: &Request, wait: Duration) -> Option<Reply> {
    tokio::time::timeout(wait, exchange(addr, request))
        .await
        .ok()
}

/// AWS Signature Version 4 over `host;x-amz-date` and the body's SHA-256 (what SES
/// needs for a path and query without characters to encode): the `Authorization`
/// header. Written here independently of the server's checker, and held to AWS's
/// published test vector ([`tests::sigv4_signs_aws_get_vanilla`]).
#[allow(clippy::too_many_arguments)]
pub fn sigv4(
    method: &str,
    path: &str,
    host: &str,
    amz_date: &str,
    body: &[u8],
    (access_key, secret): (&str, &str),
    region: &str,
    service: &str,
) -> String {
    fn hmac(key: &[u8], data: &str) -> Vec<u8> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
        mac.update(data.as_bytes());
        mac.finalize().into_bytes().to_vec()
    }
    let date = &amz_date[..8];
    let scope = format!("{date}/{region}/{service}/aws4_request");
    let canonical = format!(
        "{method}\n{path}\n\nhost:{host}\nx-amz-date:{amz_date}\n\nhost;x-amz-date\n{}",
        hex::encode(Sha256::digest(body))
    );
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac(format!("AWS4{secret}").as_bytes(), date);
    for part in [region, service, "aws4_request"] {
        key = hmac(&key, part);
    }
    format!(
        "AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders=host;x-amz-date, Signature={}",
        hex::encode(hmac(&key, &to_sign))
    )
}

/// A raw email with this Message-ID.
pub fn mime(message_id: &str, to: &str) -> String {
    format!(
        "Message-ID: {message_id}\r\nFrom: postie@postie.test\r\nTo: {to}\r\nSubject: hello\r\n\r\nHello.\r\n"
    )
}

/// A running server, killed on drop.
pub struct Server {
    child: Child,
    pub api: String,
    pub control: String,
}

impl Server {
    /// Starts the crate's binary on ephemeral ports.
    pub fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_postie-provider-server"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn postie-provider-server");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
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
        }
    }

    /// A control API request; panics unless it succeeds.
    pub async fn control(&self, method: &'static str, path: &str, body: Option<Value>) -> Value {
        let mut request = Request::new(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply = exchange(&self.control, &request).await;
        assert!(
            reply.status == 200,
            "{method} {path}: {} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
        reply.json()
    }

    pub async fn stats(&self) -> Value {
        self.control("GET", "/stats", None).await
    }

    pub async fn set_faults(&self, rules: Value) {
        self.control("PUT", "/faults", Some(rules)).await;
    }

    /// Sends `request` to the API; the reply.
    pub async fn api(&self, request: &Request) -> Reply {
        tokio::time::timeout(PATIENCE, exchange(&self.api, request))
            .await
            .unwrap_or_else(|_| panic!("no reply to {} {}", request.method, request.path))
    }

    /// `provider`'s send request for one email to `to`, with the right credentials or
    /// wrong ones.
    pub fn send_request(&self, provider: &str, to: &str, right_keys: bool) -> Request {
        let message_id = format!("<{provider}.{}@postie.test>", to.replace('@', "."));
        let request = match provider {
            "ses" => Request::new("POST", "/v2/email/outbound-emails").json(&json!({
                "Destination": { "ToAddresses": [to] },
                "Content": { "Raw": { "Data": base64::engine::general_purpose::STANDARD.encode(mime(&message_id, to)) } },
            })),
            "sendgrid" => Request::new("POST", "/v3/mail/send").json(&json!({
                "personalizations": [{ "to": [{ "email": to }] }],
                "from": { "email": "postie@postie.test" },
                "subject": "hello",
                "content": [{ "type": "text/plain", "value": "Hello." }],
                "headers": { "Message-ID": message_id },
            })),
            "postmark" => Request::new("POST", "/email").json(&json!({
                "From": "postie@postie.test",
                "To": to,
                "Subject": "hello",
                "TextBody": "Hello.",
                "Headers": [{ "Name": "Message-ID", "Value": message_id }],
            })),
            "mailgun" => {
                let boundary = "postie-boundary-0001";
                let body = format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"to\"\r\n\r\n{to}\r\n\
                     --{boundary}\r\nContent-Disposition: form-data; name=\"message\"; filename=\"message.mime\"\r\n\
                     Content-Type: message/rfc822\r\n\r\n{}\r\n--{boundary}--\r\n",
                    mime(&message_id, to)
                );
                let mut request = Request::new("POST", format!("/v3/{DOMAIN}/messages.mime"))
                    .header(
                        "content-type",
                        format!("multipart/form-data; boundary={boundary}"),
                    );
                request.body = body.into_bytes();
                request
            }
            other => panic!("no provider {other}"),
        };
        self.authorize(provider, request, right_keys)
    }

    /// `provider`'s account request (what postie's circuit-breaker probe asks).
    pub fn probe_request(&self, provider: &str, right_keys: bool) -> Request {
        let path = match provider {
            "ses" => "/v2/email/account".to_string(),
            "sendgrid" => "/v3/scopes".to_string(),
            "postmark" => "/server".to_string(),
            "mailgun" => format!("/v3/domains/{DOMAIN}"),
            other => panic!("no provider {other}"),
        };
        self.authorize(provider, Request::new("GET", path), right_keys)
    }

    /// Adds `provider`'s credentials (a wrong key when not `right_keys`).
    fn authorize(&self, provider: &str, request: Request, right_keys: bool) -> Request {
        let key = |key: &str| {
            if right_keys {
                key.to_string()
            } else {
                format!("{key}-wrong")
            }
        };
        match provider {
            "ses" => {
                let amz_date = chrono::Utc::now().format("%Y%m%dT%H%M%SZ").to_string();
                let authorization = sigv4(
                    request.method,
                    &request.path,
                    &self.api,
                    &amz_date,
                    &request.body,
                    (SES_ACCESS_KEY, &key(SES_SECRET)),
                    "eu-west-1",
                    "ses",
                );
                request
                    .header("x-amz-date", amz_date)
                    .header("authorization", authorization)
            }
            "sendgrid" => request.header("authorization", format!("Bearer {}", key(SENDGRID_KEY))),
            "postmark" => request.header("x-postmark-server-token", key(POSTMARK_TOKEN)),
            "mailgun" => {
                let basic = base64::engine::general_purpose::STANDARD
                    .encode(format!("api:{}", key(MAILGUN_KEY)));
                request.header("authorization", format!("Basic {basic}"))
            }
            other => panic!("no provider {other}"),
        }
    }

    /// Sends one email through `provider`'s API; the reply.
    pub async fn send(&self, provider: &str, to: &str) -> Reply {
        self.api(&self.send_request(provider, to, true)).await
    }

    /// Asks `provider`'s account endpoint; the reply.
    pub async fn probe(&self, provider: &str) -> Reply {
        self.api(&self.probe_request(provider, true)).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status a provider answers an accepted send with.
pub fn accepted_status(provider: &str) -> u16 {
    if provider == "sendgrid" {
        202
    } else {
        200
    }
}

/// The status a provider refuses wrong credentials with.
pub fn refused_status(provider: &str) -> u16 {
    if provider == "ses" {
        403
    } else {
        401
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's SigV4 test suite, `get-vanilla`: a GET with an empty body.
    #[test]
    fn sigv4_signs_aws_get_vanilla() {
        let authorization = sigv4(
            "GET",
            "/",
            "example.amazonaws.com",
            "20150830T123600Z",
            b"",
            ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
            "us-east-1",
            "service",
        );
        assert_eq!(
            authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
    }
}
