//! Choosing the delay mode: `delay.mode = auto` probes the broker once at start-up,
//! on throwaway connections (a failed probe closes the whole connection).

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;

use super::topology::{classify, insert, string, Topology, TopologyError};
use crate::config::{DelayMode, Settings, TopologySettings};

/// Resolves `delay.mode` (probing the broker for `auto`), logs the choice, and names
/// the topology.
pub async fn resolve_topology(settings: &Settings) -> anyhow::Result<Topology> {
    let mode = resolve_mode(
        settings.delay.mode,
        &settings.topology,
        &settings.amqp.url,
        settings.amqp.connect_timeout,
    )
    .await?;
    if mode != settings.delay.mode {
        tracing::info!(
            configured = settings.delay.mode.as_str(),
            chosen = mode.as_str(),
            "delay mode probed"
        );
    }
    Ok(Topology::new(&settings.topology, &settings.delay, mode))
}

/// Resolves `auto` on throwaway connections, since a failed probe closes
/// the whole connection: an existing `<p>.delayed` keeps its mode; on a fresh broker,
/// `plugin` if the plugin is enabled, else `ladder`. Other modes are returned as set.
pub async fn resolve_mode(
    configured: DelayMode,
    settings: &TopologySettings,
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<DelayMode> {
    if configured != DelayMode::Auto {
        return Ok(configured);
    }
    let delayed = format!("{}.delayed", settings.prefix);
    // Does it exist? (passive declare; a 404 closes only the channel)
    let conn = super::amqp::connect(amqp_url, "postie-probe", timeout).await?;
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
            DelayMode::Ladder
        } else {
            DelayMode::Plugin
        });
    }
    let _ = conn.close(200, "probed".into()).await;
    Ok(if probe_plugin(amqp_url, timeout).await? {
        DelayMode::Plugin
    } else {
        DelayMode::Ladder
    })
}

/// True if the broker knows the `x-delayed-message` exchange type. Declares and
/// deletes a throwaway exchange on a throwaway connection.
pub async fn probe_plugin(
    amqp_url: &secrecy::SecretString,
    timeout: Duration,
) -> anyhow::Result<bool> {
    let conn = super::amqp::connect(amqp_url, "postie-probe", timeout).await?;
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
    match result {
        Ok(()) => {
            let _ = channel
                .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                .await;
            let _ = conn.close(200, "probed".into()).await;
            Ok(true)
        }
        Err(e) => match classify(name, e) {
            TopologyError::PluginMissing { .. } => Ok(false),
            other => Err(other.into()),
        },
    }
}
