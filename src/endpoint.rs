//! Addresses of the services postie talks to: is a host this machine, and how to
//! show a connection URL without its password. A leaf: it imports nothing of postie's.

use std::net::IpAddr;

/// A URL with its password (and any `password=` query or key=value part) replaced by `***`.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(mut url) if url.password().is_some() => {
            let _ = url.set_password(Some("***"));
            url.to_string()
        }
        Ok(url) => url.to_string(),
        // libpq key=value strings: hide the value of password=…
        Err(_) => raw
            .split_whitespace()
            .map(|part| {
                if part.to_ascii_lowercase().starts_with("password=") {
                    "password=***"
                } else {
                    part
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// The addresses of a comma-separated list of URLs (`amqp.url` may name every node
/// of a cluster), trimmed, empty entries dropped. A comma inside a password must be
/// written `%2C`.
pub fn split_urls(raw: &str) -> Vec<&str> {
    raw.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// A comma-separated list of URLs, each redacted on its own ([`redact_one`]), joined
/// by `", "`. Safe for one URL too.
pub fn redact_url_list(raw: &str) -> String {
    split_urls(raw)
        .into_iter()
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One address of a list, without its password. Unlike [`redact_url`], a piece that
/// does not parse as a URL keeps only its scheme and what follows its last `@`: it may
/// be half of a password that held a raw comma.
pub fn redact_one(raw: &str) -> String {
    if url::Url::parse(raw).is_ok() {
        return redact_url(raw);
    }
    let (scheme, rest) = match raw.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), raw),
    };
    match rest.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}***@{host}"),
        None if scheme.is_empty() => "***".into(),
        None => format!("{scheme}***"),
    }
}

/// True if `host` is this machine: an address in 127.0.0.0/8, `::1` (bracketed or not,
/// or IPv4-mapped), the name `localhost`, or a Unix socket directory (an absolute path).
/// Any other name counts as remote, even one that happens to resolve to a loopback
/// address: the decision must not depend on DNS.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim();
    if host.starts_with('/') {
        return true;
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let bare = bare.strip_suffix('.').unwrap_or(bare);
    if bare.eq_ignore_ascii_case("localhost") {
        return true;
    }
    bare.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// `%XX` escapes decoded (and nothing else: `+` stays `+`).
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_in_urls_and_key_value_strings() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            redact_url("host=db user=app password=s3cret"),
            "host=db user=app password=***"
        );
        assert_eq!(redact_url("smtp://127.0.0.1:1025"), "smtp://127.0.0.1:1025");
    }

    #[test]
    fn url_lists_are_split_and_each_address_redacted_on_its_own() {
        let list = "amqp://u:SECRETPW1@10.0.0.1:5672/%2f, amqp://u:SECRETPW2@10.0.0.2/%2f,,\
                    amqps://v:SECRETPW3@rmq-3.example:5671/prod?heartbeat=5";
        assert_eq!(split_urls(list).len(), 3);
        let shown = redact_url_list(list);
        assert_eq!(
            shown,
            "amqp://u:***@10.0.0.1:5672/%2f, amqp://u:***@10.0.0.2/%2f, \
             amqps://v:***@rmq-3.example:5671/prod?heartbeat=5"
        );
        // A raw comma in a password splits it; neither half may show.
        let shown = redact_url_list("amqp://u:pa,ss@host/%2f,amqp://u:SECRETPW4@h:1");
        assert!(!shown.contains("pa") && !shown.contains("ss@"), "{shown}");
        assert!(!shown.contains("SECRETPW4"), "{shown}");
        assert_eq!(redact_one("not a url"), "***");
        assert_eq!(redact_one("amqp://u:p@h:notaport"), "amqp://***@h:notaport");
        assert_eq!(redact_url_list("amqp://h"), "amqp://h");
        assert!(split_urls(" , ").is_empty());
    }

    #[test]
    fn loopback_hosts_are_told_apart_without_dns() {
        for (host, local) in [
            ("127.0.0.1", true),
            ("127.5.5.5", true),
            ("127.255.255.254", true),
            ("::1", true),
            ("[::1]", true),
            ("::ffff:127.0.0.1", true),
            ("localhost", true),
            ("LocalHost", true),
            ("localhost.", true),
            ("/var/run/postgresql", true),
            ("/tmp", true),
            ("db.internal", false),
            ("10.0.0.5", false),
            ("192.168.1.10", false),
            ("128.0.0.1", false),
            ("0.0.0.0", false),
            ("::", false),
            ("fe80::1", false),
            ("localhost.example.com", false),
            ("db.localhost", false),
            ("127.0.0.1.example.com", false),
            ("", false),
        ] {
            assert_eq!(is_loopback_host(host), local, "{host:?}");
        }
    }
}
