//! RabbitMQ's management HTTP API, for the one thing AMQP cannot tell postie: how many
//! messages the delayed-message plugin still holds for an exchange (its
//! `messages_delayed`, shown as "messages delayed" on the exchange's page). `postie
//! status` asks it for every drained prefix (`topology.drain_prefixes`).

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};

use crate::endpoint::redact_url;

/// An exchange as the management API describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExchangeInfo {
    /// Its type (`direct`, `x-delayed-message`, …).
    pub(crate) kind: String,
    /// Messages the delayed-message plugin holds for it (only that plugin's exchanges
    /// report it).
    pub(crate) messages_delayed: Option<u64>,
}

impl ExchangeInfo {
    /// Reads the API's JSON description of an exchange.
    pub(crate) fn from_json(value: &serde_json::Value) -> Option<Self> {
        Some(Self {
            kind: value.get("type")?.as_str()?.to_string(),
            messages_delayed: value.get("messages_delayed").and_then(|v| v.as_u64()),
        })
    }
}

/// `GET /api/exchanges/<vhost>/<exchange>` on `base` (`http://user:pass@host:15672`),
/// within `timeout`: `None` if there is no such exchange. The vhost is given as it
/// stands in an AMQP URL's path (percent-encoded, `%2f` for `/`).
pub(crate) async fn exchange_info(
    base: &SecretString,
    vhost: &str,
    exchange: &str,
    timeout: Duration,
) -> anyhow::Result<Option<ExchangeInfo>> {
    let shown = redact_url(base.expose_secret());
    let mut url = url::Url::parse(base.expose_secret())
        .map_err(|e| anyhow::anyhow!("amqp.management_url {shown}: {e}"))?;
    if url.scheme() != "http" {
        anyhow::bail!("amqp.management_url {shown}: only http:// is supported");
    }
    let user = crate::endpoint::percent_decode(url.username());
    let password = url.password().map(crate::endpoint::percent_decode);
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let vhost = if vhost.is_empty() { "%2f" } else { vhost };
    let exchange: String = url::form_urlencoded::byte_serialize(exchange.as_bytes()).collect();
    let target = format!(
        "{}/api/exchanges/{vhost}/{exchange}",
        url.as_str().trim_end_matches('/')
    );
    let mut request = reqwest::Client::new().get(&target).timeout(timeout);
    if !user.is_empty() {
        request = request.basic_auth(user, password);
    }
    let response = request.send().await.map_err(|e| {
        anyhow::anyhow!("RabbitMQ's management API at {shown}: {}", e.without_url())
    })?;
    match response.status() {
        reqwest::StatusCode::NOT_FOUND => Ok(None),
        status if status.is_success() => {
            let value: serde_json::Value = response.json().await.map_err(|e| {
                anyhow::anyhow!("RabbitMQ's management API at {shown}: {}", e.without_url())
            })?;
            ExchangeInfo::from_json(&value).map(Some).ok_or_else(|| {
                anyhow::anyhow!(
                    "RabbitMQ's management API at {shown}: no exchange type in its answer"
                )
            })
        }
        status => anyhow::bail!("RabbitMQ's management API at {shown} answered {status}"),
    }
}

/// The vhost part of an AMQP URL, as it stands (percent-encoded); empty for the
/// default vhost.
pub(crate) fn vhost_of(amqp_url: &str) -> String {
    url::Url::parse(amqp_url)
        .map(|u| u.path().trim_start_matches('/').to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_plugins_count_and_the_type() {
        let plugin = serde_json::json!({
            "name": "postie.delayed", "type": "x-delayed-message",
            "arguments": {"x-delayed-type": "direct"}, "messages_delayed": 40
        });
        assert_eq!(
            ExchangeInfo::from_json(&plugin),
            Some(ExchangeInfo {
                kind: "x-delayed-message".into(),
                messages_delayed: Some(40)
            })
        );
        let direct = serde_json::json!({"name": "postie.delayed", "type": "direct"});
        assert_eq!(
            ExchangeInfo::from_json(&direct).unwrap().messages_delayed,
            None
        );
        assert_eq!(ExchangeInfo::from_json(&serde_json::json!({})), None);
    }

    #[test]
    fn the_vhost_stays_encoded() {
        assert_eq!(vhost_of("amqp://u:p@h:5672/%2f"), "%2f");
        assert_eq!(vhost_of("amqp://u:p@h:5672/mail"), "mail");
        assert_eq!(vhost_of("amqp://u:p@h:5672"), "");
    }
}
