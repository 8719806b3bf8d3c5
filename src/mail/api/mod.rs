//! Transports over email providers' HTTP APIs: Amazon SES v2, SendGrid v3, Postmark
//! and Mailgun, chosen by `transport.url`'s scheme ([`crate::config::ApiEndpoint`]).
//!
//! One HTTPS client (hyper's, with hyper-rustls on ring and the system's roots,
//! HTTP/1.1, at most `transport.pool_size` idle connections), every request under
//! `transport.timeout` from connect to the last byte of the reply. Each provider module builds its
//! request and reads its replies; this module turns what happened into a
//! [`SendError`], the same classes as SMTP's:
//!
//! | what happened | class | what the worker does |
//! |---|---|---|
//! | 2xx (and the provider's id read) | sent | records it, with the id in the inbox row's `provider_message_id` |
//! | 429, or the provider's throttling error (SES `TooManyRequestsException`, `Throttling…`) | [`SendError::Throttled`] | slows down (AIMD) and retries without counting an attempt |
//! | 5xx, 408 | [`SendError::Transient`] | retries on the ladder; the provider's breaker counts it (it said it did not take the email) |
//! | no connection (refused, DNS, TLS, connect timeout) | [`SendError::Unreachable`] | retries; the breaker counts it and probes |
//! | credentials refused (401; SES 403) | [`SendError::Unreachable`] | as a relay that refuses AUTH: postie's set-up, not the job's; pauses instead of dead-lettering every job |
//! | timeout, a broken connection or a reply longer than [`MAX_REPLY_BYTES`] after the request was sent | [`SendError::Transient`], the clearance marked uncertain | retried on this provider only, never failed over: it may have been accepted (at least once, as with SMTP's lost final reply); the breaker does not count it |
//! | any other 4xx (invalid address, account suspended, message rejected) | [`SendError::Permanent`] | dead letter, the provider's own message as the reason |
//!
//! The client is built on `ops::https`'s connector, and a reply is read up to
//! [`MAX_REPLY_BYTES`] (64 KiB). The breaker's probe asks the provider's account
//! endpoint. `web_client` is the same HTTPS client for the feedback endpoint's SNS
//! fetches. SendGrid's and Postmark's JSON fields come from `message::Fields`.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use http::{HeaderMap, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{Clearance, Email, SendError, Transport};
use crate::config::{ApiEndpoint, ApiProvider, TransportSettings};
use crate::ops::https;

mod mailgun;
mod payload;
mod postmark;
mod request;
mod sendgrid;
mod ses;

pub(super) use request::HttpRequest;

/// The longest reply body postie reads from a provider: 64 KiB. Their answers are a
/// few hundred bytes of JSON or XML (an id, or an error and its message); a longer
/// one is refused unread past the bound, and the send counts as uncertain, as a
/// reply that broke off does.
pub(crate) const MAX_REPLY_BYTES: usize = 64 * 1024;

/// A provider's reply: status, headers and body (at most [`MAX_REPLY_BYTES`], read
/// within `transport.timeout`).
pub(super) struct Reply {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (`Null` if it is not).
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// A header's value as text (`""` when absent).
    pub(super) fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The body as one readable line.
    pub(super) fn text(&self) -> String {
        crate::contract::readable(&String::from_utf8_lossy(&self.body), 300)
    }
}

/// The class of a failed reply (not 2xx), by status; `throttle` says the provider's
/// own words named a throttle whatever the status. `detail` is the provider's text.
pub(super) fn failure(name: &str, reply: &Reply, throttle: bool, detail: &str) -> SendError {
    let status = reply.status.as_u16();
    let text = crate::contract::readable(&format!("{name} answered {status}: {detail}"), 1_000);
    match status {
        429 => SendError::Throttled(text),
        _ if throttle => SendError::Throttled(text),
        401 => SendError::Unreachable(format!("{text} (check the key in transport.url)")),
        408 | 500..=599 => SendError::Transient(text),
        400..=499 => SendError::Permanent(text),
        _ => SendError::Transient(text),
    }
}

/// Which provider, with what it needs to build requests.
enum Api {
    Ses(ses::Ses),
    SendGrid(sendgrid::SendGrid),
    Postmark(postmark::Postmark),
    Mailgun(mailgun::Mailgun),
}

/// The providers' client: a body is whole, or streamed (an email with attachments).
type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<HttpConnector>,
    BoxBody<Bytes, std::io::Error>,
>;

/// A provider's HTTP API as a [`Transport`].
pub(super) struct ApiTransport {
    client: Client,
    api: Api,
    name: &'static str,
    /// `transport.timeout`: the bound of a request, connect to reply.
    step: Duration,
}

impl ApiTransport {
    /// The client and the provider's request builder; no connection yet.
    pub(super) fn new(
        endpoint: &ApiEndpoint,
        settings: &TransportSettings,
    ) -> anyhow::Result<Self> {
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(settings.pool_size as usize)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(https::connector(settings.timeout)?);
        let base = endpoint.base.clone();
        let api = match &endpoint.provider {
            ApiProvider::Ses { .. } => Api::Ses(ses::Ses::new(&endpoint.provider, &base)?),
            ApiProvider::SendGrid { key } => Api::SendGrid(sendgrid::SendGrid::new(key, &base)),
            ApiProvider::Postmark { token, stream } => {
                Api::Postmark(postmark::Postmark::new(token, stream, &base))
            }
            ApiProvider::Mailgun { domain, key } => {
                Api::Mailgun(mailgun::Mailgun::new(domain, key, &base))
            }
        };
        Ok(Self {
            client,
            api,
            name: endpoint.name(),
            step: settings.timeout,
        })
    }

    /// The request for `email`, ready to send.
    fn request(&self, email: &Email) -> Result<HttpRequest, SendError> {
        match &self.api {
            Api::Ses(api) => api.request(email),
            Api::SendGrid(api) => api.request(email),
            Api::Postmark(api) => api.request(email),
            Api::Mailgun(api) => api.request(email),
        }
    }

    /// The provider's account request: the breaker's probe.
    fn account_request(&self) -> Result<HttpRequest, SendError> {
        Ok(match &self.api {
            Api::Ses(api) => api.account_request()?,
            Api::SendGrid(api) => api.account_request(),
            Api::Postmark(api) => api.account_request(),
            Api::Mailgun(api) => api.account_request(),
        })
    }

    /// The provider's id for an accepted email, or the class of its refusal.
    fn read(&self, reply: &Reply) -> Result<Option<String>, SendError> {
        match &self.api {
            Api::Ses(_) => ses::read(reply),
            Api::SendGrid(_) => sendgrid::read(reply),
            Api::Postmark(_) => postmark::read(reply),
            Api::Mailgun(_) => mailgun::read(reply),
        }
    }

    /// Sends the request and reads the whole reply, all within `transport.timeout`
    /// and `extra` (an email's attachments' transfer time). A failure after the
    /// request may have reached the provider marks `clearance` uncertain.
    async fn exchange(
        &self,
        request: HttpRequest,
        clearance: &Clearance,
        extra: Duration,
    ) -> Result<Reply, SendError> {
        let sent = self.exchange_once(request, extra).await;
        if let Err(Lost::AfterSending(_)) = &sent {
            clearance.mark_uncertain();
        }
        sent.map_err(Lost::into_error)
    }

    /// [`ApiTransport::exchange`]'s request and reply, the failure told apart.
    async fn exchange_once(&self, request: HttpRequest, extra: Duration) -> Result<Reply, Lost> {
        let mut builder = http::Request::builder()
            .method(request.method)
            .uri(&request.url)
            .header("user-agent", concat!("postie/", env!("CARGO_PKG_VERSION")));
        for (name, value) in request.headers {
            builder = builder.header(name, value);
        }
        let mut spool_failure = None;
        let body = match request.stream {
            Some(payload) => {
                spool_failure = Some(payload.spool_failure());
                payload.into_body()
            }
            None => Full::new(Bytes::from(request.body))
                .map_err(|never| match never {})
                .boxed(),
        };
        let request = builder.body(body).map_err(|e| {
            Lost::Before(SendError::Unreachable(format!(
                "{}: bad request URL: {e}",
                self.name
            )))
        })?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| self.lost(&e))?;
            let (parts, body) = response.into_parts();
            // A reply past the bound, or one that broke off, is no answer: the
            // request may have been accepted, so the send is uncertain.
            let body = https::read_body(body, MAX_REPLY_BYTES)
                .await
                .map_err(|e| self.after_sending(&e.to_string()))?;
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body: body.to_vec(),
            })
        };
        let limit = self.step + extra;
        let replied = tokio::time::timeout(limit, exchange)
            .await
            .unwrap_or_else(|_| {
                Err(self.after_sending(&format!(
                    "no reply within {}",
                    humantime::format_duration(limit)
                )))
            });
        // A body that broke off on the spool was shorter than its `Content-Length`:
        // the provider cannot have taken it, whatever the client made of the end.
        match spool_failure.as_ref().and_then(|failed| failed.get()) {
            Some(failed) if replied.is_err() => Err(Lost::Before(failed.clone())),
            _ => replied,
        }
    }

    /// A request that got no reply: unreachable if no connection was made (nothing
    /// was sent), else transient (it may have been accepted: retried, never dropped).
    fn lost(&self, e: &hyper_util::client::legacy::Error) -> Lost {
        // The client's errors name neither the headers nor the body: no key is in them.
        let chain = crate::contract::readable(&crate::error_chain(e), 500);
        if e.is_connect() {
            Lost::Before(SendError::Unreachable(format!(
                "{}: no connection: {chain}",
                self.name
            )))
        } else {
            self.after_sending(&format!("the connection failed: {chain}"))
        }
    }

    /// Transient: the request may have reached the provider.
    fn after_sending(&self, what: &str) -> Lost {
        Lost::AfterSending(SendError::Transient(format!(
            "{}: {what} after the request was sent (it may have been accepted)",
            self.name
        )))
    }
}

/// A request without a reply to read.
enum Lost {
    /// Nothing reached the provider.
    Before(SendError),
    /// The request may have reached it.
    AfterSending(SendError),
}

impl Lost {
    fn into_error(self) -> SendError {
        match self {
            Self::Before(error) | Self::AfterSending(error) => error,
        }
    }
}

impl Transport for ApiTransport {
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<Option<String>, SendError>> {
        async move {
            let request = self.request(email)?;
            clearance.check()?;
            let extra = email.transfer_time();
            let reply = self.exchange(request, clearance, extra).await?;
            self.read(&reply)
        }
        .boxed()
    }

    /// The provider's account endpoint (SES `GetAccount`, SendGrid's scopes,
    /// Postmark's server, Mailgun's domain) with the configured key, within
    /// `transport.timeout`: up only on a 2xx (a refused key or a 5xx is still down) or a
    /// 429 (it answers; it is only busy).
    fn probe(&self) -> BoxFuture<'_, bool> {
        async {
            let Ok(request) = self.account_request() else {
                return false;
            };
            match self.exchange_once(request, Duration::ZERO).await {
                Ok(reply) => reply.status.is_success() || reply.status.as_u16() == 429,
                Err(_) => false,
            }
        }
        .boxed()
    }

    /// No connection, credentials refused, and a 5xx answer (the provider said it
    /// did not take the email); never a failure after the request went unanswered
    /// (which may have been accepted).
    fn opens_breaker(&self, error: &SendError, uncertain: bool) -> bool {
        match error {
            SendError::Unreachable(_) => true,
            SendError::Transient(_) => !uncertain,
            _ => false,
        }
    }

    fn wants_fields(&self) -> bool {
        matches!(self.api, Api::SendGrid(_) | Api::Postmark(_))
    }
}

/// An HTTP(S) client on the same TLS as the providers' APIs (`ops::https`), for
/// the feedback endpoint's fetches (SNS certificates, subscription URLs).
pub(crate) type WebClient =
    hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A [`WebClient`]; each connection attempt within `connect_timeout`.
pub(crate) fn web_client(connect_timeout: Duration) -> anyhow::Result<WebClient> {
    Ok(
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .build(https::connector(connect_timeout)?),
    )
}

/// A request's fields, or a permanent error for an email built without them (the
/// mailer asks for them whenever its transport [`Transport::wants_fields`]).
pub(super) fn fields(email: &Email) -> Result<&super::message::Fields, SendError> {
    email.fields().ok_or_else(|| {
        SendError::Permanent("the email was built without the job's fields this API needs".into())
    })
}

/// The provider's reply to a request whose fault was `body`'s: the unit tests' reply.
#[cfg(test)]
pub(super) fn reply(status: u16, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    Reply {
        status: StatusCode::from_u16(status).unwrap(),
        headers: map,
        body: body.as_bytes().to_vec(),
    }
}
