//! `transport.url` naming a provider's HTTP API (`ses://`, `sendgrid://`, `postmark://`,
//! `mailgun://`) taken apart: which provider, where its API is, and its credentials.
//!
//! | URL | API | credentials |
//! |---|---|---|
//! | `ses://[KEY_ID:SECRET@][REGION][?region=R][&configuration_set=C]` | `https://email.R.amazonaws.com` | the URL's user and password, else `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`); the region from the host, `region=`, `AWS_REGION` or `AWS_DEFAULT_REGION` |
//! | `sendgrid://[apikey:KEY@][HOST]` | `https://HOST` (`api.sendgrid.com`) | the password, else `SENDGRID_API_KEY` |
//! | `postmark://[token:TOKEN@][HOST][?stream=S]` | `https://HOST` (`api.postmarkapp.com`) | the password, else `POSTMARK_SERVER_TOKEN` |
//! | `mailgun://[api:KEY@]DOMAIN[?region=eu]` | `https://api.mailgun.net` (`api.eu.mailgun.net`) | the password, else `MAILGUN_API_KEY` |
//!
//! Every form takes `endpoint=URL` instead of the provider's own address (a regional or
//! test endpoint): `https://`, or `http://` to this machine only, as `smtp://`'s rules
//! allow plaintext only there. Secrets are percent-decoded and stay [`SecretString`]s:
//! `Debug` shows none, and errors show the URL redacted.

use secrecy::SecretString;

use super::ConfigError;
use crate::endpoint::{is_loopback_host, percent_decode, redact_url};

/// The provider and what only it needs.
#[derive(Debug, Clone)]
pub enum ApiProvider {
    /// Amazon SES v2 `SendEmail`, SigV4-signed.
    Ses {
        /// The AWS region (the signature's scope).
        region: String,
        /// `ConfigurationSetName`, if any.
        configuration_set: Option<String>,
        /// The access key id (not secret, but not logged either).
        access_key_id: String,
        /// The secret access key.
        secret_access_key: SecretString,
        /// A session token for temporary credentials.
        session_token: Option<SecretString>,
    },
    /// SendGrid v3 `mail/send`.
    SendGrid {
        /// The API key (`Authorization: Bearer`).
        key: SecretString,
    },
    /// Postmark `/email`.
    Postmark {
        /// The server token (`X-Postmark-Server-Token`).
        token: SecretString,
        /// `MessageStream` (default `outbound`).
        stream: String,
    },
    /// Mailgun `messages.mime`.
    Mailgun {
        /// The sending domain.
        domain: String,
        /// The API key (HTTP Basic `api:KEY`).
        key: SecretString,
    },
}

/// A provider's API: the provider, and the base URL requests go to.
#[derive(Debug, Clone)]
pub struct ApiEndpoint {
    /// Which API, with its credentials.
    pub provider: ApiProvider,
    /// `https://host[:port]` (or `http://` to this machine), no trailing slash.
    pub base: String,
}

impl ApiEndpoint {
    /// The provider's name as postie logs it (`ses`, `sendgrid`, `postmark`, `mailgun`).
    pub fn name(&self) -> &'static str {
        match self.provider {
            ApiProvider::Ses { .. } => "ses",
            ApiProvider::SendGrid { .. } => "sendgrid",
            ApiProvider::Postmark { .. } => "postmark",
            ApiProvider::Mailgun { .. } => "mailgun",
        }
    }
}

/// Whether `raw` names a provider API (by its scheme).
pub(crate) fn is_api_url(raw: &str) -> bool {
    ["ses://", "sendgrid://", "postmark://", "mailgun://"]
        .iter()
        .any(|scheme| {
            raw.get(..scheme.len())
                .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
        })
}

/// A provider URL being taken apart: the URL, its host, its password, the environment.
struct Parts<'a> {
    raw: &'a str,
    url: url::Url,
    host: Option<String>,
    password: Option<SecretString>,
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl Parts<'_> {
    fn fail(&self, why: &str) -> ConfigError {
        ConfigError(format!("transport.url {} {why}", redact_url(self.raw)))
    }

    /// The last non-empty value of query parameter `name`.
    fn query(&self, name: &str) -> Option<String> {
        self.url
            .query_pairs()
            .filter(|(k, _)| k == name)
            .last()
            .map(|(_, v)| v.into_owned())
            .filter(|v| !v.is_empty())
    }

    /// The URL's password, else environment variable `var`.
    fn secret(&self, var: &str) -> Result<SecretString, ConfigError> {
        self.password
            .clone()
            .or_else(|| {
                (self.env)(var)
                    .filter(|v| !v.is_empty())
                    .map(SecretString::from)
            })
            .ok_or_else(|| {
                self.fail(&format!(
                    "has no key: put it in the URL's password or in {var}"
                ))
            })
    }

    /// `https://HOST`, or `default`'s host when the URL names none.
    fn https_host(&self, default: &str) -> String {
        format!("https://{}", self.host.as_deref().unwrap_or(default))
    }

    /// SES: region, key pair (URL or AWS variables), configuration set.
    fn ses(&self) -> Result<(ApiProvider, String), ConfigError> {
        let env = self.env;
        let region = self
            .host
            .clone()
            .or_else(|| self.query("region"))
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .ok_or_else(|| self.fail("names no region (ses://REGION, region= or AWS_REGION)"))?;
        let (access_key_id, secret_access_key, session_token) = match &self.password {
            Some(p) => (percent_decode(self.url.username()), p.clone(), None),
            None => (
                env("AWS_ACCESS_KEY_ID").ok_or_else(|| self.fail("has no AWS_ACCESS_KEY_ID"))?,
                SecretString::from(
                    env("AWS_SECRET_ACCESS_KEY")
                        .ok_or_else(|| self.fail("has no AWS_SECRET_ACCESS_KEY"))?,
                ),
                env("AWS_SESSION_TOKEN").map(SecretString::from),
            ),
        };
        let base = format!("https://email.{region}.amazonaws.com");
        let provider = ApiProvider::Ses {
            region,
            configuration_set: self.query("configuration_set"),
            access_key_id,
            secret_access_key,
            session_token,
        };
        Ok((provider, base))
    }

    /// Mailgun: the sending domain, the region's API, the key.
    fn mailgun(&self) -> Result<(ApiProvider, String), ConfigError> {
        let domain = self
            .host
            .clone()
            .ok_or_else(|| self.fail("names no sending domain (mailgun://DOMAIN)"))?;
        let base = match self.query("region").as_deref() {
            Some("eu") => "https://api.eu.mailgun.net",
            None | Some("us") => "https://api.mailgun.net",
            Some(other) => return Err(self.fail(&format!("has region={other}: use eu or us"))),
        };
        let key = self.secret("MAILGUN_API_KEY")?;
        Ok((ApiProvider::Mailgun { domain, key }, base.to_string()))
    }
}

/// Takes a provider URL apart, reading credentials the URL lacks from `env`.
pub(crate) fn api_endpoint(
    raw: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ApiEndpoint, ConfigError> {
    let fail = |why: &str| ConfigError(format!("transport.url {} {why}", redact_url(raw)));
    let url = url::Url::parse(raw).map_err(|e| fail(&format!("is not a URL: {e}")))?;
    let parts = Parts {
        raw,
        host: url.host_str().filter(|h| !h.is_empty()).map(str::to_string),
        password: url
            .password()
            .map(|p| SecretString::from(percent_decode(p))),
        url,
        env,
    };
    let (provider, default_base) = match parts.url.scheme() {
        "ses" => parts.ses()?,
        "sendgrid" => (
            ApiProvider::SendGrid {
                key: parts.secret("SENDGRID_API_KEY")?,
            },
            parts.https_host("api.sendgrid.com"),
        ),
        "postmark" => (
            ApiProvider::Postmark {
                token: parts.secret("POSTMARK_SERVER_TOKEN")?,
                stream: parts.query("stream").unwrap_or_else(|| "outbound".into()),
            },
            parts.https_host("api.postmarkapp.com"),
        ),
        "mailgun" => parts.mailgun()?,
        _ => {
            return Err(fail(
                "must start with ses://, sendgrid://, postmark:// or mailgun://",
            ))
        }
    };
    let base = match parts.query("endpoint") {
        Some(endpoint) => checked_endpoint(&endpoint).map_err(|why| fail(&why))?,
        None => default_base,
    };
    Ok(ApiEndpoint { provider, base })
}

/// `endpoint=`: an http(s) URL, plaintext only to this machine; no trailing slash.
fn checked_endpoint(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("has endpoint={raw}, not a URL: {e}"))?;
    let host = match url.host() {
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        Some(host) => host.to_string(),
        None => return Err(format!("has endpoint={raw} without a host")),
    };
    match url.scheme() {
        "https" => {}
        "http" if is_loopback_host(&host) => {}
        "http" => {
            return Err(format!(
                "has endpoint={raw}: plain http only to this machine; use https"
            ))
        }
        _ => return Err(format!("has endpoint={raw}: use an https:// URL")),
    }
    Ok(raw.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn ses_region_credentials_and_endpoint() {
        let e = api_endpoint(
            "ses://AKID:s3k%2Fr1t@eu-west-1?configuration_set=tx&endpoint=http://127.0.0.1:9/",
            &no_env,
        )
        .unwrap();
        assert_eq!(e.base, "http://127.0.0.1:9");
        let ApiProvider::Ses {
            region,
            configuration_set,
            access_key_id,
            secret_access_key,
            ..
        } = &e.provider
        else {
            panic!("{e:?}")
        };
        assert_eq!(
            (region.as_str(), access_key_id.as_str()),
            ("eu-west-1", "AKID")
        );
        assert_eq!(configuration_set.as_deref(), Some("tx"));
        assert_eq!(secret_access_key.expose_secret(), "s3k/r1t");
        assert!(!format!("{e:?}").contains("r1t"), "{e:?}");

        let env = |k: &str| match k {
            "AWS_ACCESS_KEY_ID" => Some("AKENV".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("envsecret".to_string()),
            "AWS_SESSION_TOKEN" => Some("envtoken".to_string()),
            _ => None,
        };
        let e = api_endpoint("ses://?region=us-east-1", &env).unwrap();
        assert_eq!(e.base, "https://email.us-east-1.amazonaws.com");
        let ApiProvider::Ses {
            access_key_id,
            session_token,
            ..
        } = &e.provider
        else {
            panic!()
        };
        assert_eq!(access_key_id, "AKENV");
        assert_eq!(session_token.as_ref().unwrap().expose_secret(), "envtoken");
        assert!(api_endpoint("ses://?region=us-east-1", &no_env).is_err());
        assert!(api_endpoint("ses://", &env)
            .unwrap_err()
            .to_string()
            .contains("region"));
    }

    #[test]
    fn key_providers_take_the_password_or_the_environment() {
        let e = api_endpoint("sendgrid://apikey:SG.abc@api.sendgrid.com", &no_env).unwrap();
        assert_eq!(e.base, "https://api.sendgrid.com");
        assert!(!format!("{e:?}").contains("SG.abc"));
        let env = |k: &str| (k == "POSTMARK_SERVER_TOKEN").then(|| "tok".to_string());
        let e = api_endpoint("postmark://?stream=broadcast", &env).unwrap();
        assert_eq!(e.base, "https://api.postmarkapp.com");
        assert!(
            matches!(&e.provider, ApiProvider::Postmark { stream, token }
            if stream == "broadcast" && token.expose_secret() == "tok")
        );
        let e = api_endpoint("mailgun://api:k3y@mg.example.com?region=eu", &no_env).unwrap();
        assert_eq!(e.base, "https://api.eu.mailgun.net");
        assert!(
            matches!(&e.provider, ApiProvider::Mailgun { domain, .. } if domain == "mg.example.com")
        );
        for (url, words) in [
            ("sendgrid://", "SENDGRID_API_KEY"),
            ("mailgun://", "domain"),
            (
                "postmark://t:secret1@x?endpoint=http://10.0.0.1:80",
                "only to this machine",
            ),
            ("postmark://t:secret1@x?endpoint=ftp://127.0.0.1", "https"),
            ("mailgun://api:secret1@d?region=asia", "region=asia"),
        ] {
            let err = api_endpoint(url, &no_env).unwrap_err().to_string();
            assert!(err.contains(words), "{url}: {err}");
            assert!(!err.contains("secret1"), "{url}: {err}");
        }
        assert!(is_api_url("SES://x") && is_api_url("mailgun://d") && !is_api_url("smtp://x"));
    }
}
