//! The schema and its migrations: `sql/schema.sql` says what the migrations in `sql/`
//! add up to (a migrated database and one loaded from schema.sql have the same
//! catalog); a database migrated by a newer postie, or with a migration changed
//! since it was applied, is refused at start-up; migrating twice changes nothing;
//! an answer of `postie_claim` this postie does not know is an outage, not a busy key.

mod support;

use std::time::Duration;

use postie::testing::inbox::Inbox;
use support::{admin_sql_in, pg_admin, TestEnv};
use tokio_util::sync::CancellationToken;

/// Everything of the public schema that the migrations make, one line per item:
/// relations, columns (in order), constraints, indexes and function definitions.
async fn catalog(client: &tokio_postgres::Client) -> Vec<String> {
    const QUERIES: [&str; 5] = [
        "SELECT 'relation ' || relname || ' ' || relkind::text FROM pg_class
          WHERE relnamespace = 'public'::regnamespace ORDER BY relname",
        "SELECT 'column ' || c.relname || '.' || a.attname || ' ' ||
                format_type(a.atttypid, a.atttypmod) ||
                CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END ||
                coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '')
           FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
           LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
          WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
            AND a.attnum > 0 AND NOT a.attisdropped
          ORDER BY c.relname, a.attnum",
        "SELECT 'constraint ' || conrelid::regclass::text || ' ' || conname || ' ' ||
                pg_get_constraintdef(oid)
           FROM pg_constraint WHERE connamespace = 'public'::regnamespace
          ORDER BY conrelid::regclass::text, conname",
        "SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
          ORDER BY indexname",
        "SELECT 'function ' || pg_get_functiondef(oid) FROM pg_proc
          WHERE pronamespace = 'public'::regnamespace ORDER BY oid::regprocedure::text",
    ];
    let mut lines = Vec::new();
    for query in QUERIES {
        for row in client.query(query, &[]).await.unwrap() {
            lines.push(row.get(0));
        }
    }
    lines
}

/// A second database of the test's own, dropped with it.
struct ScratchDb(String);

impl ScratchDb {
    async fn new(name: String) -> Self {
        admin_sql_in("postgres", &format!("CREATE DATABASE {name}")).await;
        Self(name)
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(admin_sql_in(
                    "postgres",
                    &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                ))
        })
        .join();
    }
}

async fn migrated(env: &TestEnv) -> Inbox {
    let database = env.settings().database;
    let inbox = Inbox::new(&database.plan().unwrap(), &database).unwrap();
    inbox.migrate().await.unwrap();
    inbox
}

#[tokio::test]
async fn sm_schema_sql_is_what_the_migrations_make() {
    let env = TestEnv::new("sm_schema").await;
    migrated(&env).await;
    let loaded = ScratchDb::new(format!("{}_sql", env.db_name)).await;
    admin_sql_in(&loaded.0, include_str!("../sql/schema.sql")).await;

    let from_migrations = catalog(&env.db().await).await;
    let from_schema_sql = catalog(&pg_admin(&loaded.0).await).await;
    let only = |a: &[String], b: &[String]| -> Vec<String> {
        a.iter().filter(|line| !b.contains(line)).cloned().collect()
    };
    assert_eq!(
        (
            only(&from_migrations, &from_schema_sql),
            only(&from_schema_sql, &from_migrations)
        ),
        (vec![], vec![]),
        "(made by the migrations only, said by sql/schema.sql only): update sql/schema.sql"
    );
    assert_eq!(
        from_migrations, from_schema_sql,
        "the same, in the same order"
    );
    assert!(from_migrations.len() > 30, "{from_migrations:#?}");
}

#[tokio::test]
async fn sm_migrating_twice_changes_nothing_and_old_rows_get_checksums() {
    let env = TestEnv::new("sm_twice").await;
    let inbox = migrated(&env).await;
    let db = env.db().await;
    let before = catalog(&db).await;
    assert_eq!(inbox.migrate().await.unwrap(), Vec::<String>::new());
    assert_eq!(catalog(&db).await, before);

    let recorded = |rows: Vec<tokio_postgres::Row>| -> Vec<(i32, Option<String>)> {
        rows.iter().map(|r| (r.get(0), r.get(1))).collect()
    };
    let query = "SELECT version, checksum FROM postie_migrations ORDER BY version";
    let first = recorded(db.query(query, &[]).await.unwrap());
    assert!(first
        .iter()
        .all(|(_, sum)| sum.as_ref().is_some_and(|s| s.len() == 64)));
    let inbox_sql = include_str!("../sql/0001_inbox.sql");
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(inbox_sql.as_bytes()))
    };
    assert_eq!(first[0], (1, Some(sha)));

    // A database an older postie migrated has no checksums: recorded, nothing applied.
    db.batch_execute("UPDATE postie_migrations SET checksum = NULL")
        .await
        .unwrap();
    assert_eq!(inbox.migrate().await.unwrap(), Vec::<String>::new());
    assert_eq!(recorded(db.query(query, &[]).await.unwrap()), first);
    assert_eq!(catalog(&db).await, before);
}

/// `postie serve` against the database, not migrating on start: its error.
async fn serve_refusal(env: &TestEnv) -> String {
    let mut settings = env.settings();
    settings.database.migrate_on_start = false;
    let served = tokio::time::timeout(
        Duration::from_secs(60),
        postie::testing::consume::serve(settings, CancellationToken::new()),
    )
    .await
    .expect("serve refuses at once");
    format!("{:#}", served.expect_err("serve must refuse this database"))
}

#[tokio::test]
async fn sm_a_database_migrated_by_a_newer_postie_is_refused() {
    let env = TestEnv::new("sm_newer").await;
    let inbox = migrated(&env).await;
    env.db()
        .await
        .batch_execute(
            "INSERT INTO postie_migrations (version, name, checksum)
             VALUES (9999, 'from_the_future', 'f00d')",
        )
        .await
        .unwrap();

    let line = inbox.migrate().await.unwrap_err().to_string();
    assert!(
        line.contains("migration 9999_from_the_future")
            && line.contains("newer postie")
            && !line.contains('\n'),
        "{line}"
    );
    assert_eq!(inbox.check_schema().await.unwrap_err().to_string(), line);
    let refused = serve_refusal(&env).await;
    assert!(refused.contains(&line), "{refused}");
}

#[tokio::test]
async fn sm_a_migration_changed_after_it_was_applied_is_refused_by_name() {
    let env = TestEnv::new("sm_tampered").await;
    let inbox = migrated(&env).await;
    env.db()
        .await
        .batch_execute("UPDATE postie_migrations SET checksum = 'tampered' WHERE version = 2")
        .await
        .unwrap();

    let line = inbox.migrate().await.unwrap_err().to_string();
    assert!(
        line.contains("migration 0002_cancel_throttle_pending changed after it was applied")
            && line.contains("tampered"),
        "{line}"
    );
    assert_eq!(inbox.check_schema().await.unwrap_err().to_string(), line);
    let refused = serve_refusal(&env).await;
    assert!(refused.contains(&line), "{refused}");
}

#[tokio::test]
async fn sm_an_unknown_claim_answer_is_an_outage_not_a_busy_key() {
    let env = TestEnv::new("sm_answer").await;
    let inbox = migrated(&env).await;
    // What a newer schema might answer.
    env.db()
        .await
        .batch_execute(
            "CREATE OR REPLACE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
             RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
             LANGUAGE sql AS $$ SELECT 'queued'::text, 1::bigint, 0, 'new'::text, 0::bigint $$",
        )
        .await
        .unwrap();
    let error = inbox
        .claim("k", "test", Duration::from_secs(5), 0)
        .await
        .expect_err("an unknown answer is an error");
    assert!(error.is_outage(), "held, never dead-lettered: {error}");
    assert!(error.to_string().contains("\"queued\""), "{error}");
    assert!(error.cause().contains("newer postie"), "{}", error.cause());
}

#[tokio::test]
async fn sm_status_on_a_database_not_migrated_says_to_run_migrate() {
    let env = TestEnv::unmigrated("sm_unmigrated").await;
    // Never migrated: one line that says what to do, not PostgreSQL's 42P01.
    let refused = env
        .postie(&["status"])
        .expect_err("status on an empty database");
    assert!(
        refused.contains("not migrated") && refused.contains("run `postie migrate`"),
        "{refused}"
    );
    assert!(!refused.contains("42P01"), "{refused}");
    env.postie(&["migrate"]).expect("postie migrate");
    // The newest migration undone in the record only: one not applied, by name.
    env.db()
        .await
        .batch_execute(
            "DELETE FROM postie_migrations
              WHERE version = (SELECT max(version) FROM postie_migrations)",
        )
        .await
        .unwrap();
    let refused = env
        .postie(&["status"])
        .expect_err("status one migration behind");
    assert!(
        refused.contains("1 of postie's migrations not applied") && refused.contains("migrate"),
        "{refused}"
    );
    env.postie(&["migrate"]).expect("postie migrate again");
    env.postie(&["topology"]).expect("postie topology");
    let status = env
        .postie(&["status"])
        .expect("status on a migrated database");
    assert!(status.contains("inbox:"), "{status}");
    // The empty ladder queues in one line; each of them with --all.
    let ladder = env.topology.ladder_queues();
    assert!(!ladder.is_empty(), "ladder mode");
    let (levels, level0) = (ladder.len(), format!("{} ", ladder[0]));
    assert!(
        status.contains(&format!("and {levels} of the {levels} ladder queues empty")),
        "{status}"
    );
    assert!(!status.contains(&level0), "{status}");
    let all = env.postie(&["status", "--all"]).expect("status --all");
    assert!(
        all.contains(&level0) && !all.contains("ladder queues empty"),
        "{all}"
    );
}
