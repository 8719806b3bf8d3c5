//! `postie prune`: one retention pass by hand.

use crate::config::Settings;
use crate::inbox::{Inbox, PrunePlan};

/// Arguments of `postie prune`.
#[derive(clap::Args)]
pub struct PruneArgs {
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

/// Runs one pass (the one the maintenance instance runs every `inbox.prune_interval`).
pub(super) async fn run(settings: &Settings, args: &PruneArgs) -> anyhow::Result<()> {
    let inbox = Inbox::connect(&settings.database).await?;
    let plan = PrunePlan::from_settings(settings, args.dry_run);
    let pruned = inbox.prune(&plan).await?;
    let verb = if args.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    out!(
        "{verb}: {} finished rows (older than {}), {} tombstones (older than {}), {} throttle rows, {} bounce and complaint records and send tallies",
        pruned.finished,
        humantime::format_duration(plan.retention),
        pruned.tombstones,
        humantime::format_duration(plan.tombstone_retention),
        pruned.throttle,
        pruned.feedback
    );
    out!(
        "in {:.3}s, {} statements",
        pruned.took.as_secs_f64(),
        pruned.statements
    );
    Ok(())
}
