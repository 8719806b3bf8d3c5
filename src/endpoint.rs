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
