//! The suppression list (issue 30, `sql/0012_suppression.sql`): addresses postie no
//! longer sends to, for every email or one job type, with why, from what and until
//! when; every add and remove kept in an audit trail; and the strikes of bare 5xx
//! replies that suppress an address once they reach a threshold.
//!
//! Adding is idempotent: a live row for the address and scope is left as it is (the
//! first evidence stands), so a replayed report adds nothing. An expired row is
//! replaced.

use std::time::Duration;

use super::{DbError, Inbox};

mod bulk;
mod filter;

pub(crate) use bulk::Entry;
pub(crate) use filter::Filter;

/// Why an address is suppressed (the `reason` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SuppressionReason {
    /// A permanent failure naming the mailbox (5.1.1 …), or bare 5xx strikes.
    HardBounce,
    /// The recipient reported the email as spam.
    Complaint,
    /// The recipient asked for no more email.
    Unsubscribe,
    /// Added by an operator.
    Manual,
}

impl SuppressionReason {
    /// Every reason.
    pub const ALL: [Self; 4] = [
        Self::HardBounce,
        Self::Complaint,
        Self::Unsubscribe,
        Self::Manual,
    ];

    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HardBounce => "hard_bounce",
            Self::Complaint => "complaint",
            Self::Unsubscribe => "unsubscribe",
            Self::Manual => "manual",
        }
    }

    /// Reads the column's value.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == text)
    }
}

/// One row of the list, as `postie suppression list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Suppression {
    /// The address, normalised.
    pub address: String,
    /// `*` or a job type.
    pub scope: String,
    /// Why.
    pub reason: SuppressionReason,
    /// What added it.
    pub source: String,
    /// The reply or report that caused it.
    pub evidence: Option<String>,
    /// When (RFC 3339).
    pub created_at: String,
    /// Until when (RFC 3339), if it expires.
    pub expires_at: Option<String>,
}

/// A new suppression.
#[derive(Debug, Clone, Copy)]
pub struct Suppress<'a> {
    /// The address (normalised here).
    pub address: &'a str,
    /// `*` or a job type.
    pub scope: &'a str,
    /// Why.
    pub reason: SuppressionReason,
    /// What adds it.
    pub source: &'a str,
    /// The reply or report.
    pub evidence: Option<&'a str>,
    /// How long it lasts; `None`: until removed.
    pub lasts: Option<Duration>,
}

/// How postie compares addresses: trimmed and lower-cased (the local part is
/// case-sensitive in theory, never in practice at the providers this list mirrors).
pub(crate) fn normalise(address: &str) -> String {
    address.trim().to_lowercase()
}

/// The list's readers' columns, as [`read_row`] reads them.
pub(super) const LIST_SELECT: &str = "SELECT address, scope, reason, source, evidence,
        to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
        to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
   FROM postie_suppression";

/// A row of `postie_suppression` as the list's readers select it (address, scope,
/// reason, source, evidence, created_at and expires_at as text); `None` for a reason
/// this postie does not know.
fn read_row(r: &tokio_postgres::Row) -> Option<Suppression> {
    Some(Suppression {
        address: r.get(0),
        scope: r.get(1),
        reason: SuppressionReason::parse(r.get(2))?,
        source: r.get(3),
        evidence: r.get(4),
        created_at: r.get(5),
        expires_at: r.get(6),
    })
}

/// Adds a row (address, scope, reason, source, evidence, seconds it lasts or NULL)
/// with its audit row, unless a live row for the address and scope is there.
pub(super) const ADD_SQL: &str = "WITH added AS (
     INSERT INTO postie_suppression AS s
            (address, scope, reason, source, evidence, expires_at)
     VALUES ($1, $2, $3, $4, $5, now() + $6::float8 * interval '1 second')
     ON CONFLICT (address, scope) DO UPDATE
        SET reason = EXCLUDED.reason, source = EXCLUDED.source,
            evidence = EXCLUDED.evidence, created_at = now(),
            expires_at = EXCLUDED.expires_at
      WHERE s.expires_at IS NOT NULL AND s.expires_at <= now()
     RETURNING address, scope, reason, source, evidence)
 INSERT INTO postie_suppression_audit (address, scope, action, reason, source, evidence)
 SELECT address, scope, 'add', reason, source, evidence FROM added";

impl Inbox {
    /// The suppressed among `addresses` (normalised) under any of `scopes` (`*`, the
    /// job's type, the scope its unsubscribe link leaves), each with its reason.
    ///
    /// The filter answers first (no statement when none of them can be on the list);
    /// it is started on the first call.
    pub(crate) async fn suppressed(
        &self,
        addresses: &[String],
        scopes: &[&str],
    ) -> Result<Vec<(String, SuppressionReason)>, DbError> {
        let filter = self.suppression_filter.get_or_init(|| {
            let filter = std::sync::Arc::new(Filter::new(filter::CAPACITY));
            filter.spawn_refresh(self.pool.clone());
            filter
        });
        if !filter.may_hold_any(addresses) {
            return Ok(Vec::new());
        }
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "SELECT DISTINCT ON (address) address, reason FROM postie_suppression
                  WHERE address = ANY($1) AND scope = ANY($2)
                    AND (expires_at IS NULL OR expires_at > now())",
            )
            .await?;
        let rows = client.query(&stmt, &[&addresses, &scopes]).await?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                let reason = SuppressionReason::parse(r.get(1))?;
                Some((r.get::<_, String>(0), reason))
            })
            .collect())
    }

    /// Adds `s` (with its audit row) unless a live row for the address and scope is
    /// there; true if it was added.
    pub async fn suppress(&self, s: Suppress<'_>) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(ADD_SQL).await?;
        let lasts = s.lasts.map(|d| d.as_secs_f64());
        self.note_suppressed(&normalise(s.address));
        let added = client
            .execute(
                &stmt,
                &[
                    &normalise(s.address),
                    &s.scope,
                    &s.reason.as_str(),
                    &s.source,
                    &s.evidence,
                    &lasts,
                ],
            )
            .await?;
        Ok(added == 1)
    }

    /// Tells this instance's filter (if started) that `address` (normalised) is on
    /// the list.
    pub(super) fn note_suppressed(&self, address: &str) {
        if let Some(filter) = self.suppression_filter.get() {
            filter.insert(address);
        }
    }

    /// Removes the address's row in `scope` (every scope when `None`), with audit
    /// rows naming `source`; how many were removed.
    pub(crate) async fn unsuppress(
        &self,
        address: &str,
        scope: Option<&str>,
        source: &str,
    ) -> Result<u64, DbError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "WITH removed AS (
                     DELETE FROM postie_suppression
                      WHERE address = $1 AND ($2::text IS NULL OR scope = $2)
                     RETURNING address, scope, reason)
                 INSERT INTO postie_suppression_audit (address, scope, action, reason, source)
                 SELECT address, scope, 'remove', reason, $3 FROM removed",
            )
            .await?;
        Ok(client
            .execute(&stmt, &[&normalise(address), &scope, &source])
            .await?)
    }

    /// The list (live rows), by address; only `address`'s when given; at most `limit`.
    pub(crate) async fn suppression_list(
        &self,
        address: Option<&str>,
        limit: i64,
    ) -> Result<Vec<Suppression>, DbError> {
        let client = self.pool.get().await?;
        let address = address.map(normalise);
        let rows = client
            .query(
                &format!(
                    "{LIST_SELECT}
                  WHERE ($1::text IS NULL OR address = $1)
                    AND (expires_at IS NULL OR expires_at > now())
                  ORDER BY address, scope LIMIT $2"
                ),
                &[&address, &limit],
            )
            .await?;
        Ok(rows.iter().filter_map(read_row).collect())
    }

    /// Counts a bare 5xx strike against `address` (those older than `window`
    /// forgotten); at `threshold` strikes it is suppressed as a hard bounce. True if
    /// this strike suppressed it.
    pub(crate) async fn strike(
        &self,
        address: &str,
        window: Duration,
        threshold: u32,
        source: &str,
        evidence: &str,
    ) -> Result<bool, DbError> {
        let address = normalise(address);
        let strikes: i32 = {
            let client = self.pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "INSERT INTO postie_suppression_strikes AS s (address, strikes)
                     VALUES ($1, ARRAY[now()])
                     ON CONFLICT (address) DO UPDATE
                        SET strikes = ARRAY(SELECT t FROM unnest(s.strikes) t
                                             WHERE t > now() - $2::float8 * interval '1 second')
                                      || now()
                     RETURNING cardinality(strikes)",
                )
                .await?;
            client
                .query_one(&stmt, &[&address, &window.as_secs_f64()])
                .await?
                .get(0)
        };
        if strikes < threshold as i32 {
            return Ok(false);
        }
        let evidence = format!("{strikes} permanent failures without an enhanced status within {}; the last: {evidence}", humantime::format_duration(window));
        self.suppress(Suppress {
            address: &address,
            scope: "*",
            reason: SuppressionReason::HardBounce,
            source,
            evidence: Some(&evidence),
            lasts: None,
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_read_back_and_addresses_compare_in_one_case() {
        for reason in SuppressionReason::ALL {
            assert_eq!(SuppressionReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(SuppressionReason::parse("soft"), None);
        assert_eq!(normalise("  Ann@Example.COM "), "ann@example.com");
    }
}
