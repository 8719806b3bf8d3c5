//! `postie migrate`: apply the database migrations in `sql/`.

use crate::config::Settings;
use crate::inbox::Inbox;

/// Applies pending migrations and prints what it applied.
pub(super) async fn run(settings: &Settings) -> anyhow::Result<()> {
    let applied = Inbox::connect(&settings.database).await?.migrate().await?;
    if applied.is_empty() {
        out!("database is up to date");
    }
    for name in applied {
        out!("applied {name}");
    }
    Ok(())
}
