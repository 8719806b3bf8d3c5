//! Test databases, copied from a migrated template (issue 46): every test gets a
//! database of its own, and migrating ~20 files into each of them cost about a second
//! per test. The migrations run once per version of `sql/` into a template database,
//! `postie_template_<digest of sql/*.sql>`, and each test's database is a copy
//! (`CREATE DATABASE … TEMPLATE …`, a file copy on the server). A postie that starts
//! against the copy finds every migration applied, as after an upgrade.
//!
//! Tests run as separate processes at once (cargo-nextest), so the template is built
//! under a PostgreSQL advisory lock, into a database of another name that is renamed
//! when complete: a process never copies a half-migrated template. A test whose postie
//! must migrate an empty database itself asks for one (`TestEnv::unmigrated`).
//!
//! `Db` is a PostgreSQL-only environment, for tests that need no broker.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{admin_sql, pg_admin, pg_base};

/// The advisory lock held while the template is built (any number nobody else uses).
const TEMPLATE_LOCK: i64 = 0x0070_6f73_7469_6546;

/// A PostgreSQL-only test environment: a database of its own, dropped at the end
/// (also on panic). For tests that need no broker, no SMTP server and no topology.
pub struct Db {
    /// The database's name, unique to the test.
    pub name: String,
}

impl Db {
    /// A migrated database of its own for test `name`.
    pub async fn new(name: &str) -> Self {
        let name = unique_name(name);
        create_migrated(&name).await;
        Self { name }
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("{}/{}", pg_base(), self.name)
    }

    /// A superuser connection to it.
    pub async fn client(&self) -> tokio_postgres::Client {
        pg_admin(&self.name).await
    }

    /// Database settings for an `Inbox` on it (the test defaults).
    pub fn settings(&self) -> postie::config::DatabaseSettings {
        // The whole test configuration (it must be valid), of which the database part.
        super::base_settings(
            &super::amqp_url(),
            "t.db-only",
            &self.name,
            "smtp://127.0.0.1:25",
            &[],
        )
        .database
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let name = self.name.clone();
        super::on_own_thread(async move {
            admin_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
        });
    }
}

/// `postie_t_<name>_<random>`, a valid unquoted identifier.
fn unique_name(name: &str) -> String {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    format!("postie_t_{}_{id}", name.replace(['-', '.'], "_"))
}

/// Creates database `name` as a copy of the migrated template.
pub(super) async fn create_migrated(name: &str) {
    let template = template().await;
    // A copy fails while another session is connected to the template: only the
    // builder ever is, for a moment after it renamed it. Retry briefly.
    let deadline = Instant::now() + Duration::from_secs(60);
    let admin = pg_admin("postgres").await;
    loop {
        let sql = format!("CREATE DATABASE {name} TEMPLATE {template}");
        match admin.batch_execute(&sql).await {
            Ok(()) => return,
            Err(e) if Instant::now() < deadline && being_accessed(&e) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{sql}: {e}"),
        }
    }
}

fn being_accessed(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
}

/// The template's name, building it first if this version of `sql/` has none.
async fn template() -> String {
    static TEMPLATE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    TEMPLATE.get_or_init(build_template).await.clone()
}

/// A digest of the migrations: file names and contents of `sql/*.sql`.
fn migrations_digest() -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no migration in {}", dir.display());
    let mut digest = Sha256::new();
    for file in files {
        digest.update(file.file_name().unwrap().as_encoded_bytes());
        digest.update([0]);
        digest.update(std::fs::read(&file).expect("a migration file"));
        digest.update([0]);
    }
    hex::encode(&digest.finalize()[..6])
}

async fn build_template() -> String {
    let name = format!("postie_template_{}", migrations_digest());
    let admin = pg_admin("postgres").await;
    admin
        .execute("SELECT pg_advisory_lock($1)", &[&TEMPLATE_LOCK])
        .await
        .expect("the template's lock");
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .expect("pg_database")
        .is_some();
    if !exists {
        let partial = format!("{name}_partial");
        admin_sql(&format!("DROP DATABASE IF EXISTS {partial} WITH (FORCE)")).await;
        admin_sql(&format!("CREATE DATABASE {partial}")).await;
        {
            let db = Db {
                name: partial.clone(),
            };
            let inbox = postie::testing::inbox::Inbox::connect(&db.settings())
                .await
                .expect("connect to the template");
            inbox.migrate().await.expect("migrate the template");
            drop(inbox);
            std::mem::forget(db); // renamed below, not dropped
        }
        // The pool's connections close asynchronously: rename once they are gone.
        let sql = format!("ALTER DATABASE {partial} RENAME TO {name}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match admin.batch_execute(&sql).await {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline && being_accessed(&e) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("{sql}: {e}"),
            }
        }
        // Templates of older versions of sql/ are of no more use; one in use by a
        // run of another checkout refuses the drop, and stays.
        let stale = admin
            .query(
                "SELECT datname FROM pg_database
                  WHERE datname LIKE 'postie\\_template\\_%' AND datname <> $1",
                &[&name],
            )
            .await
            .expect("pg_database");
        for row in stale {
            let old: String = row.get(0);
            let _ = admin.batch_execute(&format!("DROP DATABASE {old}")).await;
        }
    }
    admin
        .execute("SELECT pg_advisory_unlock($1)", &[&TEMPLATE_LOCK])
        .await
        .expect("the template's lock");
    name
}
