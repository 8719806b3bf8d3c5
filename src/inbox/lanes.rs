//! Lanes in the inbox (issue 33): each lane's sends and lateness for `postie status`
//! (from the lane the relay records, `sql/0019_lanes.sql`); the busiest tenants'
//! slots (`sql/0020_tenants.sql`: a GCRA row per lane and tenant with a cap, taken by
//! `machine/defer.rs`, which defers a job over its tenant's cap to its slot), and
//! their spent rows pruned.

use super::prune::PrunePlan;
use super::{DbError, Inbox};

/// A tenant's slots taken ahead of now: its deferred backlog, in time.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantBacklog {
    /// The lane.
    pub lane: String,
    /// The tenant.
    pub tenant: String,
    /// How far ahead its next free slot is, in seconds.
    pub ahead_seconds: f64,
}

/// One lane's sends over the last minute (rows the relay recorded: ladder mode).
#[derive(Debug, Clone, PartialEq)]
pub struct LaneSends {
    /// The lane (`None`: the default lane).
    pub lane: Option<String>,
    /// Emails sent in the last minute.
    pub sent: i64,
    /// Their lateness (sent minus due), median and 99th percentile, in seconds.
    pub lateness_p50: f64,
    /// See `lateness_p50`.
    pub lateness_p99: f64,
}

impl Inbox {
    /// Each lane's sends over the last minute, busiest first.
    pub async fn lane_sends(&self) -> Result<Vec<LaneSends>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT lane, count(*),
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at - due_at)),
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at - due_at))
                   FROM postie_inbox
                  WHERE status = 'sent' AND updated_at > now() - interval '60 seconds'
                    AND sent_at > now() - interval '60 seconds' AND due_at IS NOT NULL
                  GROUP BY lane ORDER BY count(*) DESC",
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| LaneSends {
                lane: row.get(0),
                sent: row.get(1),
                lateness_p50: row.get(2),
                lateness_p99: row.get(3),
            })
            .collect())
    }

    /// The `limit` tenants whose slots run furthest ahead (for `postie status`).
    pub async fn busiest_tenants(&self, limit: i64) -> Result<Vec<TenantBacklog>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT lane, tenant, extract(epoch FROM tat - clock_timestamp())::float8
                   FROM postie_tenant_slots WHERE tat > clock_timestamp()
                  ORDER BY tat DESC LIMIT $1",
                &[&limit],
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

    /// Deletes slots that passed over an hour ago (a batch at a time); how many.
    pub(super) async fn prune_tenant_slots(
        &self,
        plan: &PrunePlan,
        statements: &mut u64,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let spent = "tat < now() - interval '1 hour'";
        if plan.dry_run {
            let sql = format!("SELECT count(*) FROM postie_tenant_slots WHERE {spent}");
            *statements += 1;
            return Ok(client.query_one(&sql, &[]).await?.get::<_, i64>(0) as u64);
        }
        let sql = format!(
            "DELETE FROM postie_tenant_slots WHERE (lane, tenant) IN
               (SELECT lane, tenant FROM postie_tenant_slots WHERE {spent} LIMIT $1)"
        );
        let mut total = 0;
        loop {
            let n = client.execute(&sql, &[&plan.batch]).await?;
            *statements += 1;
            total += n;
            if (n as i64) < plan.batch {
                return Ok(total);
            }
        }
    }
}
