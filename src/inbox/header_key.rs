//! The fleet's header key (`postie_header_key`, sql/0021): what `headers::Seal` signs
//! postie's own headers with. The first instance to start writes 32 random bytes
//! from its operating system; every instance reads the one row, so all of them seal
//! and verify alike.

use ring::rand::{SecureRandom, SystemRandom};

use anyhow::Context as _;

use super::{DbError, Inbox};

/// The key's length in bytes (HMAC-SHA256's block is 64; 32 is its strength).
const KEY_LEN: usize = 32;

impl Inbox {
    /// The fleet's header key: written once (by whichever instance comes first), then
    /// read by all.
    pub(crate) async fn header_key(&self) -> anyhow::Result<Vec<u8>> {
        let mut fresh = [0u8; KEY_LEN];
        SystemRandom::new()
            .fill(&mut fresh)
            .map_err(|_| anyhow::anyhow!("the operating system gave no random bytes"))
            .context("making the header key")?;
        self.store_header_key(&fresh)
            .await
            .context("reading the header key (postie_header_key)")
    }

    async fn store_header_key(&self, fresh: &[u8]) -> Result<Vec<u8>, DbError> {
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO postie_header_key (id, key) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
                &[&fresh],
            )
            .await?;
        let row = client
            .query_one("SELECT key FROM postie_header_key WHERE id = 1", &[])
            .await?;
        Ok(row.try_get(0)?)
    }
}
