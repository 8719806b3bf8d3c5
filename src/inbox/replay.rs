//! Signature tokens remembered (issue 45, `sql/0021_feedback_trust.sql`): Mailgun signs
//! only a timestamp and a token, not the event, so a captured request could be posted
//! again within its window with other event-data. Each token is kept with the SHA-256
//! of the request it came in until it is past that window: the same request again is
//! Mailgun retrying (let through, and recorded as a duplicate), another body under a
//! seen token is a replay.
//!
//! In PostgreSQL rather than in each instance's memory, so that a replay sent to
//! another instance is refused too, and so that the set outlives a restart. Its size is
//! bounded by construction (only validly signed tokens are added, each until its
//! expiry, and expired rows are deleted by every add) and by a cap: at the cap a new
//! token is refused ([`TokenSeen::Full`]) rather than an old one forgotten.

use super::{DbError, Inbox};

/// What a token's check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenSeen {
    /// Never seen: remembered now.
    New,
    /// Seen with this very request: a retry.
    Same,
    /// Seen with another request: a replay.
    Other,
    /// Not seen, and the set is at its cap: not remembered, so not to be trusted.
    Full,
}

impl Inbox {
    /// Checks and remembers `token` of `source`, which came with a request whose
    /// SHA-256 is `digest`, until `expires` (Unix seconds); at most `cap` tokens of
    /// `source` are kept (a race of concurrent adds may pass it by the requests in
    /// flight).
    pub(crate) async fn remember_token(
        &self,
        source: &str,
        token: &str,
        digest: &str,
        expires: i64,
        cap: i64,
    ) -> Result<TokenSeen, DbError> {
        let client = self.pool.get().await?;
        client
            .execute(
                "DELETE FROM postie_webhook_tokens WHERE expires_at < now()",
                &[],
            )
            .await?;
        let added = client
            .execute(
                "INSERT INTO postie_webhook_tokens (source, token, body_sha256, expires_at)
                 SELECT $1, $2, $3, to_timestamp($4::bigint)
                  WHERE (SELECT count(*) FROM postie_webhook_tokens WHERE source = $1) < $5
                 ON CONFLICT (source, token) DO NOTHING",
                &[&source, &token, &digest, &expires, &cap],
            )
            .await?;
        if added == 1 {
            return Ok(TokenSeen::New);
        }
        let seen = client
            .query_opt(
                "SELECT body_sha256 FROM postie_webhook_tokens WHERE source = $1 AND token = $2",
                &[&source, &token],
            )
            .await?;
        Ok(match seen {
            None => TokenSeen::Full,
            Some(row) if row.try_get::<_, &str>(0)? == digest => TokenSeen::Same,
            Some(_) => TokenSeen::Other,
        })
    }
}
