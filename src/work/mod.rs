//! The unit of work: claim → send → record, one delivery at a time.
//!
//! - [`context`]: the [`Context`] an instance shares (settings, topology, owner,
//!   broker addresses, inbox, mailer, health and its metrics, the header `Seal`,
//!   hard stop), built once at start-up.
//! - [`worker`]: the state machine, one delivery's body and headers in, one
//!   [`Outcome`] out; it never touches the broker.
//! - [`policy`]: the [`RetryPolicy`], what each failure becomes.
//! - [`limiter`]: the send rate (fleet limit in PostgreSQL, adaptive cap, a cold
//!   instance's warm-up), one limiter per route, waited for before the claim.
//! - `lanes.rs`: `FairShare`, the lanes' weighted shares of the send rate (start-time
//!   fair queueing in front of the limiter, work-conserving).
//! - [`outcome`]: the [`Outcome`]s, and for each its log line, counter and
//!   [`Disposition`] (what the consume loop does with the delivery).

pub(crate) mod context;
mod lanes;
pub(crate) mod limiter;
pub(crate) mod outcome;
pub(crate) mod policy;
pub(crate) mod worker;

pub(crate) use context::{Context, SharedContext};
pub use limiter::Limiter;
pub(crate) use outcome::{dead_letter, DeadKind, Disposition, Outcome, Target};
pub(crate) use policy::Next;
pub(crate) use worker::{Interrupted, Worker};

/// Now on the fleet's clock (PostgreSQL's, see [`crate::inbox::clock`]), in Unix
/// milliseconds: what every due time is stamped and checked with.
pub(crate) fn now_ms() -> i64 {
    crate::inbox::clock::fleet_now_ms()
}
