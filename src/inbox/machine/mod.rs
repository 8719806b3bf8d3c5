//! The inbox's state machine: every statement that changes a row's `status` (or, for
//! a row in flight, its due time or lease), one file per transition, named as the
//! protocol's model (`tests/model/src/inbox.rs`) names them, each with its one SQL
//! text, which serves a batch and a single row alike:
//!
//! | transition | file | from → to |
//! |---|---|---|
//! | `schedule` | `schedule.rs` | (no row), `scheduled`, `retrying`, `cancelled`, and a newer revision of `dead`, `throttled`, `suppressed` → `scheduled`; `sending` → `sending` `rescheduled` |
//! | `postie_claim` | `claim.rs` | (no row) and every status but `sent` → `sending` |
//! | `renew` | `renew.rs` | `sending` → `sending`, its lease extended |
//! | `complete` | `complete.rs` | `sending` → `sent`, `retrying`, `dead`, `throttled`, `suppressed` (a `rescheduled` row not sent → `scheduled`) |
//! | `postie_cancel` | `cancel.rs` | (no row) and every status but `sent`, `sending` → `cancelled` |
//! | `finish_cancelled` | `finish_cancelled.rs` | `retrying`, or `sending` under an expired lease, cancelled meanwhile → `cancelled` |
//! | `finish_unclaimed` | `finish_unclaimed.rs` | `scheduled` → `dead`, `cancelled` |
//! | `defer` | `defer.rs` | `scheduled` → `scheduled`, due at its tenant's slot |
//! | `debounce` | `debounce.rs` | (no row), `scheduled`, `retrying`, `cancelled`, `dead`, `throttled`, `suppressed` → `scheduled`, a new revision postie assigns; `sending` → `sending` `rescheduled` |
//!
//! ARCHITECTURE.md draws the machine ("The inbox's state machine");
//! `tests/state_machine.rs` checks that the drawing and this module agree and that no
//! statement outside this module (and the SQL functions it calls) writes `status`.
//! Every call is one statement in its own implicit transaction: a claim is committed
//! before the send starts, and a completion before the ack.

mod cancel;
mod claim;
mod complete;
mod debounce;
mod defer;
mod finish_cancelled;
mod finish_unclaimed;
mod renew;
mod schedule;
mod status;

pub(crate) use cancel::Cancelled;
pub use claim::Claim;
pub(in crate::inbox) use claim::Claimer;
pub(in crate::inbox) use complete::Completer;
pub use complete::Completion;
pub use debounce::{Debounced, Debouncing};
pub use schedule::Scheduled;
pub(in crate::inbox) use status::status_of;
pub(crate) use status::Status;
