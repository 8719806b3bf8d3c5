//! Each instance's transport breakers, for the console's overview (issue 32): a
//! breaker lives in one instance's memory (`mail::route`), so the instance writes its
//! state to `postie_breakers` when it opens and when it closes (sql/0018). Each write
//! also deletes closed rows older than a day, so the table holds a day of instances.

use super::{DbError, Inbox};

/// One instance's breaker on one transport, as last written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breaker {
    /// The instance (`postie_inbox.owner`).
    pub owner: String,
    /// The transport's name.
    pub provider: String,
    /// Open: that instance sends nothing through this transport.
    pub open: bool,
    /// When it took this state, UTC, to the second.
    pub since: String,
}

impl Inbox {
    /// Writes that `owner`'s breaker on `provider` is now `open` (or closed).
    pub(crate) async fn record_breaker(
        &self,
        owner: &str,
        provider: &str,
        open: bool,
    ) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "WITH gone AS (
                    DELETE FROM postie_breakers
                     WHERE NOT open AND since < now() - interval '1 day')
                 INSERT INTO postie_breakers AS b (owner, provider, open, since)
                 VALUES ($1, $2, $3, now())
                 ON CONFLICT (owner, provider) DO UPDATE
                    SET open = EXCLUDED.open, since = EXCLUDED.since",
            )
            .await?;
        client.execute(&stmt, &[&owner, &provider, &open]).await?;
        Ok(())
    }

    /// Every breaker written in the last day, open ones first, then by transport.
    pub async fn breakers(&self) -> Result<Vec<Breaker>, DbError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT owner, provider, open,
                        to_char(since AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                   FROM postie_breakers
                  WHERE open OR since >= now() - interval '1 day'
                  ORDER BY open DESC, provider, owner",
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Breaker {
                owner: r.get(0),
                provider: r.get(1),
                open: r.get(2),
                since: r.get(3),
            })
            .collect())
    }
}
