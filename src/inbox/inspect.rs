//! What the operator console (`console`) reads from the inbox beyond the CLI's
//! queries: one job's row, its kept body and its delivery events, the sends of the
//! last hour per minute, and the maintenance leader (the holder of
//! `MAINTENANCE_LOCK`, read from `pg_locks`).

use super::{DbError, Inbox};
use crate::config::TopologySettings;

/// `pg_try_advisory_lock` key of maintenance ("postie" + 1; migrations use "postie"):
/// taken by `consume::maintenance`, looked up by [`Inbox::maintenance_leader`].
pub(crate) const MAINTENANCE_LOCK: i64 = 0x706f_7374_6965 + 1;

/// A timestamp column as text, in UTC to the millisecond.
macro_rules! ts {
    ($col:literal) => {
        concat!(
            "to_char(",
            $col,
            " AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS')"
        )
    };
}

/// One job's row as the console shows it: its status, then every other column that
/// tells its story, by name, as text (`None`: NULL). The body is left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobRow {
    /// `status`.
    pub(crate) status: String,
    /// The other columns, in the order of [`JOB_COLUMNS`].
    pub(crate) fields: Vec<(&'static str, Option<String>)>,
    /// `due_at`, Unix ms.
    pub(crate) due_ms: Option<i64>,
    /// What its local due time and window are read from.
    pub(crate) terms: JobTerms,
}

/// What a job's terms (zone, window) are read from: its lane, and the kept body's
/// `time_zone` and `window` member (JSON text). A scheduled job's row and the
/// pending list both carry one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobTerms {
    /// `lane` (`None`: the default).
    pub lane: Option<String>,
    /// The kept body's `time_zone`.
    pub time_zone: Option<String>,
    /// The kept body's `window` member, as JSON text (`None`: absent, or no body
    /// kept).
    pub window: Option<String>,
}

impl JobTerms {
    /// For a person: the job's due time `due_ms` in its zone, and its window
    /// (`contract::describe_pending`); empty when it has neither.
    pub(crate) fn describe(&self, topology: &TopologySettings, due_ms: i64) -> String {
        crate::contract::describe_pending(
            topology,
            self.lane.as_deref(),
            (self.time_zone.as_deref(), self.window.as_deref()),
            due_ms,
        )
    }

    /// The terms in the row `r`'s columns from `first` on: lane, time zone, window.
    pub(super) fn read(r: &tokio_postgres::Row, first: usize) -> Self {
        Self {
            lane: r.get(first),
            time_zone: r.get(first + 1),
            window: r.get(first + 2),
        }
    }
}

/// The columns of [`JobRow::fields`].
const JOB_COLUMNS: [&str; 19] = [
    "type",
    "attempts",
    "owner",
    "lease_until",
    "fence",
    "revision",
    "takeovers",
    "duplicates",
    "due_at",
    "created_at",
    "updated_at",
    "sent_at",
    "cancelled_at",
    "last_error",
    "message_id",
    "provider",
    "provider_message_id",
    "feedback",
    "cancelled_through",
];

/// One row of `postie_events` (not yet published and deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventRow {
    /// `sent`, `dead`, `cancelled`, …
    pub(crate) outcome: String,
    /// When it happened (UTC).
    pub(crate) occurred_at: String,
    /// Attempts made by then.
    pub(crate) attempts: i32,
    /// Why (dead, suppressed, …), if said.
    pub(crate) reason: Option<String>,
}

/// The PostgreSQL session that holds the maintenance lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Leader {
    /// Its backend's process id.
    pub(crate) pid: i32,
    /// The client's address (`local` for a Unix socket).
    pub(crate) client: String,
    /// Since when it is connected (UTC).
    pub(crate) since: String,
}

impl Inbox {
    /// The row of `key`, if there is one.
    pub(crate) async fn job_row(&self, key: &str) -> Result<Option<JobRow>, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                concat!(
                    "SELECT status, type, attempts::text, owner, ",
                    ts!("lease_until"),
                    ", fence::text, revision::text, takeovers::text, duplicates::text, ",
                    ts!("due_at"),
                    ", ",
                    ts!("created_at"),
                    ", ",
                    ts!("updated_at"),
                    ", ",
                    ts!("sent_at"),
                    ", ",
                    ts!("cancelled_at"),
                    ", last_error, message_id, provider, provider_message_id, feedback,
                       cancelled_through::text,
                       (extract(epoch FROM due_at) * 1000)::bigint, lane,
                       j ->> 'time_zone', (j -> 'window')::text
                  FROM postie_inbox
                  LEFT JOIN LATERAL (SELECT convert_from(body, 'UTF8')::jsonb AS j) kept ON true
                 WHERE key = $1"
                ),
                &[&key],
            )
            .await?;
        Ok(row.map(|r| JobRow {
            status: r.get(0),
            fields: JOB_COLUMNS
                .iter()
                .enumerate()
                .map(|(i, name)| (*name, r.get::<_, Option<String>>(i + 1)))
                .collect(),
            due_ms: r.get(JOB_COLUMNS.len() + 1),
            terms: JobTerms::read(&r, JOB_COLUMNS.len() + 2),
        }))
    }

    /// The revision and kept body of `key` while it is scheduled (ladder mode, with
    /// `delay.reconcile` keeping bodies).
    pub(crate) async fn kept_job(&self, key: &str) -> Result<Option<(i32, Vec<u8>)>, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT revision, body FROM postie_inbox
                  WHERE key = $1 AND status = 'scheduled' AND body IS NOT NULL",
                &[&key],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// The delivery events of `key` still in the outbox, oldest first.
    pub(crate) async fn job_events(&self, key: &str) -> Result<Vec<EventRow>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                concat!(
                    "SELECT outcome, ",
                    ts!("occurred_at"),
                    ", attempts, reason FROM postie_events WHERE key = $1 ORDER BY id LIMIT 100"
                ),
                &[&key],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| EventRow {
                outcome: r.get(0),
                occurred_at: r.get(1),
                attempts: r.get(2),
                reason: r.get(3),
            })
            .collect())
    }

    /// Who holds the maintenance lock in this database, if anyone.
    pub(crate) async fn maintenance_leader(&self) -> Result<Option<Leader>, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                concat!(
                    "SELECT a.pid, coalesce(host(a.client_addr), 'local'), ",
                    ts!("a.backend_start"),
                    " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND ((l.classid::bigint << 32) | l.objid::bigint) = $1
                  LIMIT 1"
                ),
                &[&MAINTENANCE_LOCK],
            )
            .await?;
        Ok(row.map(|r| Leader {
            pid: r.get(0),
            client: r.get(1),
            since: r.get(2),
        }))
    }
}
