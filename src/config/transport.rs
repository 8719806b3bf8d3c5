//! Where emails go: `transport.url` (one transport; `smtp.url` is its older name and
//! still works) or `transport.providers` (an ordered list, for failover), each entry
//! taken apart into a [`ProviderPlan`].
//!
//! An entry of `transport.providers` is any URL `smtp.url` takes (`smtp://`,
//! `smtps://`, `ses://`, `sendgrid://`, `postmark://`, `mailgun://`, `file://`), with
//! three more query parameters that postie reads and removes before the transport
//! sees the URL:
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `name=` | the provider's name in logs, metrics, `postie status` and the inbox's `provider` column | the scheme (`smtp`, `ses`, …), `-2`, `-3` appended to repeats |
//! | `rate_limit=` | this provider's fleet-wide send rate (`14/s`, `600/m`) | none |
//! | `rate_burst=` | most emails in one second under it | one second's worth |
//!
//! With one transport (`transport.url` or `smtp.url`), `smtp.rate_limit` and
//! `smtp.rate_burst` are its limit, as before.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::{ConfigError, SendRate, SmtpTransport};
use crate::endpoint::redact_url;

/// The transport section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSettings {
    /// The one transport's URL; when set, it is used instead of `smtp.url`.
    pub url: Option<SecretString>,
    /// Providers in order of preference, for failover: a job goes to the first whose
    /// circuit breaker is closed. Each its own breaker and `rate_limit=`. Empty: the
    /// one transport of `transport.url` (or `smtp.url`).
    pub providers: Vec<SecretString>,
}

/// One transport as validation parsed it.
#[derive(Debug, Clone)]
pub(crate) struct ProviderPlan {
    /// Its name (`name=`, else the scheme), unique among the providers.
    pub(crate) name: String,
    /// What it is and where.
    pub(crate) transport: SmtpTransport,
    /// Its fleet-wide send rate.
    pub(crate) rate_limit: Option<SendRate>,
    /// Most emails in one second under `rate_limit`.
    pub(crate) rate_burst: Option<u32>,
}

impl SmtpTransport {
    /// The name a transport gets when none is given: its scheme.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Files(_) => "file",
            Self::Relay(_) => "smtp",
            Self::Api(endpoint) => endpoint.name(),
        }
    }
}

impl super::Settings {
    /// The one transport's URL: `transport.url` if set, else `smtp.url`.
    pub(crate) fn transport_url(&self) -> &SecretString {
        self.transport.url.as_ref().unwrap_or(&self.smtp.url)
    }

    /// Every transport, in order of preference (see the module's doc).
    pub(crate) fn provider_plans(&self) -> Result<Vec<ProviderPlan>, ConfigError> {
        let providers = &self.transport.providers;
        if providers.is_empty() {
            let transport = SmtpTransport::parse(self.transport_url().expose_secret())?;
            return Ok(vec![ProviderPlan {
                name: transport.kind().to_string(),
                transport,
                rate_limit: self.smtp.rate_limit,
                rate_burst: self.smtp.rate_burst,
            }]);
        }
        if self.transport.url.is_some() {
            return Err(ConfigError(
                "set transport.url or transport.providers, not both".into(),
            ));
        }
        let mut plans: Vec<ProviderPlan> = Vec::with_capacity(providers.len());
        for (i, raw) in providers.iter().enumerate() {
            let key = format!("transport.providers[{i}]");
            let mut plan = provider_plan(&key, raw.expose_secret())?;
            if plan.name.is_empty() {
                let kind = plan.transport.kind();
                let repeats = plans.iter().filter(|p| p.transport.kind() == kind).count();
                plan.name = match repeats {
                    0 => kind.to_string(),
                    n => format!("{kind}-{}", n + 1),
                };
            }
            if plans.iter().any(|p| p.name == plan.name) {
                return Err(ConfigError(format!(
                    "{key}: the name {:?} is taken by an earlier provider: give each a \
                     distinct name=",
                    plan.name
                )));
            }
            plans.push(plan);
        }
        Ok(plans)
    }
}

/// One entry: postie's parameters taken out, the rest parsed as `smtp.url` is. The
/// name is empty when none was given (the caller picks one).
fn provider_plan(key: &str, raw: &str) -> Result<ProviderPlan, ConfigError> {
    let fail = |why: String| ConfigError(format!("{key} {} {why}", redact_url(raw)));
    let mut url = url::Url::parse(raw).map_err(|e| fail(format!("is not a URL: {e}")))?;
    let (mut name, mut rate_limit, mut rate_burst) = (String::new(), None, None);
    let mut kept = Vec::new();
    for (k, v) in url.query_pairs() {
        match &*k {
            "name" => name = v.into_owned(),
            "rate_limit" => rate_limit = Some(SendRate::parse(&v).map_err(fail)?),
            "rate_burst" => {
                let burst = v.parse::<u32>().ok().filter(|b| *b > 0);
                rate_burst = Some(burst.ok_or_else(|| {
                    fail(format!("has rate_burst={v}: a whole number above zero"))
                })?);
            }
            _ => kept.push((k.into_owned(), v.into_owned())),
        }
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    if !name.chars().all(allowed) || name.len() > 40 {
        return Err(fail(format!(
            "has name={name:?}: at most 40 ASCII letters, digits, '.', '_' or '-'"
        )));
    }
    if kept.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(kept);
    }
    let transport = SmtpTransport::parse(url.as_str())
        .map_err(|e| ConfigError(e.0.replacen("smtp.url", key, 1)))?;
    Ok(ProviderPlan {
        name,
        transport,
        rate_limit,
        rate_burst,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<super::super::Settings, ConfigError> {
        let env = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        super::super::Settings::load_from(None, Some(env))
    }

    #[test]
    fn one_transport_from_transport_url_or_smtp_url_with_smtp_s_rate() {
        let s = settings(&[
            ("POSTIE__SMTP__URL", "smtp://127.0.0.1:2525"),
            ("POSTIE__SMTP__RATE_LIMIT", "14/s"),
        ])
        .unwrap();
        let plans = s.provider_plans().unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].name, "smtp");
        assert_eq!(plans[0].rate_limit, SendRate::parse("14/s").ok());
        let s = settings(&[
            ("POSTIE__SMTP__URL", "smtp://127.0.0.1:2525"),
            ("POSTIE__TRANSPORT__URL", "file:///tmp/postie-eml"),
        ])
        .unwrap();
        let plans = s.provider_plans().unwrap();
        assert_eq!(plans[0].name, "file", "transport.url wins over smtp.url");
    }

    #[test]
    fn providers_are_named_rated_and_their_urls_cleaned() {
        let s = settings(&[(
            "POSTIE__TRANSPORT__PROVIDERS",
            "sendgrid://apikey:key-one@api.sendgrid.com?rate_limit=40/s&rate_burst=50,\
             smtp://127.0.0.1:2525?tls=none&name=relay,\
             sendgrid://apikey:key-two@api.sendgrid.com",
        )])
        .unwrap();
        let plans = s.provider_plans().unwrap();
        let names: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["sendgrid", "relay", "sendgrid-2"]);
        assert_eq!(plans[0].rate_limit, SendRate::parse("40/s").ok());
        assert_eq!(plans[0].rate_burst, Some(50));
        assert_eq!((plans[1].rate_limit, plans[2].rate_limit), (None, None));
        assert!(matches!(&plans[1].transport, SmtpTransport::Relay(e) if e.port == 2525));
        let passwords = s.passwords();
        assert!(
            ["key-one", "key-two"]
                .iter()
                .all(|k| passwords.iter().any(|p| p == k)),
            "each provider's key is scrubbed: {passwords:?}"
        );
    }

    #[test]
    fn bad_provider_lists_fail_with_the_entry_named() {
        let error = |vars: &[(&str, &str)]| settings(vars).unwrap_err().to_string();
        let e = error(&[
            ("POSTIE__TRANSPORT__PROVIDERS", "smtp://127.0.0.1:25"),
            ("POSTIE__TRANSPORT__URL", "smtp://127.0.0.1:25"),
        ]);
        assert!(e.contains("not both"), "{e}");
        let e = error(&[(
            "POSTIE__TRANSPORT__PROVIDERS",
            "smtp://127.0.0.1:25?name=a,smtp://127.0.0.1:26?name=a",
        )]);
        assert!(
            e.contains("transport.providers[1]") && e.contains("taken"),
            "{e}"
        );
        let e = error(&[(
            "POSTIE__TRANSPORT__PROVIDERS",
            "smtp://127.0.0.1:25,smtp://127.0.0.1:26?rate_limit=fast",
        )]);
        assert!(
            e.contains("transport.providers[1]") && e.contains("14/s"),
            "{e}"
        );
        let e = error(&[(
            "POSTIE__TRANSPORT__PROVIDERS",
            "sendgrid://apikey:s3cret@api.sendgrid.com?endpoint=ftp://x",
        )]);
        assert!(e.contains("transport.providers[0]"), "{e}");
        assert!(!e.contains("s3cret"), "the key is not shown: {e}");
    }
}
