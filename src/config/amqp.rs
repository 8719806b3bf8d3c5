//! `amqp.url` taken apart once: one address or a comma-separated list, each parsed
//! into the URI the broker client dials (with postie's heartbeat unless the URL sets
//! one) and kept beside its redacted form for logs and errors.

use std::str::FromStr;

use lapin::uri::AMQPUri;
use secrecy::{ExposeSecret, SecretString};

use super::ConfigError;
use crate::endpoint::{is_loopback_host, passwords, redact_url, scrub, split_urls};

/// Heartbeat interval asked of the broker when `amqp.url` does not set `heartbeat`:
/// a broker that vanishes without closing the connection is noticed in seconds, not
/// after the broker's default 60 s × 2.
const HEARTBEAT_SECS: u16 = 10;

/// One broker address, parsed. `Debug` shows only the redacted form.
#[derive(Clone)]
pub struct AmqpAddress {
    /// What the client dials (credentials included).
    pub uri: AMQPUri,
    /// The address without its password: for logs, errors and `/readyz`.
    pub shown: String,
    /// The host, when the address is plaintext `amqp://` to another machine (the
    /// connection warns once per process).
    pub plaintext_to: Option<String>,
    /// Its password as written and decoded, to scrub from a client's error.
    pub passwords: Vec<String>,
}

impl std::fmt::Debug for AmqpAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

/// Every address of `amqp.url`, in the order given; never empty.
#[derive(Clone, Debug)]
pub struct AmqpAddresses(Vec<AmqpAddress>);

impl AmqpAddresses {
    /// Parses `urls` (see [`split_urls`]); errors name the redacted address only.
    pub fn parse(urls: &SecretString) -> Result<Self, ConfigError> {
        let raw = urls.expose_secret();
        let addresses = split_urls(raw)
            .into_iter()
            .map(parse_one)
            .collect::<Result<Vec<_>, _>>()?;
        if addresses.is_empty() {
            return Err(ConfigError(
                "amqp.url is empty: give one or more amqp:// or amqps:// addresses".into(),
            ));
        }
        Ok(Self(addresses))
    }

    /// The addresses, in the order given.
    pub(crate) fn all(&self) -> &[AmqpAddress] {
        &self.0
    }
}

fn parse_one(url: &str) -> Result<AmqpAddress, ConfigError> {
    let shown = redact_url(url);
    let parsed = url::Url::parse(url)
        .map_err(|e| ConfigError(format!("amqp.url {shown} is not a URL: {e}")))?;
    // (lapin's parse error may quote the whole URL: it is shown redacted.)
    let mut uri = AMQPUri::from_str(url).map_err(|e| {
        ConfigError(format!(
            "amqp.url {shown} is not valid: {}",
            scrub(&e.replace(url, &shown), &passwords(url))
        ))
    })?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(HEARTBEAT_SECS);
    }
    let host = parsed.host_str().unwrap_or("");
    let plaintext_to = (parsed.scheme() == "amqp" && !host.is_empty() && !is_loopback_host(host))
        .then(|| host.to_string());
    Ok(AmqpAddress {
        uri,
        shown,
        plaintext_to,
        passwords: passwords(url),
    })
}

impl super::AmqpSettings {
    /// `url` parsed ([`AmqpAddresses::parse`]).
    pub(crate) fn addresses(&self) -> Result<AmqpAddresses, ConfigError> {
        AmqpAddresses::parse(&self.url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cx_addresses_are_parsed_once_with_a_heartbeat_and_shown_redacted() {
        let list = SecretString::from(
            "amqp://u:SECRETPW1@10.0.0.1:5672/%2f, amqps://u:SECRETPW2@b.example/%2f?heartbeat=3",
        );
        let parsed = AmqpAddresses::parse(&list).unwrap();
        let [a, b] = parsed.all() else {
            panic!("two addresses")
        };
        assert_eq!(a.uri.query.heartbeat, Some(HEARTBEAT_SECS));
        assert_eq!(b.uri.query.heartbeat, Some(3));
        assert_eq!(a.plaintext_to.as_deref(), Some("10.0.0.1"));
        assert_eq!(b.plaintext_to, None);
        let shown = format!("{parsed:?}");
        assert!(!shown.contains("SECRETPW"), "{shown}");
        let err = AmqpAddresses::parse(&SecretString::from("amqp://u:SECRETPW9@h:notaport/%2f"))
            .unwrap_err()
            .to_string();
        assert!(!err.contains("SECRETPW9"), "{err}");
        assert!(AmqpAddresses::parse(&SecretString::from(" , ")).is_err());
    }

    /// Settings with `amqp.management_url` = `url` (and `allow_http`), or the error.
    fn management(url: &str, allow_http: bool) -> Result<crate::config::Settings, String> {
        let vars = [
            ("POSTIE__AMQP__MANAGEMENT_URL", url),
            (
                "POSTIE__AMQP__MANAGEMENT_ALLOW_HTTP",
                if allow_http { "true" } else { "false" },
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        crate::config::Settings::load_from(None, Some(vars)).map_err(|e| e.to_string())
    }

    #[test]
    fn the_management_url_is_https_or_http_to_this_machine() {
        assert!(management("https://u:SECRETPW@mq.example:15671", false).is_ok());
        for local in [
            "http://guest:guest@127.0.0.1:15672",
            "http://u:p@localhost:15672/",
            "http://u:p@[::1]:15672",
        ] {
            assert!(management(local, false).is_ok(), "{local}");
        }
        // Off this machine in clear: one line naming the key, never the password.
        let refused = management("http://u:SECRETPW@rabbitmq:15672", false).unwrap_err();
        assert!(
            refused.contains("amqp.management_url") && refused.contains("management_allow_http"),
            "{refused}"
        );
        assert!(
            !refused.contains("SECRETPW") && !refused.contains('\n'),
            "{refused}"
        );
        // A name that resolves to 127.0.0.1 is still a name: DNS decides nothing.
        assert!(management("http://u:p@127.0.0.1.nip.io:15672", false).is_err());
        // The explicit setting allows it.
        assert!(management("http://u:SECRETPW@rabbitmq:15672", true).is_ok());
        let ftp = management("ftp://u:SECRETPW@rabbitmq", true).unwrap_err();
        assert!(
            ftp.contains("amqp.management_url") && !ftp.contains("SECRETPW"),
            "{ftp}"
        );
    }
}
