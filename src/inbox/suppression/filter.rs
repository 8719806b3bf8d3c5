//! A Bloom filter of the suppressed addresses, so that the check of a job's
//! recipients costs no statement when none of them can be on the list: the one
//! lookup happens only for an address the filter might hold (a real entry, a removed
//! or expired one not yet rebuilt away, or a false positive, about 1 % at capacity).
//!
//! Fresh within [`REFRESH`]: every instance reads the rows added since its last read
//! (with an overlap, for transactions that commit after their `created_at`), and an
//! address this instance suppresses goes in at once. Rebuilt from the whole table
//! every [`REBUILD`], which drops removed and expired entries. Until its first load
//! it answers "maybe" for everything. Its size is fixed: [`CAPACITY`] addresses at
//! 9.6 bits each (1.2 MB); past it the false positives grow, the answers stay right.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use deadpool_postgres::Pool;

use super::super::DbError;

/// How often the rows added since the last read are read.
pub(crate) const REFRESH: Duration = Duration::from_secs(1);
/// How often the filter is rebuilt from the whole table.
const REBUILD: Duration = Duration::from_secs(600);
/// Rows read again on each refresh (a commit may come after its `created_at`).
const OVERLAP: Duration = Duration::from_secs(30);
/// Hash functions.
const K: u64 = 7;
/// Addresses the filter is sized for (about 1 % false positives at this many).
pub(crate) const CAPACITY: usize = 1_000_000;

/// The filter's bits, swapped whole on a rebuild.
pub(crate) struct Filter {
    bits: std::sync::RwLock<Arc<Bits>>,
    /// The bits a rebuild is filling, which this instance's inserts also go to (so
    /// that an address suppressed while the table is read is not lost in the swap).
    building: std::sync::Mutex<Option<Arc<Bits>>>,
    capacity: usize,
    ready: AtomicBool,
}

struct Bits {
    words: Vec<AtomicU64>,
    seeds: (std::hash::RandomState, std::hash::RandomState),
}

impl Bits {
    fn new(capacity: usize) -> Self {
        let bits = (capacity.max(1024) as f64 * 9.6).ceil() as usize;
        Self {
            words: (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            seeds: (std::hash::RandomState::new(), std::hash::RandomState::new()),
        }
    }

    /// The `K` bit positions of `address` (double hashing).
    fn positions(&self, address: &str) -> impl Iterator<Item = usize> + '_ {
        let hash = |seed: &std::hash::RandomState| {
            let mut h = seed.build_hasher();
            h.write(address.as_bytes());
            h.finish()
        };
        let (a, b) = (hash(&self.seeds.0), hash(&self.seeds.1) | 1);
        let m = self.words.len() as u64 * 64;
        (0..K).map(move |i| (a.wrapping_add(i.wrapping_mul(b)) % m) as usize)
    }

    fn insert(&self, address: &str) {
        for p in self.positions(address) {
            self.words[p / 64].fetch_or(1 << (p % 64), Ordering::Relaxed);
        }
    }

    fn may_contain(&self, address: &str) -> bool {
        self.positions(address)
            .all(|p| self.words[p / 64].load(Ordering::Relaxed) & (1 << (p % 64)) != 0)
    }
}

impl Filter {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            bits: std::sync::RwLock::new(Arc::new(Bits::new(capacity))),
            building: std::sync::Mutex::new(None),
            capacity,
            ready: AtomicBool::new(false),
        }
    }

    fn bits(&self) -> Arc<Bits> {
        self.bits.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// False only when no address of `addresses` (normalised) is on the list.
    pub(crate) fn may_hold_any(&self, addresses: &[String]) -> bool {
        if !self.ready.load(Ordering::Acquire) {
            return true;
        }
        let bits = self.bits();
        addresses.iter().any(|a| bits.may_contain(a))
    }

    /// Notes an address (normalised) just suppressed.
    pub(crate) fn insert(&self, address: &str) {
        let building = self.building.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(next) = building.as_ref() {
            next.insert(address);
        }
        self.bits().insert(address);
    }

    /// Loads the whole table, then reads what is added, until the filter is dropped.
    pub(crate) fn spawn_refresh(self: &Arc<Self>, pool: Pool) {
        let filter: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut since: Option<chrono::DateTime<chrono::Utc>> = None;
            let mut rebuilt = tokio::time::Instant::now();
            loop {
                let Some(filter) = filter.upgrade() else {
                    return;
                };
                let rebuild = since.is_none() || rebuilt.elapsed() >= REBUILD;
                match filter
                    .refresh(&pool, if rebuild { None } else { since })
                    .await
                {
                    Ok(read_at) => {
                        since =
                            Some(read_at - chrono::Duration::from_std(OVERLAP).unwrap_or_default());
                        if rebuild {
                            rebuilt = tokio::time::Instant::now();
                        }
                    }
                    Err(error) => {
                        tracing::debug!(%error, "the suppression filter could not be refreshed; trying again");
                    }
                }
                drop(filter);
                tokio::time::sleep(REFRESH).await;
            }
        });
    }

    /// Reads the live rows added since `since`, or all of them into fresh bits that
    /// replace the current ones (`None`); the database's time of the read.
    async fn refresh(
        &self,
        pool: &Pool,
        since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<chrono::DateTime<chrono::Utc>, DbError> {
        let bits = match since {
            Some(_) => self.bits(),
            None => {
                let next = Arc::new(Bits::new(self.capacity));
                *self.building.lock().unwrap_or_else(|e| e.into_inner()) = Some(next.clone());
                next
            }
        };
        let read = self.read(pool, since, &bits).await;
        if since.is_none() {
            let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
            if read.is_ok() {
                *self.bits.write().unwrap_or_else(|e| e.into_inner()) = bits;
                self.ready.store(true, Ordering::Release);
            }
            *building = None;
        }
        read
    }

    /// Reads the live rows added since `since` (all when `None`) into `bits`; the
    /// database's time of the read.
    async fn read(
        &self,
        pool: &Pool,
        since: Option<chrono::DateTime<chrono::Utc>>,
        bits: &Bits,
    ) -> Result<chrono::DateTime<chrono::Utc>, DbError> {
        let client = pool.get().await?;
        // The read's time and the rows in one statement (one snapshot, one round trip).
        let row = client
            .query_one(
                "SELECT now(), ARRAY(SELECT DISTINCT address FROM postie_suppression
                                      WHERE ($1::timestamptz IS NULL OR created_at >= $1)
                                        AND (expires_at IS NULL OR expires_at > now()))",
                &[&since],
            )
            .await?;
        let read_at: chrono::DateTime<chrono::Utc> = row.get(0);
        let addresses: Vec<&str> = row.get(1);
        for address in addresses {
            bits.insert(address);
        }
        Ok(read_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_went_in_and_rarely_what_did_not() {
        let bits = Bits::new(10_000);
        for i in 0..10_000 {
            bits.insert(&format!("user{i}@example.com"));
        }
        assert!((0..10_000).all(|i| bits.may_contain(&format!("user{i}@example.com"))));
        let false_positives = (0..10_000)
            .filter(|i| bits.may_contain(&format!("other{i}@example.com")))
            .count();
        assert!(
            false_positives < 300,
            "{false_positives} of 10,000 at capacity"
        );
        let filter = Filter::new(100);
        assert!(filter.may_hold_any(&["a@x".into()]), "not loaded: maybe");
        // An address suppressed while a rebuild reads the table is in the new bits.
        let next = Arc::new(Bits::new(100));
        *filter.building.lock().unwrap() = Some(next.clone());
        filter.insert("late@x");
        assert!(next.may_contain("late@x") && filter.bits().may_contain("late@x"));
    }
}
