//! `finish_cancelled`: the end of a job cancelled while it was being sent (issue 34,
//! the model's finding 2): the send then failed, or its sender is gone.

use super::super::{DbError, Inbox};

/// `finish_cancelled`: `cancelled`, with its event, for a row a cancel covers that
/// was `retrying` or `sending` under an expired lease (the fence moves).
const FINISH_CANCELLED: &str = "WITH done AS (
    UPDATE postie_inbox
       SET status = 'cancelled', body = NULL, updated_at = now(),
           type = coalesce($4::text, type), owner = NULL, lease_until = NULL,
           fence = fence + (status = 'sending')::int
     WHERE key = $1 AND cancelled_through >= $2
       AND (status = 'retrying'
            OR status = 'sending' AND lease_until <= clock_timestamp())
 RETURNING key, type, message_id, attempts),
 events AS (
    INSERT INTO postie_events (key, outcome, type, message_id, attempts)
    SELECT key, 'cancelled', type, message_id, attempts FROM done
     WHERE $3::bool)
 SELECT key FROM done";

impl Inbox {
    /// Ends as `cancelled` the row of `key` whose claim answered `cancelled` for
    /// `revision`, when a cancel came while the job was being sent (the row keeps
    /// `sending`) and either the send then failed (`retrying`) or its sender is gone
    /// (`sending` under an expired lease: a crash; the fence moves, so a late
    /// completion of that sender is refused). Nothing else would end or prune such a
    /// row (issue 34, the model's finding 2). Its `cancelled` event in the same
    /// statement. A row in any other status is left alone (a cancel that ended it
    /// wrote its event). A sender that crashed after its relay's 250 did send: the
    /// documented window, here recorded `cancelled`.
    pub(crate) async fn finish_cancelled(
        &self,
        key: &str,
        revision: i32,
        kind: Option<&str>,
    ) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(FINISH_CANCELLED).await?;
        let ended = client
            .execute(&stmt, &[&key, &revision, &self.events, &kind])
            .await?;
        Ok(ended == 1)
    }
}
