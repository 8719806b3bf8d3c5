//! A request as the provider modules build it: method, URL, headers (secrets marked
//! sensitive) and body.

use base64::Engine as _;
use http::{HeaderValue, Method};

/// A request as the provider modules build it (POST, or GET for the probe).
pub(crate) struct HttpRequest {
    pub(super) method: Method,
    pub(super) url: String,
    pub(super) headers: Vec<(http::HeaderName, HeaderValue)>,
    pub(super) body: Vec<u8>,
    /// A streamed body instead of `body` (an email with attachments).
    pub(super) stream: Option<super::payload::Payload>,
}

impl HttpRequest {
    pub(crate) fn post(url: &str) -> Self {
        Self::new(Method::POST, url)
    }

    pub(crate) fn get(url: &str) -> Self {
        Self::new(Method::GET, url)
    }

    fn new(method: Method, url: &str) -> Self {
        Self {
            method,
            url: url.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
            stream: None,
        }
    }

    /// Adds a header; one that is not valid is dropped (the provider then refuses the
    /// request, which is classed like any refusal). `authorization` and
    /// `x-amz-security-token` are marked sensitive.
    pub(crate) fn header(self, name: &str, value: impl AsRef<str>) -> Self {
        let secret = matches!(name, "authorization" | "x-amz-security-token");
        self.with_header(name, value.as_ref(), secret)
    }

    /// A header holding a secret: marked sensitive (hidden from `Debug`, never indexed).
    pub(crate) fn secret_header(self, name: &str, value: &str) -> Self {
        self.with_header(name, value, true)
    }

    fn with_header(mut self, name: &str, value: &str, secret: bool) -> Self {
        let name = http::HeaderName::from_bytes(name.as_bytes());
        if let (Ok(name), Ok(mut value)) = (name, HeaderValue::from_str(value)) {
            value.set_sensitive(secret);
            self.headers.push((name, value));
        }
        self
    }

    pub(crate) fn bearer_auth(self, token: &str) -> Self {
        self.secret_header("authorization", &format!("Bearer {token}"))
    }

    pub(crate) fn basic_auth(self, user: &str, password: &str) -> Self {
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        self.secret_header("authorization", &format!("Basic {pair}"))
    }

    pub(crate) fn json(self, body: &serde_json::Value) -> Self {
        let mut request = self.header("content-type", "application/json");
        request.body = body.to_string().into_bytes();
        request
    }

    pub(crate) fn body(mut self, body: Vec<u8>) -> Self {
        self.body = body;
        self
    }

    /// A streamed body, with its `Content-Length`.
    pub(crate) fn streamed(self, payload: super::payload::Payload) -> Self {
        let mut request = self.header("content-length", payload.len().to_string());
        request.stream = Some(payload);
        request
    }
}
