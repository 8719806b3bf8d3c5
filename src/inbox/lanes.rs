//! Lanes in the inbox (issue 33): each lane's sends and lateness for `postie status`
//! (from the lane the relay records, `sql/0019_lanes.sql`); the busiest tenants'
//! slots (`sql/0020_tenants.sql`: a GCRA row per lane and tenant with a cap, taken by
//! `machine/defer.rs`, which defers a job over its tenant's cap to its slot), and
//! their spent rows pruned.

use super::prune::PrunePlan;
use super::rate::{TENANT_PREFIX, TENANT_ROWS};
use super::{DbError, Inbox};

/// A tenant's slots taken ahead of now: its deferred backlog, in time.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TenantBacklog {
    /// The lane.
    pub lane: String,
    /// The tenant.
    pub tenant: String,
    /// How far ahead its next free slot is, in seconds.
    pub ahead_seconds: f64,
}

impl Inbox {
    /// The `limit` tenants whose slots run furthest ahead (for `postie status`).
    pub(crate) async fn busiest_tenants(&self, limit: i64) -> Result<Vec<TenantBacklog>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT split_part(r.rest, ':', 1) AS lane,
                        regexp_replace(r.rest, '^[^:]*:', ''),
                        extract(epoch FROM tat - clock_timestamp())::float8
                   FROM postie_rate_limit,
                        LATERAL (SELECT substr(name, length($3) + 1) AS rest) r
                  WHERE name LIKE $2 AND tat > clock_timestamp()
                  ORDER BY tat DESC LIMIT $1",
                &[&limit, &TENANT_ROWS, &TENANT_PREFIX],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| TenantBacklog {
                lane: row.get(0),
                tenant: row.get(1),
                ahead_seconds: row.get(2),
            })
            .collect())
    }

    /// Deletes tenants' slots that passed over an hour ago (a batch at a time), from
    /// the rate engine's rows and from the table the previous version wrote
    /// (`postie_tenant_slots`, sql/0023); how many.
    pub(super) async fn prune_tenant_slots(
        &self,
        plan: &PrunePlan,
        statements: &mut u64,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let spent = "tat < now() - interval '1 hour'";
        let tables = [
            (
                "postie_rate_limit",
                "name",
                format!("name LIKE '{TENANT_ROWS}' AND"),
            ),
            ("postie_tenant_slots", "lane, tenant", String::new()),
        ];
        let mut total = 0;
        for (table, key, only) in tables {
            if plan.dry_run {
                let sql = format!("SELECT count(*) FROM {table} WHERE {only} {spent}");
                *statements += 1;
                total += client.query_one(&sql, &[]).await?.get::<_, i64>(0) as u64;
                continue;
            }
            let sql = format!(
                "DELETE FROM {table} WHERE ({key}) IN
                   (SELECT {key} FROM {table} WHERE {only} {spent} LIMIT $1)"
            );
            loop {
                let n = client.execute(&sql, &[&plan.batch]).await?;
                *statements += 1;
                total += n;
                if (n as i64) < plan.batch {
                    break;
                }
            }
        }
        Ok(total)
    }
}
