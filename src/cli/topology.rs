//! `postie topology [--delete]`: declare the exchanges and queues, or delete them.

use crate::broker;
use crate::config::Settings;

/// Arguments of `postie topology`.
#[derive(clap::Args)]
pub struct TopologyArgs {
    /// Delete every queue and exchange under the prefix instead (loses their messages).
    #[arg(long)]
    delete: bool,
}

/// Declares the topology (or deletes it) and prints the mode and the names.
pub(super) async fn run(settings: &Settings, args: &TopologyArgs) -> anyhow::Result<()> {
    let topology = broker::resolve_topology(settings).await?;
    let conn = broker::connect(
        &settings.amqp.addresses()?,
        "postie-topology",
        settings.amqp.connect_timeout,
    )
    .await
    .map(|c| c.connection)?;
    let channel = conn.create_channel().await?;
    if args.delete {
        topology.delete(&channel).await?;
        out!(
            "deleted every queue and exchange under {:?}",
            settings.topology.prefix
        );
    } else {
        if topology.declare_on(&conn).await? == broker::DeadLimit::Lacking {
            out!(
                "WARNING: {}",
                broker::dead::unprotected_warning(topology.dead_queue())
            );
        }
        out!(
            "delay mode: {} (configured: {})",
            topology.mode_name(),
            settings.delay.mode.as_str()
        );
        out!("exchanges: {}", topology.exchanges().join(", "));
        out!("queues:    {}", topology.queues().join(", "));
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
