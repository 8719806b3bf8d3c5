//! Fetching a job's `url` attachments into the spool, checked, before its send.
//!
//! Who can reach this: anyone who can publish a job names the URL, so the fetcher is
//! an open door into postie's network unless it is shut. What shuts it:
//!
//! | an attacker's URL | what stops it |
//! |---|---|
//! | a host not on `attachments.url_hosts` (empty by default) | refused before any lookup |
//! | `http://` to anything but loopback, or credentials in the URL | refused when the job is read |
//! | a name that resolves to a private, loopback, link-local, CGNAT or other non-public address (the cloud's metadata service) | refused unless `attachments.allow_private_addresses`; the addresses the connection uses are the ones checked (no second lookup to rebind) |
//! | a redirect to another host, or from https to http | refused (same host only, at most [`REDIRECTS`]) |
//! | a reply that never ends, or is longer than the job said | cut at `size` + 1 bytes |
//! | a slow reply | `fetch_timeout` to connect, for the reply's head and between reads; the whole fetch within `fetch_timeout` + size ÷ `min_rate` |
//! | many large files at once | the spool's byte budget (`attachments.inflight_bytes`): a job waits for room for all its files at once, never for part of it (jobs holding part of their room could each wait for the rest forever) |
//!
//! The bytes are hashed as they arrive and checked against the job's `size` and
//! `sha256`: a mismatch is the job's fault (dead letter naming the attachment), and
//! so are 401, 403, 404 and 410. 5xx, 408, 429, timeouts and a store that cannot be
//! reached are not ([`SendError::Unavailable`]): the job waits in the retry ladder,
//! one step longer each time (`postie-store-waits`), never counted as an attempt and
//! never dead-lettered for an outage; only the jobs that need that store wait, and the
//! transport's breaker does not count it.
//!
//! A spooled file is created unlinked (`O_TMPFILE` where the system has it): it is
//! gone when its last handle closes, even after a crash.

use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::os::unix::fs::FileExt as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use address::{is_public, Checked};

use super::stream::Content;
use super::SendError;
use crate::config::AttachmentSettings;
use crate::contract::{Attachment, EmailJob, Source};

/// The most redirects one fetch follows (same host only).
const REDIRECTS: usize = 5;
/// The budget's unit: permits are KiB, so a budget of terabytes still fits.
const UNIT: u64 = 1024;

/// A fetched attachment in the spool, holding its job's room in the byte budget
/// (given back when the job's last file is let go).
pub(crate) struct Spooled {
    file: std::fs::File,
    len: u64,
    _room: Arc<OwnedSemaphorePermit>,
}

impl Spooled {
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    /// `file` as a spooled attachment of `len` bytes, in a budget of its own: for
    /// tests of what reads it (a file shorter than `len` is a spool that fails).
    #[cfg(test)]
    pub(crate) fn of_file(file: std::fs::File, len: u64) -> Self {
        let room = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        Self {
            file,
            len,
            _room: Arc::new(room),
        }
    }
}

type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<HttpConnector<Checked>>,
    Empty<Bytes>,
>;

mod address;
mod s3;

/// Fetches `url` and `s3` attachments under `attachments.*`.
pub(crate) struct Fetcher {
    client: Client,
    s3: s3::Buckets,
    settings: AttachmentSettings,
    budget: Arc<Semaphore>,
}

impl Fetcher {
    /// The fetcher of `settings`. When files may be fetched (`url_hosts` or
    /// `s3.buckets` set), the spool must take a file: a directory that is missing
    /// or not writable stops start-up here, where otherwise every job naming a file
    /// would wait in the retry ladder for ever (an outage never dead-letters it).
    pub(crate) fn new(settings: &AttachmentSettings) -> anyhow::Result<Self> {
        if !settings.url_hosts.is_empty() || !settings.s3.buckets.is_empty() {
            let dir = settings.spool();
            tempfile::tempfile_in(&dir).map_err(|e| {
                anyhow::anyhow!(
                    "attachments.spool_dir ({}): cannot create a spool file there: {e}",
                    dir.display()
                )
            })?;
        }
        let mut http = HttpConnector::new_with_resolver(Checked {
            allow_private: settings.allow_private_addresses,
        });
        http.set_connect_timeout(Some(settings.fetch_timeout));
        http.enforce_http(false);
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(4)
            .pool_idle_timeout(Duration::from_secs(30))
            .build(crate::ops::https::wrap(http)?);
        let units = settings.inflight_bytes.div_ceil(UNIT);
        Ok(Self {
            client,
            s3: s3::Buckets::new(&settings.s3, settings.fetch_timeout),
            settings: settings.clone(),
            budget: Arc::new(Semaphore::new(
                units.min(Semaphore::MAX_PERMITS as u64) as usize
            )),
        })
    }

    /// The job's attachments' bytes, in order: inline ones as they are, `url` and
    /// `s3` ones fetched into the spool and checked. The spool's room for all of
    /// them is taken first, at once. The first failure stops it (and what was
    /// spooled is let go, and its room).
    pub(crate) async fn fetch(&self, job: &EmailJob) -> Result<Vec<Content>, SendError> {
        let fetched: u64 = (job.attachments.iter())
            .filter(|a| !matches!(a.source, Source::Inline(_)))
            .map(|a| a.size)
            .sum();
        let room = Arc::new(self.room(fetched).await?);
        let mut contents = Vec::with_capacity(job.attachments.len());
        for (at, attachment) in job.attachments.iter().enumerate() {
            let content = match &attachment.source {
                Source::Inline(bytes) => Content::Memory(bytes.clone()),
                Source::Url(url) => {
                    let spooled = self.url(attachment, url, room.clone()).await;
                    let spooled = spooled.map_err(|f| f.into_error(&attachment.named(at)))?;
                    Content::Spooled(Arc::new(spooled))
                }
                Source::S3 { bucket, key } => {
                    let spooled = self.s3_object(attachment, bucket, key, room.clone()).await;
                    let spooled = spooled.map_err(|f| f.into_error(&attachment.named(at)))?;
                    Content::Spooled(Arc::new(spooled))
                }
            };
            contents.push(content);
        }
        Ok(contents)
    }

    /// What sending `bytes` of attachments may take, at `attachments.min_rate`.
    pub(crate) fn transfer_time(&self, bytes: u64) -> Duration {
        self.settings.transfer_time(bytes)
    }

    /// One `url` attachment into the spool, in `room`.
    async fn url(
        &self,
        attachment: &Attachment,
        url: &url::Url,
        room: Arc<OwnedSemaphorePermit>,
    ) -> Result<Spooled, Failure> {
        let mut url = url.clone();
        let origin = (
            url.scheme().to_string(),
            url.host_str().unwrap_or("").to_string(),
        );
        self.check(&url).await?;
        let deadline = Instant::now()
            + self.settings.fetch_timeout
            + self.settings.transfer_time(attachment.size);
        for _ in 0..=REDIRECTS {
            let request = http::Request::get(url.as_str())
                .header(http::header::USER_AGENT, "postie")
                .body(Empty::new())
                .map_err(|e| Failure::Job(format!("cannot ask for {}: {e}", shown(&url))))?;
            let head =
                tokio::time::timeout(self.settings.fetch_timeout, self.client.request(request))
                    .await
                    .map_err(|_| {
                        Failure::Outage(format!("{} did not answer in time", shown(&url)))
                    })?
                    .map_err(|e| {
                        Failure::Outage(format!("{}: {}", shown(&url), crate::error_chain(&e)))
                    })?;
            let status = head.status();
            if status.is_redirection() {
                url = redirected(&url, &head, &origin)?;
                self.check(&url).await?;
                continue;
            }
            return match status.as_u16() {
                200 => {
                    let body = http_body_util::BodyDataStream::new(head.into_body())
                        .map(|chunk| chunk.map_err(|e| crate::error_chain(&e)));
                    self.spool(body, attachment, room, deadline).await
                }
                401 | 403 | 404 | 410 => {
                    Err(Failure::Job(format!("{} answered {status}", shown(&url))))
                }
                408 | 429 | 500..=599 => Err(Failure::Outage(format!(
                    "{} answered {status}",
                    shown(&url)
                ))),
                _ => Err(Failure::Job(format!("{} answered {status}", shown(&url)))),
            };
        }
        Err(Failure::Job(format!(
            "more than {REDIRECTS} redirects, the last to {}",
            shown(&url)
        )))
    }

    /// One `s3` attachment into the spool, in `room`.
    async fn s3_object(
        &self,
        attachment: &Attachment,
        bucket: &str,
        key: &str,
        room: Arc<OwnedSemaphorePermit>,
    ) -> Result<Spooled, Failure> {
        let deadline = Instant::now()
            + self.settings.fetch_timeout
            + self.settings.transfer_time(attachment.size);
        let body = self.s3.get(bucket, key).await?;
        self.spool(body, attachment, room, deadline).await
    }

    /// Room in the spool for `size` bytes (none for none), a job's files together (waits, first
    /// come first served, for others to finish: a job's files are at most
    /// `attachments.max_total_bytes`, which the budget is at least, so it comes).
    async fn room(&self, size: u64) -> Result<OwnedSemaphorePermit, SendError> {
        let units = u32::try_from(size.div_ceil(UNIT)).unwrap_or(u32::MAX);
        self.budget
            .clone()
            .acquire_many_owned(units)
            .await
            .map_err(|_| SendError::Unavailable("the attachments' spool is closed".into()))
    }

    /// The URL's host is allowed and, unless private addresses are, every address it
    /// names is public.
    async fn check(&self, url: &url::Url) -> Result<(), Failure> {
        let host = url.host_str().unwrap_or("");
        if !self.settings.host_allowed(host) {
            return Err(Failure::Job(format!(
                "{} is not on attachments.url_hosts",
                shown(url)
            )));
        }
        if self.settings.allow_private_addresses {
            return Ok(());
        }
        let port = url.port_or_known_default().unwrap_or(443);
        let addresses: Vec<SocketAddr> = match url.host() {
            Some(url::Host::Ipv4(ip)) => vec![SocketAddr::new(ip.into(), port)],
            Some(url::Host::Ipv6(ip)) => vec![SocketAddr::new(ip.into(), port)],
            _ => tokio::time::timeout(
                self.settings.fetch_timeout,
                tokio::net::lookup_host((host, port)),
            )
            .await
            .map_err(|_| Failure::Outage(format!("looking up {host} took too long")))?
            .map_err(|e| Failure::Outage(format!("looking up {host}: {e}")))?
            .collect(),
        };
        match addresses.iter().find(|a| !is_public(a.ip())) {
            Some(private) => Err(Failure::Job(format!(
                "{} is at a non-public address ({}); attachments.allow_private_addresses is off",
                shown(url),
                private.ip()
            ))),
            None => Ok(()),
        }
    }

    /// Reads the reply into an unlinked spool file, hashing as it goes; at most
    /// `size` + 1 bytes are read.
    async fn spool(
        &self,
        mut body: impl futures_util::Stream<Item = Result<Bytes, String>> + Unpin,
        attachment: &Attachment,
        room: Arc<OwnedSemaphorePermit>,
        deadline: Instant,
    ) -> Result<Spooled, Failure> {
        let dir = self.settings.spool();
        let mut file = tempfile::tempfile_in(&dir).map_err(|e| {
            Failure::Outage(format!(
                "cannot create a spool file in {}: {e}",
                dir.display()
            ))
        })?;
        let mut hash = Sha256::new();
        let mut len = 0u64;
        loop {
            let idle = self.settings.fetch_timeout;
            let wait = idle.min(deadline.saturating_duration_since(Instant::now()));
            let data = match tokio::time::timeout(wait, body.next()).await {
                Err(_) => return Err(Failure::Outage("the file's bytes stopped coming".into())),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(Failure::Outage(format!("the file broke off: {e}")))
                }
                Ok(Some(Ok(data))) => data,
            };
            len += data.len() as u64;
            if len > attachment.size {
                return Err(Failure::Job(format!(
                    "is longer than its size ({} bytes)",
                    attachment.size
                )));
            }
            hash.update(&data);
            file.write_all(&data)
                .map_err(|e| Failure::Outage(format!("writing the spool: {e}")))?;
        }
        if len != attachment.size {
            return Err(Failure::Job(format!(
                "is {len} bytes where its size says {}",
                attachment.size
            )));
        }
        if hash.finalize().as_slice() != attachment.sha256 {
            return Err(Failure::Job(
                "has bytes whose SHA-256 is not its sha256".into(),
            ));
        }
        Ok(Spooled {
            file,
            len,
            _room: room,
        })
    }
}

/// A fetch that failed: the job's fault, or the store's.
#[derive(Debug)]
pub(super) enum Failure {
    Job(String),
    Outage(String),
}

impl Failure {
    /// A send failure naming the attachment: permanent when it is the job's fault,
    /// transient (retried with backoff) when it is the store's.
    fn into_error(self, named: &str) -> SendError {
        match self {
            Self::Job(why) => SendError::Permanent(format!("{named}: {why}")),
            Self::Outage(why) => SendError::Unavailable(format!("{named}: fetching: {why}")),
        }
    }
}

/// The redirect's target, if it stays on the host (and does not leave https).
fn redirected<B>(
    from: &url::Url,
    head: &http::Response<B>,
    origin: &(String, String),
) -> Result<url::Url, Failure> {
    let location = head
        .headers()
        .get(http::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Failure::Job(format!("{} redirected nowhere", shown(from))))?;
    let to = from
        .join(location)
        .map_err(|_| Failure::Job(format!("{} redirected to a bad URL", shown(from))))?;
    let same_host = to.host_str() == Some(origin.1.as_str());
    let scheme_kept = to.scheme() == origin.0 || (origin.0 == "http" && to.scheme() == "https");
    if !same_host || !scheme_kept || !to.username().is_empty() {
        return Err(Failure::Job(format!(
            "{} redirected to {}, another host or scheme: refused",
            shown(from),
            shown(&to)
        )));
    }
    Ok(to)
}

/// A URL as reasons and logs show it: scheme, host, port and path, never its query
/// (a presigned URL's signature lives there).
fn shown(url: &url::Url) -> String {
    let mut shown = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
    if let Some(port) = url.port() {
        shown.push_str(&format!(":{port}"));
    }
    shown.push_str(url.path());
    crate::contract::readable(&shown, 200)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn private_addresses_are_refused_unless_allowed() {
        let settings = AttachmentSettings {
            url_hosts: vec!["localhost".into(), "127.0.0.1".into(), "[::1]".into()],
            ..AttachmentSettings::default()
        };
        let fetcher = Fetcher::new(&settings).unwrap();
        for url in [
            "http://localhost:9/a",
            "http://127.0.0.1:9/a",
            "http://[::1]:9/a",
        ] {
            let url = url::Url::parse(url).unwrap();
            match fetcher.check(&url).await {
                Err(Failure::Job(why)) => assert!(why.contains("non-public address"), "{why}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        let not_listed = url::Url::parse("https://files.example/a").unwrap();
        assert!(
            matches!(fetcher.check(&not_listed).await, Err(Failure::Job(why)) if why.contains("url_hosts"))
        );
        let allowed = Fetcher::new(&AttachmentSettings {
            allow_private_addresses: true,
            ..settings
        })
        .unwrap();
        assert!(allowed
            .check(&url::Url::parse("http://localhost:9/a").unwrap())
            .await
            .is_ok());
    }

    #[test]
    fn a_shown_url_has_no_query() {
        let url =
            url::Url::parse("https://files.example:8443/a/b.pdf?X-Amz-Signature=secret").unwrap();
        assert_eq!(shown(&url), "https://files.example:8443/a/b.pdf");
    }

    #[test]
    fn redirects_stay_on_the_host_and_on_https() {
        let from = url::Url::parse("https://files.example/a").unwrap();
        let origin = ("https".to_string(), "files.example".to_string());
        let to = |location: &str| {
            let head = http::Response::builder()
                .status(302)
                .header("location", location)
                .body(())
                .unwrap();
            redirected(&from, &head, &origin)
        };
        assert_eq!(to("/b").unwrap().as_str(), "https://files.example/b");
        assert!(matches!(
            to("https://other.example/b"),
            Err(Failure::Job(_))
        ));
        assert!(matches!(to("http://files.example/b"), Err(Failure::Job(_))));
        assert!(matches!(to("http://127.0.0.1:9/b"), Err(Failure::Job(_))));
    }
}
