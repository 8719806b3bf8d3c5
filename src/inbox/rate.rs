//! The one rate engine: every limit on sending, in PostgreSQL, on one clock
//! (`clock_timestamp()`, read once per call).
//!
//! - **GCRA rows** (the fleet's send rate, each transport's, each lane's share, each
//!   tenant's slot in its lane) are rows of `postie_rate_limit` moved by one SQL
//!   function, `postie_gcra_take` (`sql/0023_one_rate_engine.sql`): a slot of `span`
//!   starts at the row's theoretical arrival time (`tat`), or now if that has passed,
//!   and moves `tat` on by `span`. The fleet's, the transports' and the lanes'
//!   limiters lease a slice of tokens at a time ([`Inbox::lease_tokens`],
//!   `work::limiter`); a tenant takes one job's slot (`machine/defer.rs`,
//!   `tenant_row_sql`).
//! - **The per-type throttle** (`throttle.<type>`: at most N emails of a type per
//!   recipient per window) is a sliding window, `postie_window_take`
//!   (`sql/0024_window_take.sql`, [`Inbox::throttle`]): a row of `postie_throttle`
//!   per type and recipient holds the sends inside the window. It is not a GCRA row
//!   because "at most N per window" has no GCRA configuration: a span of window / N
//!   with a burst of N lets 2N − 1 through in one window, and a span of the whole
//!   window, which keeps N, gives a recipient who used the N back one per window
//!   instead of N.

use std::time::Duration;

use super::{DbError, Inbox};

/// A slot of the one rate engine: how far ahead of now it starts, in ms.
const TAKE: &str = "SELECT ahead_ms FROM postie_gcra_take($1, $2)";

/// One send under a type's throttle: allowed, or when the window next has room.
const WINDOW_TAKE: &str = "SELECT allowed, next_ms FROM postie_window_take($1, $2, $3, $4)";

/// The throttle's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Throttle {
    /// Under the limit; the send is counted.
    Allowed,
    /// Over the limit until `next_ms` (Unix ms).
    Limited {
        /// When the window allows the next one.
        next_ms: i64,
    },
}

/// What every tenant's GCRA row name starts with, and the one place it is spelled.
macro_rules! tenant_prefix {
    () => {
        "tenant:"
    };
}

/// The GCRA row of `tenant`'s slots in `lane`, in SQL (`$1` the lane, `$2` the
/// tenant; a lane's name has no `:`): `tenant:<lane>:<tenant>`.
macro_rules! tenant_row_sql {
    () => {
        concat!(
            "'",
            $crate::inbox::rate::tenant_prefix!(),
            "' || $1 || ':' || $2"
        )
    };
}
pub(super) use {tenant_prefix, tenant_row_sql};

/// What [`tenant_row_sql`]'s names start with.
pub(super) const TENANT_PREFIX: &str = tenant_prefix!();

/// The rows [`tenant_row_sql`] names, as a `LIKE` pattern.
pub(super) const TENANT_ROWS: &str = concat!(tenant_prefix!(), "%");

/// How long to wait for a slot that starts `ahead_ms` from now when the limit allows
/// a burst of `tolerance` ahead of the steady pace: zero within the burst.
fn wait_for(ahead_ms: f64, tolerance: Duration) -> Duration {
    let wait = ahead_ms / 1000.0 - tolerance.as_secs_f64();
    if wait.is_finite() && wait > 0.0 {
        Duration::from_secs_f64(wait)
    } else {
        Duration::ZERO
    }
}

impl Inbox {
    /// Reserves `tokens` sends under limit `name` at `per_second`, allowing a burst
    /// `tolerance` ahead of the steady pace, in one statement (the row lock serialises
    /// instances). Returns how long to wait before using them: zero when the bucket
    /// has room, else until the slice's turn. A reservation is never refused, so an
    /// instance holds at most the slice it asked for.
    pub(crate) async fn lease_tokens(
        &self,
        name: &str,
        tokens: u32,
        per_second: f64,
        tolerance: Duration,
    ) -> Result<Duration, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(TAKE).await?;
        let span_ms = f64::from(tokens) / per_second * 1000.0;
        let ahead_ms: f64 = client.query_one(&stmt, &[&name, &span_ms]).await?.get(0);
        Ok(wait_for(ahead_ms, tolerance))
    }

    /// Takes one send of `kind` to `recipient` under `limit` per `window`, in one
    /// statement (the row lock of `ON CONFLICT DO UPDATE` serialises instances): the
    /// send is counted only if the window has room.
    pub(crate) async fn throttle(
        &self,
        kind: &str,
        recipient: &str,
        limit: u32,
        window: Duration,
    ) -> Result<Throttle, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(WINDOW_TAKE).await?;
        let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        let row = client
            .query_one(&stmt, &[&kind, &recipient, &i64::from(limit), &window_ms])
            .await?;
        Ok(if row.get::<_, bool>(0) {
            Throttle::Allowed
        } else {
            Throttle::Limited {
                next_ms: row.get(1),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_slot_ahead_of_the_burst_is_the_wait() {
        let burst = Duration::from_millis(200);
        assert_eq!(wait_for(500.0, burst), Duration::from_millis(300));
        assert_eq!(wait_for(150.0, burst), Duration::ZERO, "within the burst");
        assert_eq!(
            wait_for(-40.0, Duration::ZERO),
            Duration::ZERO,
            "a slot already passed"
        );
        assert_eq!(wait_for(f64::NAN, burst), Duration::ZERO);
    }
}
