//! The one HTTP(S) client configuration postie's outbound HTTP uses: hyper's client
//! with hyper-rustls on ring and the system's root certificates (certificates always
//! verified), HTTP/1.1. The providers' APIs (`mail::api`), the feedback endpoint's
//! fetches and RabbitMQ's management API (`broker::management`) build their clients
//! from it. Not reqwest's TLS: turning on any of its rustls features makes every
//! reqwest client in the build panic unless a process-wide crypto provider was
//! installed first.
//!
//! A reply's body is read up to a bound ([`read_body`]): a peer cannot make postie
//! hold more than the caller decided.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::connect::HttpConnector;

/// HTTP or HTTPS ([`tls_config`]), each connection attempt within `connect_timeout`.
pub(crate) fn connector(
    connect_timeout: Duration,
) -> anyhow::Result<hyper_rustls::HttpsConnector<HttpConnector>> {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(connect_timeout));
    http.enforce_http(false);
    wrap(http)
}

/// `http` (its resolver and timeouts set by the caller) with [`tls_config`] over it.
pub(crate) fn wrap<R>(
    http: HttpConnector<R>,
) -> anyhow::Result<hyper_rustls::HttpsConnector<HttpConnector<R>>> {
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config()?)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http))
}

/// rustls on ring with the system's root certificates.
fn tls_config() -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A certificate the store cannot take is skipped, as browsers do.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        tracing::warn!("no system root certificates were found: HTTPS requests will fail");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    // ALPN (http/1.1) is set by hyper-rustls's `enable_http1`.
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Why a reply's body was not read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    /// The body went on past `limit` bytes: nothing of it is kept.
    #[error("the reply is longer than {limit} bytes")]
    TooLong {
        /// The bound.
        limit: usize,
    },
    /// The connection broke off while the body was read.
    #[error("the reply broke off: {0}")]
    Broken(String),
}

/// Reads `body` to its end, at most `limit` bytes: a longer one is refused as soon
/// as it goes past the bound, without reading the rest.
pub(crate) async fn read_body<B>(mut body: B, limit: usize) -> Result<Bytes, BodyError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let mut out = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Broken(crate::error_chain(&e)))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(BodyError::TooLong { limit });
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    #[tokio::test]
    async fn a_body_is_read_up_to_its_bound_and_no_further() {
        let body = Full::new(Bytes::from_static(b"0123456789"));
        assert_eq!(read_body(body, 10).await.unwrap().as_ref(), b"0123456789");
        let body = Full::new(Bytes::from_static(b"0123456789"));
        assert!(matches!(
            read_body(body, 9).await,
            Err(BodyError::TooLong { limit: 9 })
        ));
        // An endless body is refused once past the bound.
        let endless = futures_util::stream::repeat_with(|| {
            Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from_static(&[b'x'; 1024])))
        });
        let body = StreamBody::new(endless);
        assert!(matches!(
            read_body(body, 1 << 20).await,
            Err(BodyError::TooLong { .. })
        ));
    }
}
