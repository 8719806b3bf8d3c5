//! `postie cancel KEY [--revision N]`: cancel a key at once.

use crate::config::{KeyNamespace, Settings};
use crate::contract::IdempotencyKey;
use crate::inbox::{Inbox, Status};

/// Arguments of `postie cancel`.
#[derive(clap::Args)]
pub struct CancelArgs {
    /// The idempotency key.
    key: String,
    /// Cancel revisions up to this one (default: the newest seen).
    #[arg(long)]
    revision: Option<i32>,
    /// The producer's RabbitMQ user whose key it is: required, and only allowed,
    /// with `worker.key_namespace = "user_id"`.
    #[arg(long)]
    user: Option<String>,
}

/// Cancels the key up to the revision (None: the newest seen) and says what that meant.
pub(super) async fn run(settings: &Settings, args: &CancelArgs) -> anyhow::Result<()> {
    let key = IdempotencyKey::parse(&args.key).map_err(|e| anyhow::anyhow!("{e}"))?;
    let key = match (settings.worker.key_namespace, &args.user) {
        (KeyNamespace::Off, None) => key,
        (KeyNamespace::UserId, Some(user)) => key.in_namespace(user),
        (KeyNamespace::Off, Some(_)) => {
            anyhow::bail!("--user names a key space, but worker.key_namespace is off")
        }
        (KeyNamespace::UserId, None) => anyhow::bail!(
            "worker.key_namespace = \"user_id\": name the producer's RabbitMQ user with --user"
        ),
    };
    let inbox = Inbox::connect(&settings.database)
        .await?
        .with_events(settings.events.enabled);
    inbox.migrate().await?;
    let cancelled = inbox.cancel(key.as_str(), args.revision).await?;
    let what = match cancelled.prior_status {
        Status::Sent => "already sent: nothing to cancel".to_string(),
        Status::Sending => {
            "being sent right now: it may still go out; later deliveries are cancelled".to_string()
        }
        Status::New => format!(
            "not seen yet: kept as a tombstone; a job for it up to revision {} will be skipped",
            cancelled.covers
        ),
        _ => format!("cancelled (revisions up to {})", cancelled.covers),
    };
    out!("{key}: {what}");
    Ok(())
}
