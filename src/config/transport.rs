//! Where emails go and what every transport shares: `transport.url` (one transport)
//! or `transport.providers` (an ordered list, for failover), each entry taken apart
//! into a [`ProviderPlan`]; the pool, the timeout, the breaker, the rate, `From` and
//! the Message-ID domain, whatever the transport (an SMTP relay, a provider's HTTP
//! API, `.eml` files).
//!
//! These keys were under `smtp.*` once: each old name still reads, with one warning
//! at start-up, and setting a key under both names stops start-up ([`OLD_SMTP_KEYS`]).
//!
//! An entry of `transport.providers` is any URL `transport.url` takes (`smtp://`,
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
//! With one transport (`transport.url`), `transport.rate_limit` and
//! `transport.rate_burst` are its limit.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::de::duration;
use super::{ConfigError, SendRate, SmtpTransport};
use crate::endpoint::redact_url;

/// The one transport when neither `transport.url` nor `transport.providers` is set.
pub(crate) const DEFAULT_URL: &str = "smtp://127.0.0.1:1025";

/// The keys that moved from `smtp.*` to `transport.*`, under the same name: each
/// `smtp.<key>` still reads as `transport.<key>`, with a warning.
pub(crate) const OLD_SMTP_KEYS: [&str; 8] = [
    "url",
    "pool_size",
    "timeout",
    "default_from",
    "message_id_domain",
    "breaker_threshold",
    "rate_limit",
    "rate_burst",
];

/// The transport section: where emails go, and what every transport shares.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSettings {
    /// The one transport: `smtp://host:port` (STARTTLS required, except to this
    /// machine; `?tls=none`, `?tls=opportunistic` or `?tls=required` to choose),
    /// `smtps://host:port` (implicit TLS), a provider's API (`ses://`, `sendgrid://`,
    /// `postmark://`, `mailgun://`), or `file:///dir` to write `.eml` files. Unset
    /// (and no `providers`): [`DEFAULT_URL`]. Formerly `smtp.url`.
    pub url: Option<SecretString>,
    /// Providers in order of preference, for failover: a job goes to the first whose
    /// circuit breaker is closed. Each its own breaker and `rate_limit=`. Empty: the
    /// one transport of `transport.url`.
    pub providers: Vec<SecretString>,
    /// The most sends at once from this instance, so the most connections it opens to
    /// an SMTP relay (kept open between sends) or idle ones it keeps to a provider's
    /// API; a job waits for a free one before it claims. Above `worker.concurrency`
    /// the rest is never used.
    pub pool_size: u32,
    /// Longest wait for the transport on any one step: each SMTP step (connect, the
    /// greeting with EHLO, STARTTLS, AUTH, MAIL, each RCPT, DATA, the body with its
    /// final reply, the NOOP check of a pooled connection, QUIT), or a provider API's
    /// whole request, connect to the last byte of the reply. A step that gets no
    /// answer in time is the transport unreachable (it counts toward the circuit
    /// breaker, never against the job). A whole send is bounded by
    /// [`TransportSettings::send_deadline`].
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
    /// `From` for jobs that carry none.
    pub default_from: Option<String>,
    /// The right-hand side of the Message-ID derived from each job's key.
    pub message_id_domain: String,
    /// Consecutive failures to reach a transport that open its circuit breaker
    /// (traffic moves to the next provider, or consumption pauses until it answers).
    pub breaker_threshold: u32,
    /// The one transport's fleet-wide send rate (`14/s`, `600/m`, `50000/h`), shared
    /// through PostgreSQL; unset = no limit. Each of `providers` has its own
    /// (`rate_limit=`).
    #[serde(deserialize_with = "super::rate::optional_rate")]
    pub rate_limit: Option<SendRate>,
    /// Most emails in any one second under `rate_limit`; default (unset) one second's
    /// worth, no burst. Above that, an idle fleet may send the difference at once.
    pub rate_burst: Option<u32>,
}

impl Default for TransportSettings {
    fn default() -> Self {
        Self {
            url: None,
            providers: Vec::new(),
            pool_size: 64,
            timeout: Duration::from_secs(20),
            default_from: None,
            message_id_domain: "postie.local".into(),
            breaker_threshold: 5,
            rate_limit: None,
            rate_burst: None,
        }
    }
}

impl TransportSettings {
    /// The most one send may take, from taking a connection to the transport's final
    /// reply: `2 × transport.timeout`. Each step is bounded by `transport.timeout` on
    /// its own; a healthy transport answers each in milliseconds, so the whole send
    /// gets room for one step that almost times out plus the rest. A claim must have
    /// this much lease left when its send starts, so `worker.lease` may not be shorter.
    pub(crate) fn send_deadline(&self) -> Duration {
        self.timeout * 2
    }

    /// The one transport's URL: `url`, else [`DEFAULT_URL`].
    pub(crate) fn one_url(&self) -> &str {
        self.url
            .as_ref()
            .map_or(DEFAULT_URL, |url| url.expose_secret())
    }

    /// The one transport (`url`) parsed ([`SmtpTransport::parse`]).
    pub fn one_transport(&self) -> Result<SmtpTransport, ConfigError> {
        SmtpTransport::parse(self.one_url())
    }
}

/// The old `smtp.*` names a configuration used ([`move_old_smtp_keys`]).
#[derive(Debug, Default)]
pub(super) struct OldNames {
    /// Read as `transport.<key>`.
    moved: Vec<&'static str>,
    /// `smtp.url` beside a `transport.providers` list: ignored, as it always was.
    url_ignored: bool,
}

impl OldNames {
    /// One line for each old name, for the log once it is up.
    pub(super) fn warnings(&self) -> Vec<String> {
        let ignored = self.url_ignored.then(|| {
            "smtp.url is ignored, as before: transport.providers is set; remove it (its new \
             name is transport.url)"
                .to_string()
        });
        self.moved
            .iter()
            .map(|key| {
                format!(
                    "smtp.{key} is the old name of transport.{key} (POSTIE__TRANSPORT__{}): it \
                     is read as before, but will not be forever; rename it",
                    key.to_uppercase()
                )
            })
            .chain(ignored)
            .collect()
    }

    /// `error` worded with the names the configuration used: `transport.<key>` read
    /// from an old `smtp.<key>` is named as written.
    pub(super) fn as_written(&self, error: ConfigError) -> ConfigError {
        let mut text = error.0;
        for key in &self.moved {
            text = text.replace(&format!("transport.{key}"), &format!("smtp.{key}"));
        }
        ConfigError(text)
    }
}

/// Moves each old `smtp.<key>` of [`OLD_SMTP_KEYS`] found in the merged layers
/// (`root`: the file and the environment, before deserializing) to
/// `transport.<key>`, and says which, for their warnings. A key set under both names
/// is refused: which one was meant is not for postie to guess. `smtp.url` beside a
/// `transport.providers` list is dropped, as the list always overruled it.
pub(super) fn move_old_smtp_keys(root: &mut config::Value) -> Result<OldNames, ConfigError> {
    use config::ValueKind::{Array, Table};
    let mut names = OldNames::default();
    let Table(sections) = &mut root.kind else {
        return Ok(names);
    };
    let old: Vec<&'static str> = match sections.get("smtp").map(|v| &v.kind) {
        Some(Table(smtp)) => OLD_SMTP_KEYS
            .into_iter()
            .filter(|key| smtp.contains_key(*key))
            .collect(),
        _ => Vec::new(),
    };
    if old.is_empty() {
        return Ok(names);
    }
    let new = sections
        .entry("transport".to_string())
        .or_insert_with(|| config::Value::new(None, Table(config::Map::new())));
    // Not a table: deserializing refuses `transport` with its own words.
    let Table(transport) = &mut new.kind else {
        return Ok(names);
    };
    if let Some(key) = old.iter().find(|key| transport.contains_key(**key)) {
        return Err(ConfigError(format!(
            "smtp.{key} and transport.{key} are both set, and they are one key \
             (smtp.{key} is its old name): keep transport.{key} alone"
        )));
    }
    let providers = transport
        .get("providers")
        .is_some_and(|list| !matches!(&list.kind, Array(entries) if entries.is_empty()));
    let Some(Table(smtp)) = sections.get_mut("smtp").map(|v| &mut v.kind) else {
        unreachable!("smtp was a table a moment ago");
    };
    let (mut moved, kept): (Vec<_>, Vec<_>) = std::mem::take(smtp)
        .into_iter()
        .partition(|(key, _)| OLD_SMTP_KEYS.contains(&key.as_str()));
    *smtp = kept.into_iter().collect();
    names.url_ignored = providers && old.contains(&"url");
    if names.url_ignored {
        moved.retain(|(key, _)| key != "url");
    }
    names.moved = old
        .into_iter()
        .filter(|key| !(names.url_ignored && *key == "url"))
        .collect();
    let Some(Table(transport)) = sections.get_mut("transport").map(|v| &mut v.kind) else {
        unreachable!("transport is a table");
    };
    transport.extend(moved);
    Ok(names)
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
    /// Every transport, in order of preference (see the module's doc).
    pub(crate) fn provider_plans(&self) -> Result<Vec<ProviderPlan>, ConfigError> {
        let providers = &self.transport.providers;
        if providers.is_empty() {
            let transport = self.transport.one_transport()?;
            return Ok(vec![ProviderPlan {
                name: transport.kind().to_string(),
                transport,
                rate_limit: self.transport.rate_limit,
                rate_burst: self.transport.rate_burst,
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

/// One entry: postie's parameters taken out, the rest parsed as `transport.url` is. The
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
        .map_err(|e| ConfigError(e.0.replacen("transport.url", key, 1)))?;
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
    fn one_transport_from_transport_url_with_its_rate() {
        let s = settings(&[
            ("POSTIE__TRANSPORT__URL", "smtp://127.0.0.1:2525"),
            ("POSTIE__TRANSPORT__RATE_LIMIT", "14/s"),
        ])
        .unwrap();
        let plans = s.provider_plans().unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].name, "smtp");
        assert_eq!(plans[0].rate_limit, SendRate::parse("14/s").ok());
        let s = settings(&[]).unwrap();
        let plans = s.provider_plans().unwrap();
        assert!(
            matches!(&plans[0].transport, SmtpTransport::Relay(e) if e.port == 1025),
            "unset: {DEFAULT_URL}"
        );
    }

    /// Each old name with a value of its kind, and the value read back from the new.
    const OLD: [(&str, &str); 8] = [
        ("URL", "file:///tmp/postie-old-names"),
        ("POOL_SIZE", "3"),
        ("TIMEOUT", "7s"),
        ("DEFAULT_FROM", "Shop <noreply@shop.example>"),
        ("MESSAGE_ID_DOMAIN", "shop.example"),
        ("BREAKER_THRESHOLD", "9"),
        ("RATE_LIMIT", "14/s"),
        ("RATE_BURST", "20"),
    ];

    fn as_vars<'a>(pairs: &'a [(String, &'a str)]) -> Vec<(&'a str, &'a str)> {
        pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect()
    }

    fn read_back(s: &super::super::Settings) -> Vec<String> {
        let t = &s.transport;
        vec![
            t.one_url().to_string(),
            t.pool_size.to_string(),
            humantime::format_duration(t.timeout).to_string(),
            t.default_from.clone().unwrap_or_default(),
            t.message_id_domain.clone(),
            t.breaker_threshold.to_string(),
            t.rate_limit.map(|r| format!("{r:?}")).unwrap_or_default(),
            t.rate_burst.map(|b| b.to_string()).unwrap_or_default(),
        ]
    }

    #[test]
    fn old_smtp_names_still_read_each_with_one_warning() {
        assert_eq!(
            OLD.map(|(k, _)| k.to_lowercase()),
            OLD_SMTP_KEYS.map(String::from),
            "every moved key is tried"
        );
        let new: Vec<(String, &str)> = OLD
            .iter()
            .map(|(k, v)| (format!("POSTIE__TRANSPORT__{k}"), *v))
            .collect();
        let old: Vec<(String, &str)> = OLD
            .iter()
            .map(|(k, v)| (format!("POSTIE__SMTP__{k}"), *v))
            .collect();
        let by_new = settings(&as_vars(&new)).unwrap();
        assert!(by_new.warnings().is_empty(), "{:?}", by_new.warnings());
        let by_old = settings(&as_vars(&old)).unwrap();
        assert_eq!(read_back(&by_old), read_back(&by_new));
        assert_ne!(
            read_back(&by_old),
            read_back(&super::super::Settings::default()),
            "the values are not the defaults"
        );
        let warnings = by_old.warnings();
        assert_eq!(warnings.len(), OLD.len(), "{warnings:?}");
        for (key, warning) in OLD_SMTP_KEYS.iter().zip(&warnings) {
            assert!(
                warning.starts_with(&format!("smtp.{key} is the old name of transport.{key} ")),
                "{warning}"
            );
            assert!(!warning.contains('\n'), "one line: {warning}");
        }
        // One old name among new ones: its warning alone; the SMTP-only keys stay.
        let s = settings(&[
            ("POSTIE__SMTP__TIMEOUT", "7s"),
            ("POSTIE__SMTP__CHUNKING", "false"),
            ("POSTIE__TRANSPORT__POOL_SIZE", "3"),
        ])
        .unwrap();
        assert_eq!(s.warnings().len(), 1, "{:?}", s.warnings());
        assert!(!s.smtp.chunking && s.transport.pool_size == 3);
        assert_eq!(s.transport.timeout, std::time::Duration::from_secs(7));
    }

    #[test]
    fn old_names_read_from_a_file_too_and_errors_name_the_key_as_written() {
        let dir = std::env::temp_dir().join(format!("postie-old-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("postie.toml");
        std::fs::write(&file, "[smtp]\ntimeout = \"7s\"\nchunking = false\n").unwrap();
        let load = |env: &[(&str, &str)]| {
            let env = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            super::super::Settings::load_from(Some(&file), Some(env))
        };
        let s = load(&[]).unwrap();
        assert_eq!(s.transport.timeout, std::time::Duration::from_secs(7));
        assert!(!s.smtp.chunking);
        assert_eq!(s.warnings().len(), 1);
        // The file's old name and the environment's new one: the same key twice.
        let err = load(&[("POSTIE__TRANSPORT__TIMEOUT", "5s")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("smtp.timeout and transport.timeout are both set"),
            "{err}"
        );
        std::fs::write(&file, "[smtp]\ntimeout = \"soon\"\n").unwrap();
        let err = load(&[]).unwrap_err().to_string();
        assert!(err.contains("smtp.timeout"), "{err}");
        std::fs::write(&file, "[smtp]\ntimeout = \"60s\"\n").unwrap();
        let err = load(&[]).unwrap_err().to_string();
        assert!(err.contains("lower smtp.timeout"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_old_smtp_url_beside_a_provider_list_is_ignored_as_before() {
        let s = settings(&[
            ("POSTIE__SMTP__URL", "smtp://127.0.0.1:2525"),
            ("POSTIE__SMTP__POOL_SIZE", "3"),
            (
                "POSTIE__TRANSPORT__PROVIDERS",
                "smtp://127.0.0.1:2626?name=a,smtp://127.0.0.1:2727?name=b",
            ),
        ])
        .unwrap();
        assert_eq!(s.transport.url.as_ref().map(|u| u.expose_secret()), None);
        assert_eq!(s.provider_plans().unwrap().len(), 2);
        assert_eq!(s.transport.pool_size, 3);
        let warnings = s.warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].starts_with("smtp.pool_size is the old name"));
        assert!(
            warnings[1].starts_with("smtp.url is ignored"),
            "{warnings:?}"
        );
        // The new name beside the list is refused, as it always was.
        let err = settings(&[
            ("POSTIE__TRANSPORT__URL", "smtp://127.0.0.1:2525"),
            ("POSTIE__TRANSPORT__PROVIDERS", "smtp://127.0.0.1:2626"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("not both"), "{err}");
    }

    #[test]
    fn a_key_set_under_its_old_and_its_new_name_stops_start_up() {
        for (key, value) in OLD {
            let old = format!("POSTIE__SMTP__{key}");
            let new = format!("POSTIE__TRANSPORT__{key}");
            let err = settings(&[(&old, value), (&new, value)])
                .unwrap_err()
                .to_string();
            let key = key.to_lowercase();
            assert_eq!(
                err,
                format!(
                    "configuration error: smtp.{key} and transport.{key} are both set, and \
                     they are one key (smtp.{key} is its old name): keep transport.{key} alone"
                )
            );
        }
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
