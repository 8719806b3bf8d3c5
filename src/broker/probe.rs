//! Choosing the delay mode: `delay.mode = auto` probes the broker once at start-up,
//! on throwaway connections (a failed probe closes the whole connection).
//!
//! The plugin's absence is read from the broker's text: 503 on 3.x, 406 on 4.3. While
//! it expects those refusals the probe holds `ops::telemetry`'s `ExpectedRefusals`,
//! which keeps lapin's log lines about them out of the log.

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;

use super::declare::{classify, TopologyError};
use crate::config::{AmqpAddresses, DelayMode, Settings, TopologySettings};
use crate::ops::telemetry::ExpectedRefusals;
use crate::topology::{insert, string, Topology};

/// Resolves `delay.mode` (probing the broker for `auto`), logs the choice and why in
/// one INFO line, and names the topology.
pub(crate) async fn resolve_topology(settings: &Settings) -> anyhow::Result<Topology> {
    let probed = probe_mode(
        settings.delay.mode,
        &settings.topology,
        &settings.amqp.url,
        settings.amqp.connect_timeout,
    )
    .await?;
    if settings.delay.mode == DelayMode::Auto {
        tracing::info!(
            configured = settings.delay.mode.as_str(),
            chosen = probed.mode.as_str(),
            "delay mode {}: {}",
            probed.mode.as_str(),
            probed.why
        );
    }
    Ok(Topology::new(
        &settings.topology,
        &settings.delay,
        probed.mode,
    ))
}

/// The delay mode chosen, and why, in words for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probed {
    /// The mode.
    pub mode: DelayMode,
    /// Why it was chosen.
    pub why: String,
}

/// [`probe_mode`]'s mode alone.
pub async fn resolve_mode(
    configured: DelayMode,
    settings: &TopologySettings,
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<DelayMode> {
    Ok(probe_mode(configured, settings, amqp_url, timeout)
        .await?
        .mode)
}

/// Resolves `auto` on throwaway connections, since a failed probe closes
/// the whole connection: an existing `<p>.delayed` keeps its mode; on a fresh broker,
/// `plugin` if the plugin is enabled, else `ladder`. Other modes are returned as set.
///
/// The refusals the probe expects (404 for a missing exchange, 503 or 406 for an
/// unknown exchange type) are not logged as errors: see [`ExpectedRefusals`].
pub(crate) async fn probe_mode(
    configured: DelayMode,
    settings: &TopologySettings,
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<Probed> {
    if configured != DelayMode::Auto {
        return Ok(Probed {
            mode: configured,
            why: "set by delay.mode".into(),
        });
    }
    let _quiet = ExpectedRefusals::begin();
    let delayed = format!("{}.delayed", settings.prefix);
    // Does it exist? (passive declare; a 404 closes only the channel)
    let addresses = AmqpAddresses::parse(amqp_url)?;
    let conn = super::amqp::connect(&addresses, "postie-probe", timeout)
        .await?
        .connection;
    let channel = conn.create_channel().await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let exists = channel
        .exchange_declare(
            delayed.as_str().into(),
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await
        .is_ok();
    if exists {
        // Redeclaring as direct succeeds only if it is direct (ladder); 406 otherwise.
        let channel = conn.create_channel().await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let is_direct = channel
            .exchange_declare(
                delayed.as_str().into(),
                ExchangeKind::Direct,
                durable,
                FieldTable::default(),
            )
            .await
            .is_ok();
        let _ = conn.close(200, "probed".into()).await;
        return Ok(if is_direct {
            Probed {
                mode: DelayMode::Ladder,
                why: format!("auto: {delayed} exists as a direct exchange (ladder mode)"),
            }
        } else {
            Probed {
                mode: DelayMode::Plugin,
                why: format!("auto: {delayed} exists as an x-delayed-message exchange"),
            }
        });
    }
    let _ = conn.close(200, "probed".into()).await;
    Ok(match plugin_refusal(amqp_url, timeout).await? {
        None => Probed {
            mode: DelayMode::Plugin,
            why: "auto: the broker has the delayed-message plugin".into(),
        },
        Some(refusal) => Probed {
            mode: DelayMode::Ladder,
            why: format!("auto: the broker has no delayed-message plugin ({refusal})"),
        },
    })
}

/// True if the broker knows the `x-delayed-message` exchange type. Declares and
/// deletes a throwaway exchange on a throwaway connection.
pub async fn probe_plugin(
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<bool> {
    let _quiet = ExpectedRefusals::begin();
    Ok(plugin_refusal(amqp_url, timeout).await?.is_none())
}

/// `None` if the broker knows the `x-delayed-message` exchange type, else its refusal
/// (RabbitMQ 3.x: 503 COMMAND_INVALID, closing the connection; 4.3: 406
/// PRECONDITION_FAILED; both "unknown exchange type"). Any other refusal is an error.
async fn plugin_refusal(
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<Option<String>> {
    let addresses = AmqpAddresses::parse(amqp_url)?;
    let conn = super::amqp::connect(&addresses, "postie-probe", timeout)
        .await?
        .connection;
    let channel = conn.create_channel().await?;
    let name = format!("postie.probe.{}", uuid::Uuid::new_v4().simple());
    let mut args = FieldTable::default();
    insert(&mut args, "x-delayed-type", string("direct"));
    let options = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    let result = channel
        .exchange_declare(
            name.as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            options,
            args,
        )
        .await;
    if result.is_ok() {
        let _ = channel
            .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
            .await;
        let _ = conn.close(200, "probed".into()).await;
    } else {
        let _ = conn.close(200, "probed".into()).await;
        // On 3.x the refusal closes the connection, and lapin logs that from its I/O
        // thread after the declare has returned: stay quiet until it has.
        let settled = async {
            while !(conn.status().errored() || conn.status().closed()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), settled).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match result {
        Ok(()) => Ok(None),
        Err(e) => match classify(name, e) {
            TopologyError::PluginMissing { detail } => Ok(Some(detail)),
            other => Err(other.into()),
        },
    }
}
