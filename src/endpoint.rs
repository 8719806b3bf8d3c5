//! Addresses of the services postie talks to: is a host this machine, and how to
//! show a connection URL without its password. A leaf: it imports nothing of postie's.
//!
//! An address is shown without its secrets in every form it takes: a URL with any
//! number of hosts or a bad port, a libpq `key=value` string, or a comma-separated
//! list of them, each read on its own. It is read by hand, so that no parser's
//! refusal can print it. The passwords an address carries are also taken out, so
//! that every log line and the last error line can be scrubbed of them.

use std::net::IpAddr;
use std::ops::Range;

/// A connection address without its secrets: the password of a URL's user info
/// (`u:***@`), the value of every secret-looking query parameter (`?password=***`) and
/// of every secret-looking key of a libpq key=value string (`password='***'` becomes
/// `password=***`). It never fails and never needs the address to be valid: a URL that
/// no parser accepts (several hosts, `host:99999`, a raw `/` or `@` in the password)
/// is taken apart by hand, a port that is not a number in an address without user
/// info is shown as `***` (it may be half of a password), and what cannot be read at
/// all is `***`. Public for `tests/properties.rs` (arbitrary input, bounded time and
/// memory, no password shown).
///
/// A comma-separated list of URLs (`amqp.url` naming every node) is redacted address
/// by address: a comma followed by `scheme://` starts the next one.
pub fn redact_url(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut from = 0;
    for comma in list_commas(raw) {
        redact_one(&raw[from..comma], &mut out);
        out.push(',');
        from = comma + 1;
    }
    redact_one(&raw[from..], &mut out);
    out
}

/// One address of [`redact_url`], appended to `out` (spaces before it kept as they are).
fn redact_one(raw: &str, out: &mut String) {
    let trimmed = raw.trim_start();
    out.push_str(&raw[..raw.len() - trimmed.len()]);
    let raw = trimmed;
    let mut copied = 0;
    for span in secret_spans(raw) {
        out.push_str(&raw[copied..span.range.start]);
        out.push_str("***");
        copied = span.range.end;
    }
    out.push_str(&raw[copied..]);
}

/// The commas of `raw` that separate one URL from the next: each followed (after
/// spaces) by `scheme://`. A PostgreSQL URL's `host1,host2` has none.
fn list_commas(raw: &str) -> Vec<usize> {
    let starts_a_url = |rest: &str| {
        let rest = rest.trim_start();
        let scheme = rest
            .char_indices()
            .take_while(|(i, c)| match i {
                0 => c.is_ascii_alphabetic(),
                _ => c.is_ascii_alphanumeric() || "+-.".contains(*c),
            })
            .count();
        scheme > 0 && rest[scheme..].starts_with("://")
    };
    raw.match_indices(',')
        .map(|(i, _)| i)
        .filter(|&i| starts_a_url(&raw[i + 1..]))
        .collect()
}

/// The passwords in a connection address or a comma-separated list of them, as
/// written and percent-decoded (or unquoted), for scrubbing text a library may have
/// quoted them in (see [`scrub`]). Values shorter than 3 characters are left out:
/// replacing them everywhere would mangle the text and hide little. Public for
/// `tests/properties.rs`.
pub fn passwords(raw: &str) -> Vec<String> {
    let mut found = Vec::new();
    for piece in std::iter::once(raw).chain(split_urls(raw)) {
        for span in secret_spans(piece) {
            let Some(text) = span.value else { continue };
            let written = piece[span.range].to_string();
            for candidate in [percent_decode(&written), written, text] {
                if candidate.chars().count() >= 3 && !found.contains(&candidate) {
                    found.push(candidate);
                }
            }
        }
    }
    // The longest first, so that a password containing another is replaced whole.
    found.sort_by_key(|p| std::cmp::Reverse(p.len()));
    found
}

/// `text` with every one of `secrets` replaced by `***`.
pub fn scrub(text: &str, secrets: &[String]) -> String {
    secrets.iter().fold(text.to_string(), |text, secret| {
        text.replace(secret.as_str(), "***")
    })
}

/// The addresses of a comma-separated list of URLs (`amqp.url` may name every node
/// of a cluster), trimmed, empty entries dropped. A comma inside a password must be
/// written `%2C`.
pub(crate) fn split_urls(raw: &str) -> Vec<&str> {
    raw.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// A part of an address to hide.
struct Secret {
    /// Where it is, in bytes.
    range: Range<usize>,
    /// The password it holds, unescaped, when it is one; `None` for a part hidden only
    /// because it cannot be read (a port that is not a number, a malformed tail).
    value: Option<String>,
}

impl Secret {
    fn password(range: Range<usize>, value: String) -> Self {
        Self {
            range,
            value: Some(value),
        }
    }

    fn unreadable(range: Range<usize>) -> Self {
        Self { range, value: None }
    }
}

/// The secret parts of one address, in order, not overlapping.
fn secret_spans(raw: &str) -> Vec<Secret> {
    match url_scheme_end(raw) {
        Some(after_scheme) => url_secrets(raw, after_scheme),
        None => key_value_secrets(raw),
    }
}

/// Where the user info starts (after `scheme://`), if `raw` begins with a URL scheme.
fn url_scheme_end(raw: &str) -> Option<usize> {
    let (scheme, _) = raw.split_once("://")?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    valid.then_some(scheme.len() + 3)
}

/// The secrets of `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?query]`.
///
/// The user info ends at the authority's last `@`. When the authority has none but
/// the rest of the address has one, a raw `/`, `?` or `#` in the password cut the
/// authority short: everything up to the last `@` is hidden.
fn url_secrets(raw: &str, start: usize) -> Vec<Secret> {
    let end_of = |from: usize, set: &[char]| raw[from..].find(set).map_or(raw.len(), |i| from + i);
    let mut secrets = Vec::new();
    let authority_end = end_of(start, &['/', '?', '#']);
    let hosts_start = if let Some(i) = raw[start..authority_end].rfind('@') {
        let at = start + i;
        if let Some(colon) = raw[start..at].find(':') {
            let range = start + colon + 1..at;
            secrets.push(Secret::password(range.clone(), percent_decode(&raw[range])));
        }
        at + 1
    } else if let Some(i) = raw[start..].rfind('@').filter(|_| authority_end > start) {
        secrets.push(Secret::unreadable(start..start + i));
        start + i + 1
    } else {
        start
    };
    if secrets.is_empty() {
        // Without user info, a "port" that is not a number may be half a password
        // split at a raw comma (`amqp://u:pa` of `amqp://u:pa,ss@h`).
        secrets.extend(unreadable_ports(
            raw,
            hosts_start..end_of(hosts_start, &['/', '?', '#']),
        ));
    }
    let query = end_of(hosts_start, &['?', '#']);
    if raw[query..].starts_with('?') {
        secrets.extend(query_secrets(raw, query + 1));
    }
    secrets
}

/// The ports of a `host[:port],host[:port]` list that are not numbers.
fn unreadable_ports(raw: &str, hosts: Range<usize>) -> Vec<Secret> {
    let mut secrets = Vec::new();
    let mut offset = hosts.start;
    for host in raw[hosts].split(',') {
        // `[v6]:port`: the port follows the `]`.
        let tail = host.rfind(']').map_or(0, |i| i + 1);
        if let Some(colon) = host[tail..].find(':') {
            let port = &host[tail + colon + 1..];
            if !port.bytes().all(|b| b.is_ascii_digit()) {
                let begin = offset + tail + colon + 1;
                secrets.push(Secret::unreadable(begin..begin + port.len()));
            }
        }
        offset += host.len() + 1;
    }
    secrets
}

/// The values of the secret-looking parameters of a query that starts at `start`.
fn query_secrets(raw: &str, start: usize) -> Vec<Secret> {
    let end = raw[start..].find('#').map_or(raw.len(), |i| start + i);
    let mut secrets = Vec::new();
    let mut offset = start;
    for pair in raw[start..end].split(['&', ';']) {
        if let Some((key, value)) = pair.split_once('=') {
            if is_secret_key(&percent_decode(key)) && !value.is_empty() {
                let begin = offset + key.len() + 1;
                secrets.push(Secret::password(
                    begin..begin + value.len(),
                    percent_decode(&value.replace('+', " ")),
                ));
            }
        }
        offset += pair.len() + 1;
    }
    secrets
}

/// The secrets of a libpq key=value string; from a malformed pair on, the rest.
fn key_value_secrets(raw: &str) -> Vec<Secret> {
    let (pairs, malformed) = key_values(raw);
    let mut secrets: Vec<Secret> = pairs
        .into_iter()
        .filter(|pair| is_secret_key(&raw[pair.key.clone()]) && !pair.value.is_empty())
        .map(|pair| Secret::password(pair.value, pair.text))
        .collect();
    if let Some(at) = malformed {
        secrets.push(Secret::unreadable(at..raw.len()));
    }
    secrets
}

/// True for a parameter name that may hold a credential: `password`, `sslpassword`,
/// `pass`, `pwd`, `secret`, `token`, `api_key`, `authorization`, `credential…`. Not
/// `passfile` (a path) nor `auth_mechanism` (`PLAIN`): their values are no secret,
/// and scrubbing them from every log line would mangle it.
fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    let words = [
        "pass",
        "pwd",
        "secret",
        "token",
        "apikey",
        "api_key",
        "api-key",
        "authorization",
        "credential",
    ];
    key != "passfile" && words.iter().any(|word| key.contains(word))
}

/// One `key = value` pair of a libpq key=value string.
pub(crate) struct KeyValue {
    /// The key, as a byte range of the string.
    pub(crate) key: Range<usize>,
    /// The value as written (quotes included), as a byte range of the string.
    pub(crate) value: Range<usize>,
    /// The value unquoted and unescaped.
    pub(crate) text: String,
}

/// The pairs of a libpq key=value string (`key = value` or `key = 'quoted \' value'`,
/// separated by whitespace), and the offset of the first pair that is malformed (a key
/// without `=`), if any: nothing after it is read.
pub(crate) fn key_values(raw: &str) -> (Vec<KeyValue>, Option<usize>) {
    let mut pairs = Vec::new();
    let skip_space = |at: usize| {
        raw[at..]
            .find(|c: char| !c.is_whitespace())
            .map_or(raw.len(), |i| at + i)
    };
    let mut at = skip_space(0);
    while at < raw.len() {
        let key_end = raw[at..]
            .find(|c: char| c == '=' || c.is_whitespace())
            .map_or(raw.len(), |i| at + i);
        let equals = skip_space(key_end);
        if key_end == at || !raw[equals..].starts_with('=') {
            return (pairs, Some(at));
        }
        let value_start = skip_space(equals + 1);
        let (len, text) = scan_value(&raw[value_start..]);
        pairs.push(KeyValue {
            key: at..key_end,
            value: value_start..value_start + len,
            text,
        });
        at = skip_space(value_start + len);
    }
    (pairs, None)
}

/// One key=value value at the start of `s`: its length as written and its unescaped text.
fn scan_value(s: &str) -> (usize, String) {
    let mut value = String::new();
    let mut chars = s.char_indices();
    let quoted = s.starts_with('\'');
    if quoted {
        chars.next();
    }
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => value.extend(chars.next().map(|(_, c)| c)),
            '\'' if quoted => return (i + 1, value),
            c if c.is_whitespace() && !quoted => return (i, value),
            c => value.push(c),
        }
    }
    (s.len(), value)
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
pub(crate) fn percent_decode(text: &str) -> String {
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
        assert_eq!(redact_url("amqp://guest@host/%2f"), "amqp://guest@host/%2f");
        assert_eq!(redact_url("file:///tmp/mail@x"), "file:///tmp/mail@x");
    }

    /// Each form of address that carries a password, its redaction, and the secret
    /// text that must not survive it.
    const FORMS: &[(&str, &str, &[&str])] = &[
        // Several hosts: no URL parser accepts it.
        (
            "postgres://u:PgMulti7@h1:5432,h2:5432/x",
            "postgres://u:***@h1:5432,h2:5432/x",
            &["PgMulti7"],
        ),
        (
            "postgresql://u:PgV6pw@[::1]:5432,[2001:db8::2]/x?sslmode=require",
            "postgresql://u:***@[::1]:5432,[2001:db8::2]/x?sslmode=require",
            &["PgV6pw"],
        ),
        // A port out of range, and one that is not a number.
        (
            "smtp://u:SmtpPort9@host:99999",
            "smtp://u:***@host:99999",
            &["SmtpPort9"],
        ),
        (
            "smtp://u:SmtpX@host:2x5",
            "smtp://u:***@host:2x5",
            &["SmtpX"],
        ),
        ("smtp://u:half", "smtp://u:***", &["half"]),
        // Percent-encoded, and with raw `@`, `/` and `?` in the password.
        (
            "amqp://u:p%40ss%2Fw%3Ard@h:5672/%2f",
            "amqp://u:***@h:5672/%2f",
            &["p%40ss", "p@ss/w:rd"],
        ),
        ("amqp://u:raw@at@h/v", "amqp://u:***@h/v", &["raw@at"]),
        (
            "postgres://u:sla/shed@h/db",
            "postgres://***@h/db",
            &["sla", "shed"],
        ),
        (
            "postgres://u:que?ried@h/db",
            "postgres://***@h/db",
            &["que", "ried"],
        ),
        (
            "smtp://u:hash#tag@h:25",
            "smtp://***@h:25",
            &["hash", "tag"],
        ),
        // Passwords in the query.
        (
            "postgres://h/db?user=u&password=QueryPw1&sslmode=require",
            "postgres://h/db?user=u&password=***&sslmode=require",
            &["QueryPw1"],
        ),
        (
            "postgres://h/db?sslpassword=Key%20Pw&application_name=a",
            "postgres://h/db?sslpassword=***&application_name=a",
            &["Key%20Pw", "Key Pw"],
        ),
        (
            "http://user:OtelPw5@collector:4318/v1/traces?api_key=OtelKey6",
            "http://user:***@collector:4318/v1/traces?api_key=***",
            &["OtelPw5", "OtelKey6"],
        ),
        // libpq key=value strings: quoted, spaced, escaped, malformed.
        (
            "host=db password='a b c' dbname=x",
            "host=db password=*** dbname=x",
            &["a b c", "'a b"],
        ),
        (
            "host=db password = 'it\\'s' user=u",
            "host=db password = *** user=u",
            &["it\\'s", "it's"],
        ),
        ("host=db PASSWORD=KvUp", "host=db PASSWORD=***", &["KvUp"]),
        (
            "host=db password=half way",
            "host=db password=*** ***",
            &["half", "way"],
        ),
        (
            "host=db password 'no equals'",
            "host=db ***",
            &["no equals"],
        ),
        ("not a url", "***", &["not"]),
    ];

    #[test]
    fn every_form_of_address_is_redacted() {
        for (raw, shown, secrets) in FORMS {
            let got = redact_url(raw);
            assert_eq!(got, *shown, "{raw}");
            for secret in *secrets {
                assert!(!got.contains(secret), "{raw} → {got} shows {secret}");
            }
        }
    }

    #[test]
    fn passwords_are_found_as_written_and_decoded() {
        let found = passwords("amqp://u:p%40ss%2Fw%3Ard@h:5672/%2f");
        assert!(found.contains(&"p%40ss%2Fw%3Ard".to_string()), "{found:?}");
        assert!(found.contains(&"p@ss/w:rd".to_string()), "{found:?}");
        let found = passwords("host=db password='a b c' dbname=x");
        assert!(found.contains(&"a b c".to_string()), "{found:?}");
        let found = passwords("postgres://h/db?password=Q%2Bp+w");
        assert!(found.contains(&"Q+p w".to_string()), "{found:?}");
        // Lists: every address's password; ports and malformed tails are not passwords.
        let found = passwords("amqp://a:FirstPw@h1,amqp://b:SecondPw@h2:x");
        assert!(found.contains(&"FirstPw".to_string()), "{found:?}");
        assert!(found.contains(&"SecondPw".to_string()), "{found:?}");
        assert!(
            !found.iter().any(|p| p == "x" || p.contains("h1")),
            "{found:?}"
        );
        assert!(passwords("smtp://127.0.0.1:1025").is_empty());
        assert!(passwords("amqp://u:pw@h").is_empty(), "too short to scrub");
        // Settings that merely look like secrets are neither hidden nor scrubbed.
        let plain = "amqp://h/%2f?auth_mechanism=PLAIN&heartbeat=5";
        assert_eq!(redact_url(plain), plain);
        assert!(passwords(plain).is_empty());
        let file = "host=db passfile=/etc/postie/pgpass sslpassword=KeyPw";
        assert_eq!(
            redact_url(file),
            "host=db passfile=/etc/postie/pgpass sslpassword=***"
        );
        assert_eq!(
            scrub(
                "bad url amqp://u:p%40ss%2Fw%3Ard@h (p@ss/w:rd)",
                &passwords("amqp://u:p%40ss%2Fw%3Ard@h")
            ),
            "bad url amqp://u:***@h (***)"
        );
    }

    #[test]
    fn key_values_are_read_as_libpq_does() {
        let raw = "host = db  password='a \\' b' sslmode=verify-full";
        let (pairs, malformed) = key_values(raw);
        assert!(malformed.is_none());
        let read: Vec<_> = pairs
            .iter()
            .map(|p| (&raw[p.key.clone()], &raw[p.value.clone()], p.text.as_str()))
            .collect();
        assert_eq!(
            read,
            [
                ("host", "db", "db"),
                ("password", "'a \\' b'", "a ' b"),
                ("sslmode", "verify-full", "verify-full"),
            ]
        );
        assert_eq!(key_values("a=1 b c=2").1, Some(4));
        assert_eq!(key_values("=x").1, Some(0));
        assert_eq!(key_values("password=").0[0].text, "");
    }

    #[test]
    fn url_lists_are_split_and_each_address_redacted_on_its_own() {
        let redact_url_list = |raw: &str| {
            let shown: Vec<String> = split_urls(raw).into_iter().map(redact_url).collect();
            shown.join(", ")
        };
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
        assert_eq!(
            redact_url("amqp://u:p@h:notaport"),
            "amqp://u:***@h:notaport"
        );
        assert_eq!(redact_url_list("amqp://h"), "amqp://h");
        assert!(split_urls(" , ").is_empty());
        // A whole list given to redact_url: each address on its own too.
        assert_eq!(
            redact_url("amqp://a:FirstPw1@h1/%2f, amqps://b:SecondPw2@h2/%2f"),
            "amqp://a:***@h1/%2f, amqps://b:***@h2/%2f"
        );
        // A PostgreSQL URL's hosts are one address.
        assert_eq!(
            redact_url("postgres://u:Pw3@h1:5432,h2:5433/db"),
            "postgres://u:***@h1:5432,h2:5433/db"
        );
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
