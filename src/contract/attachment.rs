//! A job's `attachments`: what each file is (name, type, size, SHA-256), where its
//! bytes come from (`inline` in the body, or a `url` or an `s3` object fetched at send
//! time) and how it is shown (`attachment`, or `inline` with a `content_id` for an
//! HTML `cid:` image).
//!
//! Everything a producer can get wrong without postie fetching anything is refused
//! here, with the attachment's position and name in the reason: a bad filename or
//! type, a size over the limits, a digest that is not 64 hex digits, inline bytes
//! that do not match their `size` and `sha256`, a `url` that is not `https` (or
//! `http` to a loopback address). Whether a URL's host may be fetched from is the
//! sender's rule (`attachments.url_hosts`), checked at send time.

use std::sync::Arc;

use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{invalid, is_line_breaking, InvalidJob};

/// The limits a job's attachments must keep (`attachments.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachmentLimits {
    /// Most files on one job.
    pub max_count: usize,
    /// Largest file, in bytes (before encoding).
    pub max_file_bytes: u64,
    /// Largest sum of one job's files, in bytes (before encoding).
    pub max_total_bytes: u64,
}

impl AttachmentLimits {
    /// The defaults (`attachments.*`'s): 10 files, 20 MiB each and together.
    pub const DEFAULT: Self = Self {
        max_count: crate::config::DEFAULT_MAX_COUNT,
        max_file_bytes: crate::config::DEFAULT_MAX_BYTES,
        max_total_bytes: crate::config::DEFAULT_MAX_BYTES,
    };

    /// The limits `settings` set.
    pub(crate) fn of(settings: &crate::config::AttachmentSettings) -> Self {
        Self {
            max_count: settings.max_count,
            max_file_bytes: settings.max_file_bytes,
            max_total_bytes: settings.max_total_bytes,
        }
    }
}

/// One file a job's email carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The name the recipient sees (no path, no line break).
    pub filename: String,
    /// Its MIME type, as given (`text/calendar; method=REQUEST` included).
    pub content_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, 32 bytes.
    pub sha256: [u8; 32],
    /// Where its bytes come from.
    pub source: Source,
    /// `inline` (with a Content-ID, for `cid:` in the HTML) or an attachment.
    pub content_id: Option<String>,
}

impl Attachment {
    /// Its digest as lower-case hex.
    pub fn sha256_hex(&self) -> String {
        hex::encode(self.sha256)
    }

    /// How the reasons name it: `attachments[1] ("invoice.pdf")`.
    pub(crate) fn named(&self, at: usize) -> String {
        format!("attachments[{at}] ({:?})", self.filename)
    }
}

/// Where an attachment's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// In the body, base64: decoded and checked when the job is read.
    Inline(Arc<[u8]>),
    /// Fetched at send time (`https`, or `http` to a loopback address).
    Url(url::Url),
    /// An object of an S3-compatible store postie is configured for
    /// (`attachments.s3`), fetched at send time.
    S3 {
        /// The bucket (one of `attachments.s3.buckets`, checked at send time).
        bucket: String,
        /// The object's key.
        key: String,
    },
}

/// An attachment as producers write it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAttachment {
    filename: String,
    content_type: String,
    size: u64,
    sha256: String,
    source: RawSource,
    #[serde(default)]
    disposition: Option<String>,
    #[serde(default)]
    content_id: Option<String>,
}

/// A source as producers write it: exactly one member.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum RawSource {
    Inline(String),
    Url(String),
    S3(RawS3),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawS3 {
    bucket: String,
    key: String,
}

/// Reads and checks a job's `attachments` under `limits`.
pub(super) fn read_all(
    raw: Vec<RawAttachment>,
    limits: &AttachmentLimits,
) -> Result<Vec<Attachment>, InvalidJob> {
    if raw.len() > limits.max_count {
        return invalid(format!(
            "{} attachments, over the limit of {}",
            raw.len(),
            limits.max_count
        ));
    }
    let mut total = 0u64;
    let mut read = Vec::with_capacity(raw.len());
    for (at, one) in raw.into_iter().enumerate() {
        // `attachments[1] ("invoice.pdf") is …`, as the sender names it too.
        let attachment = one.read(limits).map_err(|InvalidJob(why)| {
            let join = if why.starts_with('(') { " " } else { ": " };
            InvalidJob(format!("attachments[{at}]{join}{why}"))
        })?;
        total = total.saturating_add(attachment.size);
        read.push(attachment);
    }
    if total > limits.max_total_bytes {
        return invalid(format!(
            "the attachments come to {total} bytes, over the limit of {} per email",
            limits.max_total_bytes
        ));
    }
    let mut ids: Vec<&str> = read
        .iter()
        .filter_map(|a| a.content_id.as_deref())
        .collect();
    ids.sort_unstable();
    if let Some(twice) = ids.windows(2).find(|pair| pair[0] == pair[1]) {
        return invalid(format!("two attachments have content_id {:?}", twice[0]));
    }
    Ok(read)
}

impl RawAttachment {
    fn read(self, limits: &AttachmentLimits) -> Result<Attachment, InvalidJob> {
        check_filename(&self.filename)?;
        let quoted = format!("({:?})", self.filename);
        let within = |why: InvalidJob| InvalidJob(format!("{quoted} {}", why.0));
        check_content_type(&self.content_type).map_err(within)?;
        if self.size > limits.max_file_bytes {
            return invalid(format!(
                "{quoted} is {} bytes, over the limit of {} per file",
                self.size, limits.max_file_bytes
            ));
        }
        let sha256 = parse_sha256(&self.sha256).map_err(within)?;
        let content_id = match (self.disposition.as_deref(), self.content_id) {
            (None | Some("attachment"), None) => None,
            (None | Some("attachment"), Some(_)) => {
                return Err(within(InvalidJob(
                    "has a content_id: give it \"disposition\": \"inline\"".into(),
                )))
            }
            (Some("inline"), Some(id)) => {
                check_content_id(&id).map_err(within)?;
                Some(id)
            }
            (Some("inline"), None) => {
                return Err(within(InvalidJob(
                    "is inline without a content_id for the HTML to refer to (cid:…)".into(),
                )))
            }
            (Some(other), _) => {
                return Err(within(InvalidJob(format!(
                    "has disposition {:?}: \"attachment\" or \"inline\"",
                    other.chars().take(40).collect::<String>()
                ))))
            }
        };
        let source = match self.source {
            RawSource::Inline(text) => {
                Source::Inline(inline_bytes(&text, self.size, &sha256).map_err(within)?)
            }
            RawSource::Url(text) => Source::Url(check_url(&text).map_err(within)?),
            RawSource::S3(RawS3 { bucket, key }) => {
                check_s3(&bucket, &key).map_err(within)?;
                Source::S3 { bucket, key }
            }
        };
        Ok(Attachment {
            filename: self.filename,
            content_type: self.content_type,
            size: self.size,
            sha256,
            source,
            content_id,
        })
    }
}

/// A name the recipient's mail program can save: 1–255 bytes, no path separator, no
/// control character, not `.` or `..`.
fn check_filename(name: &str) -> Result<(), InvalidJob> {
    let shown = name.chars().take(60).collect::<String>();
    if name.is_empty() || name.len() > 255 {
        return invalid(format!("filename {shown:?} must be 1-255 bytes"));
    }
    if name == "." || name == ".." || name.contains(['/', '\\']) {
        return invalid(format!("filename {shown:?} must be a name, not a path"));
    }
    if name.chars().any(|c| c.is_control() || is_line_breaking(c)) {
        return invalid(format!("filename {shown:?} holds a control character"));
    }
    Ok(())
}

/// `type/subtype` and parameters, as lettre reads a Content-Type; a calendar
/// invitation (`text/calendar`) names its `method`.
fn check_content_type(text: &str) -> Result<(), InvalidJob> {
    let shown = text.chars().take(80).collect::<String>();
    if text.len() > 200 || text.chars().any(|c| c.is_control() || is_line_breaking(c)) {
        return invalid(format!(
            "has content_type {shown:?}: at most 200 bytes, one line"
        ));
    }
    let parsed: mime::Mime = text
        .parse()
        .map_err(|_| InvalidJob(format!("has content_type {shown:?}, not a MIME type")))?;
    lettre::message::header::ContentType::parse(text)
        .map_err(|_| InvalidJob(format!("has content_type {shown:?}, not a MIME type")))?;
    let essence = parsed.essence_str().to_ascii_lowercase();
    if essence.starts_with("multipart/") || essence.starts_with("message/") {
        return invalid(format!(
            "has content_type {shown:?}: a file, not a multipart or message"
        ));
    }
    if essence == "text/calendar" {
        let method = parsed
            .get_param("method")
            .map(|m| m.as_str().to_ascii_uppercase());
        const METHODS: [&str; 4] = ["REQUEST", "CANCEL", "PUBLISH", "REPLY"];
        if !method.as_deref().is_some_and(|m| METHODS.contains(&m)) {
            return invalid(format!(
                "has content_type {shown:?}: a calendar names its method \
                 (text/calendar; method=REQUEST, CANCEL, PUBLISH or REPLY)"
            ));
        }
    }
    Ok(())
}

/// 64 hex digits, either case.
fn parse_sha256(text: &str) -> Result<[u8; 32], InvalidJob> {
    let mut digest = [0u8; 32];
    match hex::decode_to_slice(text, &mut digest) {
        Ok(()) => Ok(digest),
        Err(_) => invalid("has a sha256 that is not 64 hex digits"),
    }
}

/// A Content-ID without its angle brackets: `local@domain`-like, printable ASCII.
fn check_content_id(id: &str) -> Result<(), InvalidJob> {
    let fine = !id.is_empty()
        && id.len() <= 200
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"<>\"\\()[],;:".contains(&b));
    if !fine {
        return invalid(format!(
            "has content_id {:?}: 1-200 printable ASCII characters, no brackets or quotes",
            id.chars().take(60).collect::<String>()
        ));
    }
    Ok(())
}

/// The inline bytes, decoded and checked against what the job says of them.
fn inline_bytes(text: &str, size: u64, sha256: &[u8; 32]) -> Result<Arc<[u8]>, InvalidJob> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.as_bytes())
        .map_err(|e| InvalidJob(format!("has inline bytes that are not base64: {e}")))?;
    if bytes.len() as u64 != size {
        return invalid(format!(
            "has {} inline bytes where size says {size}",
            bytes.len()
        ));
    }
    if Sha256::digest(&bytes).as_slice() != sha256 {
        return invalid("has inline bytes whose SHA-256 is not its sha256");
    }
    Ok(bytes.into())
}

/// A bucket name as S3 allows it (3-63 lower-case letters, digits, `.` and `-`) and
/// a key of 1-1024 bytes without control characters.
fn check_s3(bucket: &str, key: &str) -> Result<(), InvalidJob> {
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    if !bucket_ok {
        return invalid(format!(
            "has s3 bucket {:?}: 3-63 lower-case letters, digits, '.' or '-'",
            bucket.chars().take(70).collect::<String>()
        ));
    }
    if key.is_empty() || key.len() > 1024 || key.chars().any(char::is_control) {
        return invalid("has an s3 key that is not 1-1024 bytes without control characters");
    }
    Ok(())
}

/// An absolute `https` URL (or `http` to a loopback address), without credentials:
/// a producer's password would end up in logs and dead letters.
fn check_url(text: &str) -> Result<url::Url, InvalidJob> {
    let shown = super::readable(text, 120);
    let url = url::Url::parse(text).map_err(|e| InvalidJob(format!("has url {shown:?}: {e}")))?;
    if !url.username().is_empty() || url.password().is_some() {
        return invalid("has a url with credentials in it: the store must not need them");
    }
    match url.scheme() {
        "https" => {}
        "http" if crate::endpoint::is_loopback_host(url.host_str().unwrap_or("")) => {}
        _ => {
            return invalid(format!(
                "has url {shown:?}: https only (http only to a loopback address)"
            ))
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return invalid(format!("has url {shown:?} without a host"));
    }
    Ok(url)
}

#[cfg(test)]
mod tests;
