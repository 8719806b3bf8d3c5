//! The fleet's clock: due times are stamped (relay) and checked (worker) on
//! PostgreSQL's clock, which every instance shares, not on each machine's own.
//!
//! Each instance measures its offset from `clock_timestamp()` (the server's clock at
//! the moment it runs the statement), halving the round trip, keeps the sample with
//! the shortest round trip of a few, and re-measures every [`RESYNC_EVERY`]. The
//! fleet's now is then this machine's wall clock plus that offset: a worker whose
//! clock runs 5 s ahead does not send 5 s early, and a relay whose clock runs behind
//! does not stamp due times that a worker reads as "early" and sends back again and
//! again. The error left is half a round trip (milliseconds on a LAN). An instance
//! whose clock is off by more than [`WARN_OFF_BY`] says so in the log.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{DbError, Inbox};

/// How often the offset is measured again (a clock stepped by NTP, or drifting).
pub(crate) const RESYNC_EVERY: Duration = Duration::from_secs(30);
/// A clock off by more than this from PostgreSQL's is logged as a warning.
pub(crate) const WARN_OFF_BY: Duration = Duration::from_secs(1);
/// Queries per measurement; the one with the shortest round trip is kept.
const SAMPLES: usize = 3;
/// A measurement whose best round trip is longer than this is not trusted.
const MAX_ROUND_TRIP: Duration = Duration::from_secs(1);

/// This process's measured offset from PostgreSQL's clock, in ms (0 until measured).
static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Now on the fleet's clock, in Unix milliseconds: this machine's wall clock plus
/// its measured offset from PostgreSQL's.
pub(crate) fn fleet_now_ms() -> i64 {
    local_now_ms() + OFFSET_MS.load(Ordering::Relaxed)
}

fn local_now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// One measurement of this machine's clock against PostgreSQL's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClockSample {
    /// PostgreSQL's clock minus this machine's, in ms.
    pub(crate) offset_ms: i64,
    /// The query's round trip, in ms (the offset is good to half of it).
    pub(crate) round_trip_ms: i64,
}

impl ClockSample {
    /// The offset of a server reading `server_ms` taken during a round trip that
    /// started at local `sent_ms` and lasted `round_trip_ms`: the server is assumed to
    /// have read its clock half-way.
    pub(crate) fn from_reading(sent_ms: i64, round_trip_ms: i64, server_ms: i64) -> Self {
        Self {
            offset_ms: server_ms - (sent_ms + round_trip_ms / 2),
            round_trip_ms,
        }
    }
}

impl Inbox {
    /// Measures this machine's clock against PostgreSQL's: the sample with the
    /// shortest round trip of [`SAMPLES`].
    pub(crate) async fn measure_clock(&self) -> Result<ClockSample, DbError> {
        let client = self.pool.get().await?;
        let statement = client
            .prepare("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8")
            .await?;
        let mut best: Option<ClockSample> = None;
        for _ in 0..SAMPLES {
            let (sent_ms, started) = (local_now_ms(), Instant::now());
            let server_ms: i64 = client.query_one(&statement, &[]).await?.get(0);
            let round_trip_ms = started.elapsed().as_millis() as i64;
            let sample = ClockSample::from_reading(sent_ms, round_trip_ms, server_ms);
            if best.is_none_or(|b| sample.round_trip_ms < b.round_trip_ms) {
                best = Some(sample);
            }
        }
        Ok(best.expect("at least one sample"))
    }

    /// Measures the offset and puts it in use; warns when the clock is off by more
    /// than [`WARN_OFF_BY`] (and when it is back within it). `warned` carries the
    /// offset last warned about between calls.
    pub(crate) async fn sync_clock(
        &self,
        warned: &mut Option<i64>,
    ) -> Result<ClockSample, DbError> {
        let sample = self.measure_clock().await?;
        if sample.round_trip_ms > MAX_ROUND_TRIP.as_millis() as i64 {
            tracing::debug!(
                ?sample,
                "clock measurement's round trip too long; keeping the offset in use"
            );
            return Ok(sample);
        }
        OFFSET_MS.store(sample.offset_ms, Ordering::Relaxed);
        let off_by = sample.offset_ms.abs();
        if off_by > WARN_OFF_BY.as_millis() as i64 {
            // Once per outage of time sync, and again if it moves by another half second.
            if warned.is_none_or(|last| (last - sample.offset_ms).abs() > 500) {
                let direction = if sample.offset_ms < 0 {
                    "ahead of"
                } else {
                    "behind"
                };
                tracing::warn!(
                    offset_ms = sample.offset_ms,
                    round_trip_ms = sample.round_trip_ms,
                    "this instance's clock is {:.1} s {direction} PostgreSQL's: due times are read on \
                     PostgreSQL's clock (offset applied); fix the host's time sync",
                    off_by as f64 / 1000.0
                );
                *warned = Some(sample.offset_ms);
            }
        } else if warned.take().is_some() {
            tracing::info!(
                offset_ms = sample.offset_ms,
                "this instance's clock agrees with PostgreSQL's again"
            );
        }
        Ok(sample)
    }

    /// Measures the offset again every [`RESYNC_EVERY`] until `stop` (the first
    /// measurement is [`Inbox::sync_clock`]'s at start-up, `warned` what it warned).
    pub(crate) async fn discipline_clock(&self, mut warned: Option<i64>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RESYNC_EVERY) => {}
            }
            if let Err(error) = self.sync_clock(&mut warned).await {
                tracing::debug!(%error, "clock not measured; keeping the offset in use");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_reads_its_clock_half_way_through_the_round_trip() {
        // Sent at 1_000 local, answered 40 ms later with the server's 6_020: the server
        // read at local 1_020, so it is 5_000 ahead.
        let sample = ClockSample::from_reading(1_000, 40, 6_020);
        assert_eq!(sample.offset_ms, 5_000);
        let behind = ClockSample::from_reading(10_000, 0, 5_000);
        assert_eq!(behind.offset_ms, -5_000);
    }
}
