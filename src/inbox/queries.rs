//! What `postie status` and `postie pending` read.
//! `pending_page` is the console's page of pending jobs, filtered by type and key
//! prefix.

use super::inspect::JobTerms;
use super::machine::status_of;
use super::{DbError, Inbox, Status};

/// One scheduled job (ladder mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    /// The key.
    pub key: String,
    /// Its revision.
    pub revision: i32,
    /// Due time, Unix ms.
    pub due_ms: i64,
    /// The job's type, if it has one.
    pub kind: Option<String>,
    /// What its local due time and window are read from.
    pub terms: JobTerms,
}

/// Which scheduled jobs [`Inbox::pending_page`] reads; the default reads them all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PendingFilter {
    /// Only jobs due before this time (Unix ms).
    pub due_before_ms: Option<i64>,
    /// Only this key.
    pub key: Option<String>,
    /// Only jobs of this type.
    pub kind: Option<String>,
    /// Only keys that start with this text.
    pub key_prefix: Option<String>,
}

/// Counts for `postie status`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct InboxCounts {
    /// Rows by status, sorted by status.
    pub(crate) by_status: Vec<(Status, i64)>,
    /// Suppressed duplicate deliveries, summed.
    pub(crate) duplicates: i64,
    /// Expired leases taken over, summed.
    pub(crate) takeovers: i64,
}

impl Inbox {
    /// Scheduled jobs (ladder mode), soonest first.
    pub async fn pending(
        &self,
        due_before_ms: Option<i64>,
        key: Option<&str>,
        limit: i64,
    ) -> Result<(Vec<PendingJob>, i64), DbError> {
        let filter = PendingFilter {
            due_before_ms,
            key: key.map(str::to_owned),
            ..PendingFilter::default()
        };
        self.pending_page(&filter, 0, limit).await
    }

    /// One page of the scheduled jobs that match `filter`, soonest first, from the
    /// `offset`-th on; and how many match in all.
    pub(crate) async fn pending_page(
        &self,
        filter: &PendingFilter,
        offset: i64,
        limit: i64,
    ) -> Result<(Vec<PendingJob>, i64), DbError> {
        let mut client = self.pool.get().await?;
        // The list and its count read one snapshot: as two statements on their own,
        // a relay's commit between them listed none of six jobs it counted.
        let snapshot = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        // A scheduled row has no type yet (it is recorded with the outcome): it is read
        // from the kept body, which the relay parsed as JSON before recording it.
        let condition = "status = 'scheduled'
                      AND ($1::bigint IS NULL OR due_at < to_timestamp($1::bigint / 1000.0))
                      AND ($2::text IS NULL OR key = $2)
                      AND ($3::text IS NULL OR coalesce(type, convert_from(body, 'UTF8')::jsonb ->> 'type') = $3)
                      AND ($4::text IS NULL OR starts_with(key, $4))";
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
            &filter.due_before_ms,
            &filter.key,
            &filter.kind,
            &filter.key_prefix,
        ];
        let page: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&limit, &offset];
        let rows = snapshot
            .query(
                &format!(
                    "SELECT key, revision, (extract(epoch FROM due_at) * 1000)::bigint,
                            coalesce(type, j ->> 'type'), lane, j ->> 'time_zone',
                            (j -> 'window')::text
                       FROM postie_inbox
                       LEFT JOIN LATERAL (SELECT convert_from(body, 'UTF8')::jsonb AS j) kept ON true
                      WHERE {condition}
                      ORDER BY due_at, key LIMIT $5 OFFSET $6"
                ),
                &[&params[..], &page[..]].concat(),
            )
            .await?;
        let total: i64 = snapshot
            .query_one(
                &format!("SELECT count(*) FROM postie_inbox WHERE {condition}"),
                &params,
            )
            .await?
            .get(0);
        snapshot.commit().await?;
        let jobs = rows
            .iter()
            .map(|r| PendingJob {
                key: r.get(0),
                revision: r.get(1),
                due_ms: r.get(2),
                kind: r.get(3),
                terms: JobTerms::read(r, 4),
            })
            .collect();
        Ok((jobs, total))
    }

    /// Counts by status, and the duplicate and takeover totals.
    pub(crate) async fn counts(&self) -> Result<InboxCounts, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint,
                        coalesce(sum(takeovers), 0)::bigint
                   FROM postie_inbox GROUP BY status ORDER BY status",
                &[],
            )
            .await?;
        let mut counts = InboxCounts::default();
        for row in rows {
            counts.by_status.push((status_of(row.get(0))?, row.get(1)));
            counts.duplicates += row.get::<_, i64>(2);
            counts.takeovers += row.get::<_, i64>(3);
        }
        Ok(counts)
    }
}
