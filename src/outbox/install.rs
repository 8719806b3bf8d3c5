//! `postie outbox install`: the outbox in a producer's database, versioned in
//! `postie.outbox_version` (apart from postie's own migrations), each script once,
//! under an advisory lock and in one transaction, so that installs run side by side
//! (several deploys at once) apply each script once and a failed one leaves nothing.
//! A database installed by a newer postie is refused.
//!
//! The grants are given on every run (GRANT is idempotent; `--app-role`,
//! `--relay-role`), so a second run can add a role, and the job size limit
//! (`postie.outbox_settings`, from `worker.max_body_bytes` or `--max-body-bytes`) is
//! written on every run.
//!
//! The scripts, embedded from `sql/outbox/` (versioned apart from `sql/`'s
//! migrations): `0001_outbox.sql` (`postie.outbox`, `postie.enqueue` with its
//! refusals, clock stamp and NOTIFY), `0002_take.sql` (`postie.take`, the relay's
//! batch), `0003_refusals.sql` (enqueue's size limit and finite due time,
//! `postie.outbox_settings`; `take` answering NULL for a time it cannot compute;
//! `postie.outbox_rejected` and `postie.reject`).
//!
//! What it installs into must be its own: a `postie` schema, or an `outbox_version`,
//! that another role owns (or that is not a plain table, or has a trigger) is refused
//! before anything runs in it, since whoever owns them could have left code there
//! that would run as the installer. Its statements run with `search_path` pinned to
//! `pg_catalog, pg_temp`, so no other schema's function is called by mistake.

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
    (
        3,
        "0003_refusals",
        include_str!("../../sql/outbox/0003_refusals.sql"),
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

/// Applies the scripts not yet applied, writes `max_body_bytes` (enqueue's limit) and
/// gives the grants; the names of the scripts it applied (empty: the outbox was up
/// to date).
pub(crate) async fn install(
    client: &mut Client,
    grants: Grants<'_>,
    max_body_bytes: usize,
) -> anyhow::Result<Vec<&'static str>> {
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL search_path = pg_catalog, pg_temp")
        .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
        .await?;
    check_owned(&tx).await?;
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
    let max_body_bytes = i32::try_from(max_body_bytes).unwrap_or(i32::MAX);
    tx.execute(
        "INSERT INTO postie.outbox_settings (only_row, max_body_bytes) VALUES (true, $1)
         ON CONFLICT (only_row) DO UPDATE SET max_body_bytes = excluded.max_body_bytes",
        &[&max_body_bytes],
    )
    .await?;
    tx.batch_execute(&grant_statements(grants)).await?;
    tx.commit().await?;
    Ok(applied)
}

/// Refuses a `postie` schema, or a `postie.outbox_version`, that the installing role
/// does not own, and an `outbox_version` that is not a plain table without triggers:
/// whoever made them could run code as the installer (a trigger on the version
/// table, a view over a table of theirs). Strict ownership, not membership: a
/// superuser is a member of every role.
async fn check_owned(tx: &tokio_postgres::Transaction<'_>) -> anyhow::Result<()> {
    let schema = tx
        .query_opt(
            "SELECT pg_get_userbyid(n.nspowner), n.nspowner = r.oid, r.rolname::text
               FROM pg_namespace n, pg_roles r
              WHERE n.nspname = 'postie' AND r.rolname = current_user",
            &[],
        )
        .await?;
    let Some(schema) = schema else {
        return Ok(());
    };
    let (owner, ours, me): (String, bool, String) = (schema.get(0), schema.get(1), schema.get(2));
    if !ours {
        anyhow::bail!(
            "the schema postie in this database belongs to role {owner:?}, not to {me:?}, \
             which installs: refusing to install into it (its owner could run code as the \
             installer); drop it, or ALTER SCHEMA postie OWNER TO {me:?} once it is checked"
        );
    }
    let table = tx
        .query_opt(
            "SELECT c.relkind::text, pg_get_userbyid(c.relowner), c.relowner = r.oid,
                    EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal)
               FROM pg_class c, pg_roles r
              WHERE c.relnamespace = 'postie'::regnamespace AND c.relname = 'outbox_version'
                AND r.rolname = current_user",
            &[],
        )
        .await?;
    let Some(table) = table else {
        return Ok(());
    };
    let (kind, owner, ours, triggers): (String, String, bool, bool) =
        (table.get(0), table.get(1), table.get(2), table.get(3));
    let wrong = if kind != "r" {
        Some(format!("is not a plain table (relkind {kind:?})"))
    } else if !ours {
        Some(format!(
            "belongs to role {owner:?}, not to {me:?}, which installs"
        ))
    } else if triggers {
        Some("has triggers".to_string())
    } else {
        None
    };
    match wrong {
        Some(wrong) => anyhow::bail!(
            "postie.outbox_version in this database {wrong}: refusing to install (whoever \
             made it could run code as the installer); check it and drop it"
        ),
        None => Ok(()),
    }
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
             GRANT SELECT ON postie.outbox_version, postie.outbox_rejected TO {role};
             GRANT EXECUTE ON FUNCTION postie.reject(bigint, text) TO {role};\n"
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
