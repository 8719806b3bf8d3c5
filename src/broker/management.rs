//! RabbitMQ's management HTTP API, for what AMQP cannot tell postie: how many
//! messages the delayed-message plugin still holds for an exchange (its
//! `messages_delayed`, shown as "messages delayed" on the exchange's page; `postie
//! status` asks it for every drained prefix, `topology.drain_prefixes`), and which
//! policy gives a queue its delivery limit (`postie status`'s check of `<p>.dead`,
//! `broker::dead`).
//!
//! `amqp.management_url` is `https://` (certificates verified against the system's
//! roots, `ops::https`), or `http://` to this machine only (`endpoint::is_loopback_host`)
//! unless `amqp.management_allow_http` says otherwise: its password would cross the
//! network in clear (`config::validate` refuses it at start-up). Each request is
//! bounded by a timeout and its answer by [`MAX_ANSWER_BYTES`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use secrecy::{ExposeSecret, SecretString};

use crate::endpoint::redact_url;
use crate::ops::https;

/// The longest answer read from the management API: 1 MiB (one exchange's or
/// queue's description is a few KiB).
pub(crate) const MAX_ANSWER_BYTES: usize = 1 << 20;

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

/// The delivery limit a policy gives a queue, as the management API describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueuePolicy {
    /// The policy's name (an operator policy's if only that one sets the limit).
    pub(crate) name: String,
    /// Its `delivery-limit`, if it sets one.
    pub(crate) delivery_limit: Option<i64>,
}

impl QueuePolicy {
    /// Reads the API's JSON description of a queue: its effective policy's
    /// `delivery-limit` and the policy's name, `None` if no policy applies.
    pub(crate) fn from_json(value: &serde_json::Value) -> Option<Self> {
        let limit = value
            .get("effective_policy_definition")
            .and_then(|d| d.get("delivery-limit"))
            .and_then(serde_json::Value::as_i64);
        let name = ["policy", "operator_policy"]
            .iter()
            .filter_map(|key| value.get(*key).and_then(serde_json::Value::as_str))
            .find(|name| !name.is_empty())?;
        Some(Self {
            name: name.to_string(),
            delivery_limit: limit,
        })
    }
}

/// `GET /api/exchanges/<vhost>/<exchange>` on `base`: `None` if there is no such
/// exchange. The vhost is given as it stands in an AMQP URL's path (percent-encoded,
/// `%2f` for `/`).
pub(crate) async fn exchange_info(
    base: &SecretString,
    vhost: &str,
    exchange: &str,
    timeout: Duration,
) -> anyhow::Result<Option<ExchangeInfo>> {
    let shown = redact_url(base.expose_secret());
    let Some(value) = get(base, "exchanges", vhost, exchange, timeout).await? else {
        return Ok(None);
    };
    ExchangeInfo::from_json(&value).map(Some).ok_or_else(|| {
        anyhow::anyhow!("RabbitMQ's management API at {shown}: no exchange type in its answer")
    })
}

/// `GET /api/queues/<vhost>/<queue>` on `base`: the policy that applies to the
/// queue, `Ok(None)` if none does or there is no such queue.
pub(crate) async fn queue_policy(
    base: &SecretString,
    vhost: &str,
    queue: &str,
    timeout: Duration,
) -> anyhow::Result<Option<QueuePolicy>> {
    let value = get(base, "queues", vhost, queue, timeout).await?;
    Ok(value.as_ref().and_then(QueuePolicy::from_json))
}

/// `GET /api/<kind>/<vhost>/<name>` on `base`, within `timeout`, its answer read up to
/// [`MAX_ANSWER_BYTES`]: the JSON, `None` on a 404.
async fn get(
    base: &SecretString,
    kind: &str,
    vhost: &str,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Option<serde_json::Value>> {
    let shown = redact_url(base.expose_secret());
    let fail = |what: String| anyhow::anyhow!("RabbitMQ's management API at {shown}: {what}");
    let (target, authorization) = target(base, kind, vhost, name)?;
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https::connector(timeout)?);
    let mut request = http::Request::get(target.as_str());
    if let Some(value) = authorization {
        request = request.header(http::header::AUTHORIZATION, value);
    }
    let request = request
        .body(Full::new(Bytes::new()))
        .map_err(|e| fail(format!("bad request: {e}")))?;
    let exchange = async {
        // The client's errors name neither the URL's password nor the headers.
        let response = client
            .request(request)
            .await
            .map_err(|e| fail(crate::error_chain(&e)))?;
        let status = response.status();
        let body = https::read_body(response.into_body(), MAX_ANSWER_BYTES)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok::<_, anyhow::Error>((status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| {
            fail(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            ))
        })??;
    match status {
        http::StatusCode::NOT_FOUND => Ok(None),
        status if status.is_success() => serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| fail(format!("its answer is not JSON: {e}"))),
        status => Err(fail(format!("answered {status}"))),
    }
}

/// The request's URL (no user or password in it) and its `Authorization` header,
/// from `base`: `https://`, or `http://` (which [`crate::config`] allows only to this
/// machine unless `amqp.management_allow_http`).
fn target(
    base: &SecretString,
    kind: &str,
    vhost: &str,
    name: &str,
) -> anyhow::Result<(String, Option<String>)> {
    let shown = redact_url(base.expose_secret());
    let mut url = url::Url::parse(base.expose_secret())
        .map_err(|e| anyhow::anyhow!("amqp.management_url {shown}: {e}"))?;
    if !matches!(url.scheme(), "https" | "http") {
        anyhow::bail!("amqp.management_url {shown}: https:// (or http:// to this machine) only");
    }
    let user = crate::endpoint::percent_decode(url.username());
    let password = url.password().map(crate::endpoint::percent_decode);
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let vhost = if vhost.is_empty() { "%2f" } else { vhost };
    let name: String = url::form_urlencoded::byte_serialize(name.as_bytes()).collect();
    let target = format!(
        "{}/api/{kind}/{vhost}/{name}",
        url.as_str().trim_end_matches('/')
    );
    let authorization = (!user.is_empty()).then(|| {
        use base64::Engine as _;
        let pair = format!("{user}:{}", password.unwrap_or_default());
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    });
    Ok((target, authorization))
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
    fn reads_the_policy_that_gives_a_queue_its_limit() {
        let with = serde_json::json!({
            "name": "p.dead", "policy": "postie-dead", "operator_policy": null,
            "effective_policy_definition": {"delivery-limit": 2147483647}
        });
        assert_eq!(
            QueuePolicy::from_json(&with),
            Some(QueuePolicy {
                name: "postie-dead".into(),
                delivery_limit: Some(2_147_483_647)
            })
        );
        let operator = serde_json::json!({
            "policy": "", "operator_policy": "ops",
            "effective_policy_definition": {"max-length": 10}
        });
        assert_eq!(
            QueuePolicy::from_json(&operator).map(|p| (p.name, p.delivery_limit)),
            Some(("ops".into(), None))
        );
        let none = serde_json::json!({"name": "p.dead", "effective_policy_definition": {}});
        assert_eq!(QueuePolicy::from_json(&none), None);
    }

    #[test]
    fn the_request_carries_no_password_in_its_url() {
        let base = SecretString::from("https://admin:p%40ss@mq.example:15671/");
        let (url, auth) = target(&base, "queues", "%2f", "p.dead").unwrap();
        assert_eq!(url, "https://mq.example:15671/api/queues/%2f/p.dead");
        // base64("admin:p@ss")
        assert_eq!(auth.as_deref(), Some("Basic YWRtaW46cEBzcw=="));
        let ftp = SecretString::from("ftp://u:secret@mq.example");
        let refused = target(&ftp, "queues", "", "q").unwrap_err().to_string();
        assert!(!refused.contains("secret"), "{refused}");
    }

    #[test]
    fn the_vhost_stays_encoded() {
        assert_eq!(vhost_of("amqp://u:p@h:5672/%2f"), "%2f");
        assert_eq!(vhost_of("amqp://u:p@h:5672/mail"), "mail");
        assert_eq!(vhost_of("amqp://u:p@h:5672"), "");
    }
}
