//! The schema migrations in `sql/`, applied in order, each once, one instance at a time.

use super::{DbError, Inbox};

/// The migrations in `sql/`, applied in order, each once.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "inbox", include_str!("../../sql/0001_inbox.sql")),
    (
        2,
        "cancel_throttle_pending",
        include_str!("../../sql/0002_cancel_throttle_pending.sql"),
    ),
    (
        3,
        "drop_status_index",
        include_str!("../../sql/0003_drop_status_index.sql"),
    ),
    (4, "retention", include_str!("../../sql/0004_retention.sql")),
    (
        5,
        "rate_limit",
        include_str!("../../sql/0005_rate_limit.sql"),
    ),
    (7, "reconcile", include_str!("../../sql/0007_reconcile.sql")),
    (
        8,
        "claim_in_one_update",
        include_str!("../../sql/0008_claim_in_one_update.sql"),
    ),
    (
        9,
        "reconcile_arrived",
        include_str!("../../sql/0009_reconcile_arrived.sql"),
    ),
];

/// Arbitrary constant for `pg_advisory_lock`, so concurrent start-ups migrate one at a time.
const MIGRATION_LOCK: i64 = 0x706f_7374_6965; // "postie"

impl Inbox {
    /// Applies pending migrations under an advisory lock.
    pub async fn migrate(&self) -> Result<Vec<String>, DbError> {
        let mut client = self.pool.get().await?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        let result = async {
            client
                .batch_execute(
                    "CREATE TABLE IF NOT EXISTS postie_migrations (
                        version integer PRIMARY KEY,
                        name text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT now())",
                )
                .await?;
            let mut applied = Vec::new();
            for (version, name, sql) in MIGRATIONS {
                let done = client
                    .query_opt(
                        "SELECT 1 FROM postie_migrations WHERE version = $1",
                        &[version],
                    )
                    .await?
                    .is_some();
                if done {
                    continue;
                }
                let tx = client.transaction().await?;
                tx.batch_execute(sql).await?;
                tx.execute(
                    "INSERT INTO postie_migrations (version, name) VALUES ($1, $2)",
                    &[version, name],
                )
                .await?;
                tx.commit().await?;
                applied.push(format!("{version:04}_{name}"));
            }
            Ok::<_, DbError>(applied)
        }
        .await;
        client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await?;
        result
    }
}
