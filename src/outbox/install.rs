//! `postie outbox install`: the outbox in a producer's database, versioned in
//! `postie.outbox_version` (apart from postie's own migrations), each script once,
//! under an advisory lock and in one transaction, so that installs run side by side
//! (several deploys at once) apply each script once and a failed one leaves nothing.
//! A database installed by a newer postie is refused. The grants are given on every
//! run (GRANT is idempotent), so a second run can add a role.

use tokio_postgres::Client;

/// The outbox's scripts, in order: (version, name, SQL).
const SCRIPTS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_outbox",
        include_str!("../../sql/outbox/0001_outbox.sql"),
    ),
    (
        2,
        "0002_take",
        include_str!("../../sql/outbox/0002_take.sql"),
    ),
];

/// The advisory lock every install takes (any fixed number; "postie outbox" in hex).
const LOCK: i64 = 0x706f_7374_6965_6f62;

/// The roles to grant to; `None`: none.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Grants<'a> {
    /// The application's role: may only call `postie.enqueue` (a SECURITY DEFINER
    /// function with its `search_path` pinned); it cannot read the table.
    pub(crate) app: Option<&'a str>,
    /// postie's role for the relay: may only take a batch (`postie.take`, which locks
    /// its rows), read and delete the table's rows.
    pub(crate) relay: Option<&'a str>,
}

/// Applies the scripts not yet applied and gives the grants; the names of the
/// scripts it applied (empty: the outbox was up to date).
pub(crate) async fn install(
    client: &mut Client,
    grants: Grants<'_>,
) -> anyhow::Result<Vec<&'static str>> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
        .await?;
    tx.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS postie;
         CREATE TABLE IF NOT EXISTS postie.outbox_version (
             version    integer PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
    )
    .await?;
    let installed: i32 = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM postie.outbox_version",
            &[],
        )
        .await?
        .get(0);
    let known = SCRIPTS.last().map_or(0, |s| s.0);
    if installed > known {
        anyhow::bail!(
            "the outbox in this database is at version {installed}, installed by a newer \
             postie (this one knows up to {known}): upgrade postie"
        );
    }
    let mut applied = Vec::new();
    for (version, name, sql) in SCRIPTS.iter().filter(|s| s.0 > installed) {
        tx.batch_execute(sql)
            .await
            .map_err(|e| anyhow::Error::from(e).context(format!("outbox script {name}")))?;
        tx.execute(
            "INSERT INTO postie.outbox_version (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await?;
        applied.push(*name);
    }
    tx.batch_execute(&grant_statements(grants)).await?;
    tx.commit().await?;
    Ok(applied)
}

/// The GRANT statements for `grants` (each role name quoted as an identifier).
fn grant_statements(grants: Grants<'_>) -> String {
    let mut sql = String::new();
    if let Some(role) = grants.app.map(ident) {
        sql.push_str(&format!(
            "GRANT USAGE ON SCHEMA postie TO {role};
             GRANT EXECUTE ON FUNCTION postie.enqueue(jsonb, interval),
                                       postie.enqueue(jsonb, timestamptz) TO {role};\n"
        ));
    }
    if let Some(role) = grants.relay.map(ident) {
        sql.push_str(&format!(
            "GRANT USAGE ON SCHEMA postie TO {role};
             GRANT SELECT, DELETE ON postie.outbox TO {role};
             GRANT EXECUTE ON FUNCTION postie.take(integer) TO {role};
             GRANT SELECT ON postie.outbox_version TO {role};\n"
        ));
    }
    sql
}

/// `name` as a quoted SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_are_quoted_as_identifiers() {
        assert_eq!(ident("app"), "\"app\"");
        assert_eq!(ident("a\"; DROP"), "\"a\"\"; DROP\"");
        let sql = grant_statements(Grants {
            app: Some("shop app"),
            relay: None,
        });
        assert!(sql.contains("TO \"shop app\""), "{sql}");
        assert!(!sql.contains("DELETE"), "{sql}");
        assert!(grant_statements(Grants::default()).is_empty());
    }
}
