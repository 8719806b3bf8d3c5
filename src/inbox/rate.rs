//! The fleet-wide send-rate limit's one row (`sql/0005_rate_limit.sql`): a GCRA
//! whose theoretical arrival time (`tat`) instances move forward a slice at a time.
//! Also the sends per provider that `postie status` shows.

use std::time::Duration;

use super::{DbError, Inbox};

impl Inbox {
    /// Reserves `tokens` sends under limit `name` at `per_second`, allowing a burst
    /// `tolerance` ahead of the steady pace, in one statement (the row lock serialises
    /// instances). Returns how long to wait before using them: zero when the bucket
    /// has room, else until the slice's turn. A reservation is never refused, so an
    /// instance holds at most the slice it asked for.
    pub(crate) async fn lease_tokens(
        &self,
        name: &str,
        tokens: u32,
        per_second: f64,
        tolerance: Duration,
    ) -> Result<Duration, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "INSERT INTO postie_rate_limit AS r (name, tat)
                 VALUES ($1, now() + make_interval(secs => $2::float8))
                 ON CONFLICT (name) DO UPDATE
                    SET tat = greatest(r.tat, now()) + make_interval(secs => $2::float8)
                 RETURNING greatest(0, extract(epoch FROM
                    r.tat - make_interval(secs => $2::float8) - now())::float8 - $3::float8)",
            )
            .await?;
        let span = f64::from(tokens) / per_second;
        let wait: f64 = client
            .query_one(&stmt, &[&name, &span, &tolerance.as_secs_f64()])
            .await?
            .get(0);
        Ok(Duration::from_secs_f64(wait.max(0.0)))
    }

    /// Emails recorded sent in the last minute, fleet-wide (for `postie status`).
    pub(crate) async fn sent_last_minute(&self) -> Result<i64, DbError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*) FROM postie_inbox
                  WHERE status = 'sent' AND sent_at > now() - interval '60 seconds'",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Emails recorded sent per transport (the `provider` column; `None` for rows
    /// an older postie sent): in the last minute and in the last hour, fleet-wide.
    pub(crate) async fn sent_by_provider(&self) -> Result<Vec<ProviderSends>, DbError> {
        let client = self.pool.get().await?;
        // updated_at bounds the scan to the finished-rows index; a sent row's
        // updated_at is its sent_at.
        let rows = client
            .query(
                "SELECT provider,
                        count(*) FILTER (WHERE sent_at > now() - interval '60 seconds'),
                        count(*)
                   FROM postie_inbox
                  WHERE status = 'sent' AND updated_at > now() - interval '1 hour'
                    AND sent_at > now() - interval '1 hour'
                  GROUP BY provider ORDER BY provider",
                &[],
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ProviderSends {
                    provider: row.try_get(0)?,
                    last_minute: row.try_get(1)?,
                    last_hour: row.try_get(2)?,
                })
            })
            .collect()
    }
}

/// One transport's recent sends ([`Inbox::sent_by_provider`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProviderSends {
    /// The transport's name, `None` for rows sent before postie recorded it.
    pub(crate) provider: Option<String>,
    /// Sent in the last 60 s.
    pub(crate) last_minute: i64,
    /// Sent in the last hour.
    pub(crate) last_hour: i64,
}
