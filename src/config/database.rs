//! `database.url` parsed for tokio-postgres, and the TLS decision taken from its
//! `sslmode` (which postie reads itself: tokio-postgres knows neither `verify-ca` nor
//! `verify-full`).

use std::path::Path;
use std::str::FromStr;

use super::ConfigError;
use crate::endpoint::{is_loopback_host, key_values, passwords, percent_decode, redact_url, scrub};

/// How postie protects its PostgreSQL connections, from `sslmode` in `database.url`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbTls {
    /// No TLS: `sslmode` absent, `disable` or `prefer` (postie never negotiates TLS
    /// it does not verify). Only to this machine, or with `database.allow_plaintext`.
    Off,
    /// TLS, with the certificate chain (system roots plus `database.ca_file`) and the
    /// host name verified: `sslmode=require` and `sslmode=verify-full`.
    VerifyFull,
    /// TLS, with the chain verified against `database.ca_file` alone and the host name
    /// not checked: `sslmode=verify-ca`.
    VerifyCa,
}

/// `database.url` parsed for tokio-postgres, and how to protect the connections.
pub struct DbPlan {
    /// The connection settings, `sslmode` already applied (`Disable` or `Require`).
    pub config: tokio_postgres::Config,
    /// TLS, and what is verified.
    pub tls: DbTls,
}

/// Parses `database.url` (URL or key=value) and decides on TLS.
///
/// `sslmode` is read by postie itself, because tokio-postgres knows neither
/// `verify-ca` nor `verify-full`. Without TLS (`sslmode` absent, `disable` or
/// `prefer`) every host must be this machine (see [`is_loopback_host`]) unless
/// `allow_plaintext`; otherwise this returns the one-line refusal. It never connects.
pub(crate) fn database_plan(
    url: &str,
    allow_plaintext: bool,
    ca_file: Option<&Path>,
) -> Result<DbPlan, ConfigError> {
    let (rewritten, sslmode) = split_sslmode(url);
    let tls = match sslmode.as_deref() {
        None | Some("disable") | Some("prefer") => DbTls::Off,
        Some("require") | Some("verify-full") => DbTls::VerifyFull,
        Some("verify-ca") => DbTls::VerifyCa,
        Some(other) => {
            return Err(ConfigError(format!(
                "database.url has sslmode={other}, which postie does not support: \
                 use disable, prefer, require, verify-ca or verify-full"
            )))
        }
    };
    let mut config = tokio_postgres::Config::from_str(&rewritten).map_err(|e| {
        let shown = redact_url(url);
        let detail = scrub(&e.to_string(), &passwords(url));
        ConfigError(format!(
            "database.url {shown} is not valid: {}",
            quoting_only(&detail, &shown)
        ))
    })?;
    match tls {
        DbTls::Off => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            if let Some(host) = remote_database_host(&config) {
                if !allow_plaintext {
                    return Err(ConfigError(format!(
                        "database.url points at {host} without sslmode=require: the database \
                         password and every job's recipients would cross the network \
                         unencrypted; set sslmode=require (or verify-full), or \
                         database.allow_plaintext = true to accept the risk"
                    )));
                }
            }
        }
        DbTls::VerifyCa if ca_file.is_none() => {
            return Err(ConfigError(
                "database.url has sslmode=verify-ca, which checks the certificate chain but \
                 not the host name, so against the system's roots any publicly issued \
                 certificate would pass: set database.ca_file to the CA that signs the \
                 server's certificate, or use sslmode=verify-full"
                    .into(),
            ))
        }
        DbTls::VerifyFull | DbTls::VerifyCa => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
        }
    }
    Ok(DbPlan { config, tls })
}

/// `detail` (tokio-postgres's words) with every `quoted` part that `shown` (the
/// redacted address) does not show replaced by `***`: "unknown option `x`" may quote
/// half of an unquoted password that held a space.
fn quoting_only(detail: &str, shown: &str) -> String {
    detail
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 && !shown.contains(part) {
                "***"
            } else {
                part
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

/// The first host (or `hostaddr`, which is where tokio-postgres connects when given)
/// that is not this machine.
fn remote_database_host(config: &tokio_postgres::Config) -> Option<String> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    (0..hosts.len().max(addrs.len())).find_map(|i| match (addrs.get(i), hosts.get(i)) {
        (Some(addr), _) => (!addr.to_canonical().is_loopback()).then(|| addr.to_string()),
        (None, Some(tokio_postgres::config::Host::Tcp(host))) => {
            (!is_loopback_host(host)).then(|| host.clone())
        }
        #[cfg(unix)]
        (None, Some(tokio_postgres::config::Host::Unix(_))) => None,
        (None, None) => None,
    })
}

/// Finds `sslmode` in a PostgreSQL URL or key=value string. Returns the string with
/// `verify-ca` and `verify-full` replaced by `require` (all tokio-postgres can parse),
/// and the mode as written, lower-cased (the last one wins, as in libpq).
fn split_sslmode(raw: &str) -> (String, Option<String>) {
    let is_url = ["postgres://", "postgresql://"]
        .iter()
        .any(|prefix| raw.starts_with(prefix));
    if is_url {
        let Some((base, query)) = raw.split_once('?') else {
            return (raw.to_string(), None);
        };
        let mut mode = None;
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                if key != "sslmode" {
                    return pair.to_string();
                }
                let value = percent_decode(value).to_ascii_lowercase();
                let verify = value.starts_with("verify-");
                mode = Some(value);
                if verify {
                    "sslmode=require".to_string()
                } else {
                    pair.to_string()
                }
            })
            .collect();
        return (format!("{base}?{}", pairs.join("&")), mode);
    }
    // key=value: rewrite only the value of sslmode; a malformed string is left to
    // tokio-postgres to refuse.
    let (pairs, _) = key_values(raw);
    let mut out = String::with_capacity(raw.len());
    let (mut copied, mut mode) = (0, None);
    for pair in pairs {
        if &raw[pair.key] != "sslmode" {
            continue;
        }
        let value = pair.text.to_ascii_lowercase();
        if value.starts_with("verify-") {
            out.push_str(&raw[copied..pair.value.start]);
            out.push_str("require");
            copied = pair.value.end;
        }
        mode = Some(value);
    }
    out.push_str(&raw[copied..]);
    (out, mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decision for one `database.url`: the TLS mode, or a refusal's first words.
    fn db_decision(
        url: &str,
        allow_plaintext: bool,
        ca_file: Option<&str>,
    ) -> Result<DbTls, String> {
        database_plan(url, allow_plaintext, ca_file.map(Path::new))
            .map(|plan| plan.tls)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn database_tls_follows_sslmode_and_refuses_plaintext_off_the_machine() {
        const REFUSED: &str = "without sslmode=require";
        for host in [
            "127.0.0.1",
            "127.5.5.5",
            "[::1]",
            "localhost",
            "%2Fvar%2Frun%2Fpostgresql",
            "db.internal",
            "10.0.0.5",
        ] {
            let local = !matches!(host, "db.internal" | "10.0.0.5");
            let url = |query: &str| format!("postgres://app:pw@{host}:5432/app{query}");
            for (query, allow, expected) in [
                ("", false, if local { Ok(DbTls::Off) } else { Err(REFUSED) }),
                (
                    "?sslmode=disable",
                    false,
                    if local { Ok(DbTls::Off) } else { Err(REFUSED) },
                ),
                (
                    "?sslmode=prefer",
                    false,
                    if local { Ok(DbTls::Off) } else { Err(REFUSED) },
                ),
                ("", true, Ok(DbTls::Off)),
                ("?sslmode=prefer", true, Ok(DbTls::Off)),
                ("?sslmode=require", false, Ok(DbTls::VerifyFull)),
                ("?sslmode=verify-full", false, Ok(DbTls::VerifyFull)),
                (
                    "?application_name=x&sslmode=VERIFY-FULL",
                    false,
                    Ok(DbTls::VerifyFull),
                ),
                ("?sslmode=verify-ca", false, Err("database.ca_file")),
                ("?sslmode=allow", false, Err("sslmode=allow")),
            ] {
                let url = url(query);
                let got = db_decision(&url, allow, None);
                match expected {
                    Ok(tls) => assert_eq!(got, Ok(tls), "{url} allow={allow}"),
                    Err(words) => {
                        let err = got.expect_err(&url);
                        assert!(err.contains(words), "{url}: {err}");
                        assert!(!err.contains(":pw@"), "{url}: {err}");
                    }
                }
            }
        }
        assert_eq!(
            db_decision(
                "postgres://app:pw@db.internal/app?sslmode=verify-ca",
                false,
                Some("/ca.pem")
            ),
            Ok(DbTls::VerifyCa)
        );
    }

    #[test]
    fn database_refusal_is_one_line_naming_the_host_and_the_ways_out() {
        let err = db_decision(
            "postgres://postie:s3cr3t@db.example.invalid:5432/x",
            false,
            None,
        )
        .unwrap_err();
        assert!(
            err.starts_with(
                "configuration error: database.url points at db.example.invalid without sslmode=require: "
            ),
            "{err}"
        );
        assert!(err.contains("set sslmode=require (or verify-full), or database.allow_plaintext = true to accept the risk"), "{err}");
        assert!(!err.contains('\n') && !err.contains("s3cr3t"), "{err}");
    }

    #[test]
    fn database_hosts_lists_hostaddr_and_key_value_strings_are_all_checked() {
        for (url, expected) in [
            ("host=/var/run/postgresql dbname=x", Ok(DbTls::Off)),
            (
                "host=localhost user=a password='p w' dbname=x",
                Ok(DbTls::Off),
            ),
            ("host=db.internal dbname=x", Err("points at db.internal")),
            (
                "host=db.internal dbname=x sslmode=verify-full",
                Ok(DbTls::VerifyFull),
            ),
            (
                "host=db.internal sslmode = 'verify-full' dbname=x",
                Ok(DbTls::VerifyFull),
            ),
            (
                "host=db.internal password='a sslmode=require' dbname=x",
                Err("points at db.internal"),
            ),
            (
                "host=localhost,db.internal dbname=x",
                Err("points at db.internal"),
            ),
            (
                "postgres://a@localhost,10.0.0.5/x",
                Err("points at 10.0.0.5"),
            ),
            // Where the connection goes is hostaddr, not host.
            (
                "host=localhost hostaddr=10.0.0.5 dbname=x",
                Err("points at 10.0.0.5"),
            ),
            (
                "host=db.internal hostaddr=127.0.0.1 dbname=x",
                Ok(DbTls::Off),
            ),
        ] {
            match (db_decision(url, false, None), expected) {
                (Ok(got), Ok(tls)) => assert_eq!(got, tls, "{url}"),
                (Err(err), Err(words)) => assert!(err.contains(words), "{url}: {err}"),
                (got, _) => panic!("{url}: {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn an_invalid_database_url_is_named_without_its_password() {
        for (url, shown) in [
            (
                "postgres://u:PgMulti1@h1:5432,h2:99999/x",
                "postgres://u:***@h1:5432,h2:99999/x",
            ),
            (
                "postgres://u:PgPort2@127.0.0.1:99999/x",
                "postgres://u:***@127.0.0.1:99999/x",
            ),
            (
                "host=localhost password=Half3 Way4=x",
                "host=localhost password=*** Way4=x",
            ),
            (
                "host=localhost password=Half5 Way6",
                "host=localhost password=*** ***",
            ),
            (
                "postgres://h/x?password=Query7&port=nope",
                "postgres://h/x?password=***&port=nope",
            ),
        ] {
            let err = db_decision(url, true, None).unwrap_err();
            assert!(
                err.contains(&format!("database.url {shown} is not valid")),
                "{err}"
            );
            for secret in ["PgMulti1", "PgPort2", "Half3", "Half5", "Way6", "Query7"] {
                assert!(!err.contains(secret), "{url}: {err}");
            }
        }
    }

    #[test]
    fn verify_modes_reach_tokio_postgres_as_require_and_the_rest_is_kept() {
        let plan = database_plan(
            "postgres://u:p%40ss@db.internal:6432/app?sslmode=verify-full&connect_timeout=3",
            false,
            None,
        )
        .unwrap();
        assert_eq!(
            plan.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(plan.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(plan.config.get_ports(), [6432]);
        assert_eq!(plan.config.get_dbname(), Some("app"));
        // prefer is plaintext: postie never negotiates TLS it does not verify.
        let plan = database_plan("host=localhost sslmode=prefer", false, None).unwrap();
        assert_eq!(
            plan.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        let (rewritten, mode) = split_sslmode("host=x password='it\\'s' sslmode=verify-ca");
        assert_eq!(rewritten, "host=x password='it\\'s' sslmode=require");
        assert_eq!(mode.as_deref(), Some("verify-ca"));
    }
}
