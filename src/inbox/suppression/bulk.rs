//! The list in bulk, for `postie suppression import` and `export`: many entries added
//! in one transaction (all or none), and the list read in pages by address.

use chrono::{DateTime, Utc};

use super::{normalise, Suppression, SuppressionReason};
use crate::inbox::{DbError, Inbox};

/// Rows per statement of an import.
const CHUNK: usize = 1_000;

/// One entry of an import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The address (normalised when added).
    pub address: String,
    /// `*` or a job type.
    pub scope: String,
    /// Why.
    pub reason: SuppressionReason,
    /// Why, in words, for the audit trail.
    pub evidence: Option<String>,
    /// When it lifts itself; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
}

/// Adds `entries` that are not live on the list already, in chunks of one
/// transaction (so an import is all or nothing), with their audit rows naming
/// `source`; the count added. An entry whose (address, scope) appears twice counts once,
/// the first one kept.
const ADD_MANY: &str = "WITH input AS (
         SELECT DISTINCT ON (address, scope) address, scope, reason, evidence, expires_at
           FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[])
                WITH ORDINALITY AS t(address, scope, reason, evidence, expires_at, n)
          ORDER BY address, scope, n),
     added AS (
         INSERT INTO postie_suppression AS s
                (address, scope, reason, source, evidence, expires_at)
         SELECT address, scope, reason, $6, evidence, expires_at FROM input
         ON CONFLICT (address, scope) DO UPDATE
            SET reason = EXCLUDED.reason, source = EXCLUDED.source,
                evidence = EXCLUDED.evidence, created_at = now(),
                expires_at = EXCLUDED.expires_at
          WHERE s.expires_at IS NOT NULL AND s.expires_at <= now()
         RETURNING address, scope, reason, source, evidence),
     audited AS (
         INSERT INTO postie_suppression_audit
                (address, scope, action, reason, source, evidence)
         SELECT address, scope, 'add', reason, source, evidence FROM added
         RETURNING 1)
     SELECT count(*) FROM audited";

impl Inbox {
    /// Adds every entry in one transaction; how many were added (the others were
    /// live on the list already, in that scope).
    pub(crate) async fn suppress_many(
        &self,
        entries: &[Entry],
        source: &str,
    ) -> Result<u64, DbError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let stmt = tx.prepare_cached(ADD_MANY).await?;
        let mut added = 0u64;
        for chunk in entries.chunks(CHUNK) {
            let addresses: Vec<String> = chunk.iter().map(|e| normalise(&e.address)).collect();
            let scopes: Vec<&str> = chunk.iter().map(|e| e.scope.as_str()).collect();
            let reasons: Vec<&str> = chunk.iter().map(|e| e.reason.as_str()).collect();
            let evidence: Vec<Option<&str>> = chunk.iter().map(|e| e.evidence.as_deref()).collect();
            let expiries: Vec<Option<DateTime<Utc>>> = chunk.iter().map(|e| e.expires_at).collect();
            let row = tx
                .query_one(
                    &stmt,
                    &[&addresses, &scopes, &reasons, &evidence, &expiries, &source],
                )
                .await?;
            added += u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
            if let Some(filter) = self.suppression_filter.get() {
                addresses.iter().for_each(|a| filter.insert(a));
            }
        }
        tx.commit().await?;
        Ok(added)
    }

    /// Live entries after `after` (address, scope) in that order, at most `limit`: the
    /// list a page at a time, for an export of any size.
    pub(crate) async fn suppression_page(
        &self,
        after: Option<(&str, &str)>,
        limit: i64,
    ) -> Result<Vec<Suppression>, DbError> {
        let client = self.pool.get().await?;
        let (address, scope) = after.unzip();
        let rows = client
            .query(
                &format!(
                    "{}
                  WHERE ($1::text IS NULL OR (address, scope) > ($1, $2::text))
                    AND (expires_at IS NULL OR expires_at > now())
                  ORDER BY address, scope LIMIT $3",
                    super::LIST_SELECT
                ),
                &[&address, &scope, &limit],
            )
            .await?;
        Ok(rows.iter().filter_map(super::read_row).collect())
    }
}
