//! The schema migrations in `sql/`, applied in order, each once, one instance at a time
//! (under an advisory lock). `sql/schema.sql` shows what they add up to.
//!
//! `postie_migrations` records each applied migration with the SHA-256 of its file
//! (`checksum`; recorded from the file as it is now for rows applied before checksums
//! existed). Before applying anything, and at start-up without migrating
//! ([`Inbox::check_schema`]), postie refuses a database that holds a migration it does
//! not know (migrated by a newer postie) or one whose file changed after it was applied.
//! [`Inbox::unapplied_migrations`] lists the migrations not yet applied, which
//! `postie status` names instead of a missing table's error.
//!
//! There is no 0006: no file of that number was ever committed (`git log --all --
//! sql/`). 0004, 0005 and 0007 were written at the same time for issues 14, 13 and 15
//! and 0006 was skipped between them; versions need not be contiguous, only increasing.

use sha2::{Digest, Sha256};

use super::{DbError, Inbox};

/// One file of `sql/`.
struct Migration {
    version: i32,
    /// The file's name without `.sql`: `NNNN_name`.
    file: &'static str,
    sql: &'static str,
}

macro_rules! migrations {
    ($(($version:literal, $file:literal)),* $(,)?) => {
        &[$(Migration {
            version: $version,
            file: $file,
            sql: include_str!(concat!("../../sql/", $file, ".sql")),
        }),*]
    };
}

/// The migrations in `sql/`, applied in order, each once.
const MIGRATIONS: &[Migration] = migrations![
    (1, "0001_inbox"),
    (2, "0002_cancel_throttle_pending"),
    (3, "0003_drop_status_index"),
    (4, "0004_retention"),
    (5, "0005_rate_limit"),
    // No 0006: see the module's doc.
    (7, "0007_reconcile"),
    (8, "0008_claim_in_one_update"),
    (9, "0009_reconcile_arrived"),
    (10, "0010_one_claim_function"),
    (11, "0011_provider"),
    (12, "0012_suppression"),
    (13, "0013_feedback"),
    (14, "0014_events"),
    (15, "0015_reputation"),
    (16, "0016_announced"),
    (17, "0017_reschedule_while_sending"),
    (18, "0018_breakers"),
    (19, "0019_lanes"),
    (20, "0020_tenants"),
    (21, "0021_feedback_trust"),
    (22, "0022_header_key"),
    (23, "0023_one_rate_engine"),
    (24, "0024_window_take"),
    (25, "0025_debounce"),
    (26, "0026_unsubscribed"),
];

/// Arbitrary constant for `pg_advisory_lock`, so concurrent start-ups migrate one at a time.
const MIGRATION_LOCK: i64 = 0x706f_7374_6965; // "postie"

/// The runner's own table: created (and given its checksum column) before anything
/// else, by every postie that migrates.
const BOOTSTRAP: &str = "CREATE TABLE IF NOT EXISTS postie_migrations (
        version integer PRIMARY KEY,
        name text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now());
    ALTER TABLE postie_migrations ADD COLUMN IF NOT EXISTS checksum text";

/// Why postie will not run against a database's schema.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// PostgreSQL failed or refused.
    #[error(transparent)]
    Db(#[from] DbError),
    /// The database holds a migration this postie does not have.
    #[error("the database holds migration {applied}, which this postie does not know (it knows up to {newest}): migrated by a newer postie; refusing to start — run that version or newer")]
    Unknown {
        /// The migration, `NNNN_name` as recorded.
        applied: String,
        /// The newest migration this postie has.
        newest: String,
    },
    /// A migration's file is not the one that was applied.
    #[error("migration {migration} changed after it was applied (recorded SHA-256 {recorded}, sql/{migration}.sql has {file}); refusing to start — an applied migration is never edited, a change is a new migration")]
    Changed {
        /// The migration, `NNNN_name`.
        migration: String,
        /// The checksum recorded when it was applied.
        recorded: String,
        /// The checksum of this postie's copy.
        file: String,
    },
}

/// One row of `postie_migrations`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Applied {
    version: i32,
    name: String,
    checksum: Option<String>,
}

impl Migration {
    /// What `postie_migrations.name` records: the file's name after `NNNN_`.
    fn name(&self) -> &'static str {
        self.file
            .split_once('_')
            .map_or(self.file, |(_, name)| name)
    }

    fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.sql.as_bytes()))
    }
}

/// Checks what a database recorded against this postie's migrations: the versions
/// applied before checksums existed (to be recorded now), or why not to go on.
fn verify(applied: &[Applied], known: &[Migration]) -> Result<Vec<i32>, MigrateError> {
    let mut backfill = Vec::new();
    for row in applied {
        let Some(migration) = known.iter().find(|m| m.version == row.version) else {
            return Err(MigrateError::Unknown {
                applied: format!("{:04}_{}", row.version, row.name),
                newest: known
                    .last()
                    .map_or_else(|| "none".into(), |m| m.file.to_string()),
            });
        };
        match &row.checksum {
            None => backfill.push(row.version),
            Some(recorded) if *recorded != migration.checksum() => {
                return Err(MigrateError::Changed {
                    migration: migration.file.to_string(),
                    recorded: recorded.clone(),
                    file: migration.checksum(),
                })
            }
            Some(_) => {}
        }
    }
    Ok(backfill)
}

/// The rows of `postie_migrations` (none if the table is missing); the checksum read
/// through `to_jsonb` so that a table an older postie made, without the column, reads too.
async fn applied(client: &tokio_postgres::Client) -> Result<Vec<Applied>, DbError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('postie_migrations') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT version, name, to_jsonb(m) ->> 'checksum' FROM postie_migrations m
              ORDER BY version",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Applied {
            version: r.get(0),
            name: r.get(1),
            checksum: r.get(2),
        })
        .collect())
}

impl Inbox {
    /// Applies pending migrations under an advisory lock, after checking those already
    /// applied (see [`MigrateError`]) and recording the checksums of rows applied
    /// before checksums existed. Returns what it applied (`NNNN_name`).
    pub async fn migrate(&self) -> Result<Vec<String>, MigrateError> {
        let mut client = self.pool.get().await.map_err(DbError::from)?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(DbError::from)?;
        let result = migrate_locked(&mut client).await;
        client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(DbError::from)?;
        result
    }

    /// At start-up without migrating: refuses (the same errors as [`Inbox::migrate`])
    /// a database migrated by a newer postie or whose applied migrations changed.
    /// Writes nothing; a database never migrated passes (its first statement will
    /// say what is missing).
    pub async fn check_schema(&self) -> Result<(), MigrateError> {
        let client = self.pool.get().await.map_err(DbError::from)?;
        verify(&applied(&client).await?, MIGRATIONS)?;
        Ok(())
    }

    /// The migrations this postie has that the database has not applied (their files,
    /// oldest first), for commands that read the inbox and would otherwise fail on a
    /// missing table. Writes nothing.
    pub(crate) async fn unapplied_migrations(&self) -> Result<Vec<&'static str>, MigrateError> {
        let client = self.pool.get().await.map_err(DbError::from)?;
        let recorded = applied(&client).await?;
        verify(&recorded, MIGRATIONS)?;
        Ok(unapplied(&recorded).map(|m| m.file).collect())
    }
}

/// This postie's migrations that `recorded` does not hold, oldest first.
fn unapplied(recorded: &[Applied]) -> impl Iterator<Item = &'static Migration> + '_ {
    (MIGRATIONS.iter()).filter(|m| !recorded.iter().any(|r| r.version == m.version))
}

async fn migrate_locked(client: &mut tokio_postgres::Client) -> Result<Vec<String>, MigrateError> {
    client
        .batch_execute(BOOTSTRAP)
        .await
        .map_err(DbError::from)?;
    let recorded = applied(client).await?;
    for version in verify(&recorded, MIGRATIONS)? {
        let migration = MIGRATIONS.iter().find(|m| m.version == version);
        let checksum = migration.map(Migration::checksum);
        client
            .execute(
                "UPDATE postie_migrations SET checksum = $2 WHERE version = $1 AND checksum IS NULL",
                &[&version, &checksum],
            )
            .await
            .map_err(DbError::from)?;
    }
    let mut done = Vec::new();
    for migration in unapplied(&recorded) {
        let tx = client.transaction().await.map_err(DbError::from)?;
        tx.batch_execute(migration.sql)
            .await
            .map_err(DbError::from)?;
        tx.execute(
            "INSERT INTO postie_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&migration.version, &migration.name(), &migration.checksum()],
        )
        .await
        .map_err(DbError::from)?;
        tx.commit().await.map_err(DbError::from)?;
        done.push(migration.file.to_string());
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(version: i32, checksum: Option<String>) -> Applied {
        Applied {
            version,
            name: "x".into(),
            checksum,
        }
    }

    #[test]
    fn versions_increase_and_files_are_named_by_them() {
        for pair in MIGRATIONS.windows(2) {
            assert!(pair[0].version < pair[1].version, "{}", pair[1].file);
        }
        for m in MIGRATIONS {
            assert_eq!(format!("{:04}_{}", m.version, m.name()), m.file);
        }
        assert!(!MIGRATIONS.iter().any(|m| m.version == 6));
    }

    #[test]
    fn an_unknown_or_changed_migration_is_refused_and_a_missing_checksum_recorded() {
        let first = &MIGRATIONS[0];
        let good = row(first.version, Some(first.checksum()));
        assert_eq!(
            verify(&[good.clone(), row(2, None)], MIGRATIONS).unwrap(),
            [2]
        );

        let newer = verify(&[good.clone(), row(9999, None)], MIGRATIONS).unwrap_err();
        let line = newer.to_string();
        assert!(
            line.contains("9999_x") && line.contains("newer postie"),
            "{line}"
        );
        assert!(!line.contains('\n'));

        let changed = verify(&[row(1, Some("abc".into()))], MIGRATIONS).unwrap_err();
        let line = changed.to_string();
        assert!(
            line.contains("0001_inbox changed after it was applied"),
            "{line}"
        );
        assert!(line.contains(&first.checksum()));
    }
}
