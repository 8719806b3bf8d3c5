//! `finish_unclaimed`: the end of a scheduled job that ended without a claim (invalid,
//! or cancelled: the reconciler's rows would otherwise wait for a claim that never
//! comes). No event: a cancelled row's was written by `postie_cancel`, and an invalid
//! job has no key a producer knows.

use super::super::{DbError, Inbox};
use super::Status;

/// `finish_unclaimed`: `dead` or `cancelled` (`$3`) for a `scheduled` row of this
/// revision or an older one, its body dropped.
const FINISH_UNCLAIMED: &str =
    "UPDATE postie_inbox SET status = $3, body = NULL, updated_at = now()
 WHERE key = $1 AND status = 'scheduled' AND revision <= $2";

impl Inbox {
    /// Ends the scheduled row of `key` as `status` (`dead` or `cancelled`), its body
    /// dropped, when its job (at `revision`) ended without a claim; a row scheduled at
    /// a newer revision is left alone. True if a row was ended.
    pub(crate) async fn finish_unclaimed(
        &self,
        key: &str,
        revision: i32,
        status: Status,
    ) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(FINISH_UNCLAIMED).await?;
        let ended = client
            .execute(&stmt, &[&key, &revision, &status.as_str()])
            .await?;
        Ok(ended > 0)
    }
}
