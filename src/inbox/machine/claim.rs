//! `postie_claim`: into `sending` (the SQL function in `sql/schema.sql`, as of
//! `sql/0017_reschedule_while_sending.sql`; its three steps: ① insert a new key, ② one
//! conditional UPDATE of a claimable row, ③ the rest under the row lock). Claims run
//! in batches (`batch.rs`): every worker's [`Inbox::claim`] joins a queue, and one task
//! runs whatever has queued as one statement (`CLAIM`), then the next batch.
//!
//! Why: the claim was the last statement each email paid a round trip and a commit
//! for alone (completions are batched in `complete.rs`). The batch calls
//! `postie_claim` once per row, in key order, in one transaction: each row's answer
//! is the one-key claim's, and the claims take effect together at the commit, before
//! any caller hears its answer and sends. Meanwhile another claim of one of those keys
//! waits on its row lock, as it waits on a claim of its own. A key twice in a batch is
//! claimed by the first row; the second finds that live claim (`busy`), as it would
//! one statement later.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::Row;

use super::super::batch::{Batcher, Running, Statement};
use super::super::{DbError, Inbox};

/// One claim waiting for its batch.
pub(in crate::inbox) struct Asking {
    key: String,
    owner: String,
    lease_ms: i64,
    revision: i32,
}

/// The claims' statement.
pub(in crate::inbox) struct Claiming;

/// The claims' batching task.
pub(in crate::inbox) type Claimer = Batcher<Claiming>;

/// `postie_claim` for each row, in the rows' order (the batch sorts them by key), in
/// one transaction; the answers in the same order. A claim alone is a batch of one.
const CLAIM: &str = "SELECT r.outcome, r.fence, r.prior_status, r.wait_ms
  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::int[]) WITH ORDINALITY
       AS c(key, owner, lease_ms, revision, n)
 CROSS JOIN LATERAL postie_claim(c.key, c.owner, c.lease_ms, c.revision) AS r
 ORDER BY c.n";

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This instance owns the key under `fence`.
    Claimed {
        /// Fencing token: completions must present it.
        fence: i64,
        /// True if an expired `sending` lease was taken over: the previous owner may
        /// have sent the email (the one known duplicate window).
        takeover: bool,
    },
    /// Already sent: a duplicate to suppress.
    AlreadySent,
    /// Another instance holds a live lease for `remaining`.
    Busy {
        /// Time left on the other claim.
        remaining: Duration,
    },
    /// A cancel covers this revision.
    Cancelled,
    /// A newer revision of the key has been seen.
    Stale,
}

impl Statement for Claiming {
    type Row = Asking;
    type Answer = Claim;

    fn key(row: &Asking) -> &str {
        &row.key
    }

    fn many<'a>(&'a self, pool: &'a Pool, rows: &'a [Asking]) -> Running<'a, Vec<Claim>> {
        Box::pin(claim_many(pool, rows))
    }

    fn one<'a>(&'a self, pool: &'a Pool, row: &'a Asking) -> Running<'a, Claim> {
        Box::pin(claim_one(pool, row))
    }
}

impl Inbox {
    /// Claims revision `revision` of `key` for `owner` for `lease` (see `postie_claim`
    /// in `sql/schema.sql`, as of `sql/0017_reschedule_while_sending.sql`), in a batch
    /// with the claims queued meanwhile. An answer this postie does not know is an
    /// error that the worker waits out as an outage (a database migrated by a newer
    /// postie), never a reason to defer or dead-letter the job.
    pub async fn claim(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
        revision: i32,
    ) -> Result<Claim, DbError> {
        let asking = Asking {
            key: key.to_owned(),
            owner: owner.to_owned(),
            lease_ms: lease.as_millis() as i64,
            revision,
        };
        self.claimer.run(&self.pool, || Claiming, asking).await
    }
}

async fn claim_one(pool: &Pool, asking: &Asking) -> Result<Claim, DbError> {
    let mut answers = claim_many(pool, std::slice::from_ref(asking)).await?;
    Ok(answers.remove(0))
}

async fn claim_many(pool: &Pool, rows: &[Asking]) -> Result<Vec<Claim>, DbError> {
    let client = pool.get().await?;
    let stmt = client.prepare_cached(CLAIM).await?;
    let keys: Vec<&str> = rows.iter().map(|a| a.key.as_str()).collect();
    let owners: Vec<&str> = rows.iter().map(|a| a.owner.as_str()).collect();
    let leases: Vec<i64> = rows.iter().map(|a| a.lease_ms).collect();
    let revisions: Vec<i32> = rows.iter().map(|a| a.revision).collect();
    let answers = client
        .query(&stmt, &[&keys, &owners, &leases, &revisions])
        .await?;
    if answers.len() != rows.len() {
        return Err(DbError::unreadable(format!(
            "postie_claim answered {} rows for a batch of {}",
            answers.len(),
            rows.len()
        )));
    }
    answers.iter().map(answer).collect()
}

/// `postie_claim`'s row as a [`Claim`].
fn answer(row: &Row) -> Result<Claim, DbError> {
    let outcome: &str = row.try_get(0)?;
    Ok(match outcome {
        "claimed" => Claim::Claimed {
            fence: row.try_get(1)?,
            takeover: row.try_get::<_, &str>(2)? == "sending",
        },
        "done" => Claim::AlreadySent,
        "cancelled" => Claim::Cancelled,
        "stale" => Claim::Stale,
        "busy" => Claim::Busy {
            remaining: Duration::from_millis(row.try_get::<_, i64>(3)?.max(1) as u64),
        },
        other => {
            return Err(DbError::unreadable(format!(
                "postie_claim answered {other:?}, which this postie does not know"
            )))
        }
    })
}
