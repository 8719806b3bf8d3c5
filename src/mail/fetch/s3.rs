//! `{"s3": {"bucket", "key"}}` sources: objects of an S3-compatible store, read with
//! `object_store`'s S3 client (its SigV4, its error kinds), over postie's own HTTPS
//! client (`ops::https`: rustls on ring, no second TLS stack).
//!
//! Who can reach this: anyone who can publish a job names the bucket and the key, and
//! postie's credentials may reach more than invoices. So only the buckets on
//! `attachments.s3.buckets` are read (none by default); the store's endpoint and the
//! credentials are the operator's (`attachments.s3.endpoint`, `.region`, and the
//! usual `AWS_*` environment variables), never the job's. The client does not retry:
//! a store that fails is the ladder's to wait out (`SendError::Unavailable`), and so
//! is one that refuses postie's own credentials or clock ([`CREDENTIAL_CODES`]): an
//! operator's mistake must not dead-letter every job that names the store. No such
//! object, or a 403 `AccessDenied` for it, is the job's fault.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{
    HttpClient, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpResponseBody, HttpService,
};
use object_store::{ClientOptions, ObjectStoreExt as _, RetryConfig};

use super::Failure;
use crate::config::S3Settings;

/// The configured store, one client per bucket read so far.
pub(super) struct Buckets {
    settings: S3Settings,
    timeout: Duration,
    clients: Mutex<HashMap<String, Arc<AmazonS3>>>,
}

impl Buckets {
    pub(super) fn new(settings: &S3Settings, timeout: Duration) -> Self {
        Self {
            settings: settings.clone(),
            timeout,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// The object `bucket`/`key`, its bytes as they come.
    pub(super) async fn get(
        &self,
        bucket: &str,
        key: &str,
    ) -> Result<BoxStream<'static, Result<Bytes, String>>, Failure> {
        let client = self.client(bucket)?;
        let path = object_store::path::Path::from(key);
        let got = tokio::time::timeout(self.timeout, client.get(&path))
            .await
            .map_err(|_| Failure::Outage(format!("s3://{bucket}: no answer in time")))?
            .map_err(|e| failure(bucket, key, &e))?;
        Ok(got
            .into_stream()
            .map(|chunk| chunk.map_err(|e| crate::error_chain(&e)))
            .boxed())
    }

    /// `bucket`'s client, if `bucket` is allowed.
    fn client(&self, bucket: &str) -> Result<Arc<AmazonS3>, Failure> {
        if !self.settings.buckets.iter().any(|b| b == bucket) {
            return Err(Failure::Job(format!(
                "s3 bucket {bucket:?} is not on attachments.s3.buckets"
            )));
        }
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(bucket) {
            return Ok(client.clone());
        }
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(RetryConfig {
                max_retries: 0,
                retry_timeout: self.timeout,
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(self.timeout)
                    .with_connect_timeout(self.timeout),
            )
            .with_http_connector(Connector(self.timeout));
        if let Some(region) = &self.settings.region {
            builder = builder.with_region(region);
        }
        if let Some(endpoint) = &self.settings.endpoint {
            // A store of one's own (MinIO, moto, Ceph): path-style requests.
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        let client =
            Arc::new(builder.build().map_err(|e| {
                Failure::Outage(format!("s3://{bucket}: {}", crate::error_chain(&e)))
            })?);
        clients.insert(bucket.to_string(), client.clone());
        Ok(client)
    }
}

/// S3's error codes (with 403) that say postie's own credentials or clock are wrong,
/// not the job: an operator's mistake or an expired token, to wait out rather than
/// dead-letter every job that names the store.
const CREDENTIAL_CODES: &[&str] = &[
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "RequestTimeTooSkewed",
];

/// What the store's answer is: the job's fault (no such object, no access to it) or
/// an outage (postie's credentials refused, 401, anything else).
fn failure(bucket: &str, key: &str, error: &object_store::Error) -> Failure {
    let what = format!("s3://{bucket}/{}", crate::contract::readable(key, 200));
    let text = crate::error_chain(error);
    let refused = CREDENTIAL_CODES
        .iter()
        .find(|code| text.contains(&format!("<Code>{code}</Code>")));
    match (error, refused) {
        (object_store::Error::NotFound { .. }, _) => Failure::Job(format!("{what} does not exist")),
        (object_store::Error::PermissionDenied { .. }, Some(code))
        | (object_store::Error::Unauthenticated { .. }, Some(code)) => Failure::Outage(format!(
            "{what}: the store refused postie's credentials ({code}); see attachments.s3 and AWS_*"
        )),
        (object_store::Error::Unauthenticated { .. }, None) => Failure::Outage(format!(
            "{what}: the store refused postie's credentials (401); see attachments.s3 and AWS_*"
        )),
        (object_store::Error::PermissionDenied { .. }, None) => {
            Failure::Job(format!("{what} may not be read (403)"))
        }
        (other, _) => Failure::Outage(format!(
            "{what}: {}",
            crate::contract::readable(&crate::error_chain(other), 300)
        )),
    }
}

/// `object_store`'s requests over postie's HTTPS client.
#[derive(Debug)]
struct Connector(Duration);

impl object_store::client::HttpConnector for Connector {
    fn connect(&self, _: &ClientOptions) -> object_store::Result<HttpClient> {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(crate::ops::https::connector(self.0).map_err(|e| {
                    object_store::Error::Generic {
                        store: "S3",
                        source: e.into(),
                    }
                })?);
        Ok(HttpClient::new(Service(client)))
    }
}

type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

#[derive(Debug)]
struct Service(Client);

#[async_trait::async_trait]
impl HttpService for Service {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        let (parts, body) = request.into_parts();
        // A GET's body is empty; nothing here sends a streamed one.
        let bytes = body.as_bytes().cloned().unwrap_or_default();
        let request = http::Request::from_parts(parts, Full::new(bytes));
        let response = self.0.request(request).await.map_err(|e| {
            let kind = if e.is_connect() {
                HttpErrorKind::Connect
            } else {
                HttpErrorKind::Request
            };
            HttpError::new(kind, e)
        })?;
        let (parts, body) = response.into_parts();
        let body = body.map_err(|e| HttpError::new(HttpErrorKind::Decode, e));
        Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)))
    }
}
