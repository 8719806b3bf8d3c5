//! What the outbox's test files share: a producer's database with the outbox
//! installed by the CLI (dropped with the test), roles of the cluster for one test,
//! and the test world's settings with outbox sources.
#![allow(dead_code, unreachable_pub)]

use postie::config::Settings;

use crate::support::*;

/// A producer's database for one test: created, the outbox installed by the CLI,
/// dropped (with every connection to it) when the test ends.
pub struct ProducerDb {
    pub name: String,
}

impl ProducerDb {
    pub async fn new(env: &TestEnv) -> Self {
        let db = Self::empty(env).await;
        install(env, &db.url()).await;
        db
    }

    /// The database without the outbox.
    pub async fn empty(env: &TestEnv) -> Self {
        let name = format!("{}_producer", env.db_name);
        admin_sql_in("postgres", &format!("CREATE DATABASE {name}")).await;
        Self { name }
    }

    pub fn url(&self) -> String {
        format!("{}/{}", pg_base(), self.name)
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        pg_admin(&self.name).await
    }

    /// Rows waiting in the outbox.
    pub async fn waiting(&self) -> i64 {
        count(&self.client().await, "postie.outbox").await
    }
}

/// The rows of `table`.
pub async fn count(client: &tokio_postgres::Client, table: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {table}");
    client.query_one(&sql, &[]).await.unwrap().get(0)
}

/// Roles of the cluster for one test, dropped (their grants in the producer's
/// database first) when the test ends, also on a failure.
pub struct Roles {
    pub names: Vec<String>,
    db: String,
}

impl Roles {
    pub async fn create(producer: &ProducerDb, names: &[&str]) -> Self {
        for name in names {
            admin_sql_in("postgres", &format!("CREATE ROLE {name} LOGIN")).await;
        }
        Self {
            names: names.iter().map(|n| n.to_string()).collect(),
            db: producer.name.clone(),
        }
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (names, db) = (self.names.join(", "), self.db.clone());
        on_own_thread(async move {
            admin_sql_in(&db, &format!("DROP OWNED BY {names} CASCADE")).await;
            admin_sql_in("postgres", &format!("DROP ROLE {names}")).await;
        });
    }
}

/// `postie outbox install` into `url`, and the producer's business table `orders`.
pub async fn install(env: &TestEnv, url: &str) {
    let out = env
        .postie(&["outbox", "install", "--database", url])
        .expect("postie outbox install");
    assert!(out.contains("applied 0001_outbox"), "{out}");
    assert!(out.contains("applied 0002_take"), "{out}");
    let client = connect_pg(url).await;
    client
        .batch_execute("CREATE TABLE orders (id serial PRIMARY KEY, note text)")
        .await
        .unwrap();
}

impl Drop for ProducerDb {
    fn drop(&mut self) {
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        on_own_thread(async move { admin_sql_in("postgres", &drop).await });
    }
}

/// The test world's settings with `sources` relayed, plus `extra` variables.
pub fn settings_with(env: &TestEnv, sources: &str, extra: &[(&str, &str)]) -> Settings {
    let mut vars: std::collections::HashMap<String, String> = env.env_vars().into_iter().collect();
    vars.insert("POSTIE__OUTBOX__SOURCES".into(), sources.into());
    vars.insert("POSTIE__OUTBOX__POLL_INTERVAL".into(), "200ms".into());
    for (k, v) in extra {
        vars.insert(k.to_string(), v.to_string());
    }
    Settings::load_from(None, Some(vars)).expect("test settings are valid")
}
