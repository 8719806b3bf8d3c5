//! `attachments.*`: what a job's files may be, where `url` sources may be fetched
//! from, and how much of them an instance holds at once.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::de::duration;

/// `attachments.max_count`'s default.
pub const DEFAULT_MAX_COUNT: usize = 10;
/// `attachments.max_file_bytes`' and `max_total_bytes`' default: 20 MiB, which every
/// provider postie speaks to but Postmark takes once base64-encoded (about 27 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 20 * 1024 * 1024;

/// Attachments: the contract's limits, the fetcher's rules and the spool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttachmentSettings {
    /// Most files on one job (default 10).
    pub max_count: usize,
    /// Largest file in bytes, before base64 (default 20 MiB).
    pub max_file_bytes: u64,
    /// Largest sum of one job's files in bytes, before base64 (default 20 MiB).
    pub max_total_bytes: u64,
    /// Hosts `url` sources may name (exact names, or `*.example.com` for its
    /// subdomains; an IPv6 address in brackets, as URLs write it). Empty (the default): no `url` source is fetched, and a job
    /// naming one is dead-lettered with the reason.
    pub url_hosts: Vec<String>,
    /// Fetch from private, loopback, link-local and other non-public addresses
    /// (default false): an attacker who can publish jobs must not be able to make
    /// postie read the cloud's metadata service or an internal admin page.
    pub allow_private_addresses: bool,
    /// The most one fetch may wait for a connection, for the reply's head, or for
    /// its next bytes (default 10 s).
    #[serde(deserialize_with = "duration")]
    pub fetch_timeout: Duration,
    /// The slowest transfer postie waits for, in bytes a second (default 256 KiB/s):
    /// a fetch of n bytes may take `fetch_timeout` + n ÷ this, and a send with
    /// attachments `transport.timeout` × 2 + its encoded size ÷ this. A send that
    /// runs out of it after its body went out is uncertain (sent again, at least
    /// once), so it is a floor, not an expectation.
    pub min_rate: u64,
    /// Bytes of fetched files an instance holds at once in its spool (default 256
    /// MiB: twelve 20 MiB files); a job whose files do not fit waits for others to
    /// be sent. It also bounds how many large emails an instance sends at once, so
    /// that each keeps a fair share of the link. At least `max_total_bytes`.
    pub inflight_bytes: u64,
    /// Where fetched files are spooled (default: the system's temporary
    /// directory). Files are unlinked as they are created: nothing is left behind,
    /// even by a crash.
    pub spool_dir: Option<PathBuf>,
    /// The S3-compatible store `s3` sources are read from.
    pub s3: S3Settings,
}

/// `attachments.s3.*`: the store `{"s3": {"bucket", "key"}}` sources name. Its
/// credentials come from the usual `AWS_*` environment variables.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Settings {
    /// Buckets jobs may name (none by default: no `s3` source is read).
    pub buckets: Vec<String>,
    /// The region (default: `AWS_REGION`, else `us-east-1`).
    pub region: Option<String>,
    /// A store other than AWS's (MinIO, Ceph, moto): its base URL, `https://`, or
    /// `http://` to a loopback address; requests are then path-style.
    pub endpoint: Option<String>,
}

impl Default for AttachmentSettings {
    fn default() -> Self {
        Self {
            max_count: DEFAULT_MAX_COUNT,
            max_file_bytes: DEFAULT_MAX_BYTES,
            max_total_bytes: DEFAULT_MAX_BYTES,
            url_hosts: Vec::new(),
            allow_private_addresses: false,
            fetch_timeout: Duration::from_secs(10),
            min_rate: 256 * 1024,
            inflight_bytes: 256 << 20,
            spool_dir: None,
            s3: S3Settings::default(),
        }
    }
}

impl AttachmentSettings {
    /// Where fetched files go.
    pub(crate) fn spool(&self) -> PathBuf {
        self.spool_dir.clone().unwrap_or_else(std::env::temp_dir)
    }

    /// How long moving `bytes` may take at `min_rate`.
    pub(crate) fn transfer_time(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
    }

    /// Whether `host` is on `url_hosts`.
    pub(crate) fn host_allowed(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.url_hosts.iter().any(|allowed| {
            let allowed = allowed.to_ascii_lowercase();
            match allowed.strip_prefix("*.") {
                Some(parent) => host.ends_with(&format!(".{parent}")),
                None => host == allowed,
            }
        })
    }

    pub(super) fn check(&self) -> Result<(), String> {
        if self.max_count == 0 || self.max_file_bytes == 0 || self.max_total_bytes == 0 {
            return Err(
                "attachments.max_count, max_file_bytes and max_total_bytes must be above zero"
                    .into(),
            );
        }
        if self.max_count > 100 {
            return Err("attachments.max_count must be at most 100".into());
        }
        if self.inflight_bytes < self.max_total_bytes {
            return Err(format!(
                "attachments.inflight_bytes ({}) must be at least attachments.max_total_bytes ({}): \
                 a job's files must fit in the spool",
                self.inflight_bytes, self.max_total_bytes
            ));
        }
        if self.fetch_timeout.is_zero() || self.min_rate < 1024 {
            return Err(
                "attachments.fetch_timeout must be above zero and attachments.min_rate at least 1024 (bytes a second)"
                    .into(),
            );
        }
        if let Some(endpoint) = &self.s3.endpoint {
            let fine = endpoint.starts_with("https://")
                || url::Url::parse(endpoint).is_ok_and(|u| {
                    u.scheme() == "http"
                        && crate::endpoint::is_loopback_host(u.host_str().unwrap_or(""))
                });
            if !fine {
                return Err(format!(
                    "attachments.s3.endpoint {endpoint:?}: https://, or http:// to a loopback address"
                ));
            }
        }
        for host in &self.url_hosts {
            let name = host.strip_prefix("*.").unwrap_or(host);
            let fine = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
            if !fine {
                return Err(format!(
                    "attachments.url_hosts: {host:?} is not a host name (or *.domain)"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_exactly_or_as_subdomains() {
        let settings = AttachmentSettings {
            url_hosts: vec!["files.shop.example".into(), "*.cdn.example".into()],
            ..AttachmentSettings::default()
        };
        assert!(settings.host_allowed("files.shop.example"));
        assert!(settings.host_allowed("FILES.shop.example."));
        assert!(settings.host_allowed("eu.cdn.example"));
        assert!(!settings.host_allowed("cdn.example"));
        assert!(!settings.host_allowed("evilcdn.example"));
        assert!(!settings.host_allowed("files.shop.example.evil.example"));
        assert!(!AttachmentSettings::default().host_allowed("files.shop.example"));
    }

    #[test]
    fn the_spool_must_hold_one_job() {
        let settings = AttachmentSettings {
            inflight_bytes: 1024,
            ..AttachmentSettings::default()
        };
        assert!(settings.check().unwrap_err().contains("inflight_bytes"));
        assert!(AttachmentSettings::default().check().is_ok());
    }
}
