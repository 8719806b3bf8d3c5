//! The fleet-wide send-rate limit's one row (`sql/0005_rate_limit.sql`): a GCRA
//! whose theoretical arrival time (`tat`) instances move forward a slice at a time.

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
}
