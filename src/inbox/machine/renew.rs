//! `renew`: the holder of a claim extends its lease while it sends (`work::worker`'s
//! lease keeper). Fenced and only on a `sending` row: a claim taken over or finished
//! is not renewed, and its holder learns that it must not go on to hand the email over.
//! No status changes.

use std::time::Duration;

use super::super::{DbError, Inbox};

/// `renew` of one claim: the lease from now, by the database's clock (as the claim's).
const RENEW: &str = "UPDATE postie_inbox
   SET lease_until = clock_timestamp() + $3::bigint * interval '1 millisecond'
 WHERE key = $1 AND fence = $2 AND status = 'sending'";

impl Inbox {
    /// Renews the claim `fence` on `key` for `lease` from now (the database's clock,
    /// as the claim's). `false`: the claim is gone (taken over, or finished), so its
    /// holder must not go on to hand the email over.
    pub(crate) async fn renew(
        &self,
        key: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(RENEW).await?;
        let lease_ms = lease.as_millis() as i64;
        Ok(client.execute(&stmt, &[&key, &fence, &lease_ms]).await? == 1)
    }
}
