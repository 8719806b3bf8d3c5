//! What the checker holds the protocol to.

use stateright::Property;

use crate::protocol::Protocol;
use crate::state::State;

/// The properties, `always` (safety), `eventually` (liveness) and `sometimes` (the
/// model reaches the documented windows at all: evidence it is not vacuous).
pub fn all() -> Vec<Property<Protocol>> {
    vec![
        Property::always("duplicates only of the documented kinds", |_, s: &State| {
            s.tally.dup_undocumented == 0
        }),
        Property::always("a stale fence never commits", |_, s: &State| {
            s.tally.stale_commits == 0
        }),
        Property::always("nothing sent before due", |_, s: &State| s.tally.early == 0),
        Property::always(
            "a revision claimed after its cancel committed is never sent",
            |_, s: &State| s.tally.after_cancel == 0,
        ),
        Property::always(
            "no revision older than one recorded for its key is claimed",
            |_, s: &State| s.tally.older_claimed == 0,
        ),
        Property::always(
            "the clock's horizon is never reached",
            |p: &Protocol, s: &State| s.clock < p.horizon,
        ),
        Property::eventually("every published job ends", |p: &Protocol, s: &State| {
            p.finished(s)
        }),
        Property::eventually(
            "every row ends in a terminal status",
            |p: &Protocol, s: &State| p.quiet(s) && s.row.is_some_and(|r| r.status.terminal()),
        ),
        Property::sometimes(
            "a duplicate: crash between 250 and commit",
            |_, s: &State| s.tally.dup_crash > 0,
        ),
        Property::sometimes(
            "a duplicate: lease expired during the send",
            |_, s: &State| s.tally.dup_lease_expired > 0,
        ),
        Property::sometimes("a duplicate: the 250 lost", |_, s: &State| {
            s.tally.dup_reply_lost > 0
        }),
        Property::sometimes("a duplicate: the record came too late", |_, s: &State| {
            s.tally.dup_record_late > 0
        }),
        Property::sometimes(
            "a send a cancel landed on while in flight",
            |_, s: &State| s.tally.cancel_in_flight > 0,
        ),
        Property::sometimes("sent once", |p: &Protocol, s: &State| {
            p.finished(s) && s.accepts.len() == 1
        }),
    ]
}

/// The names of the `always` and `eventually` properties (the promises).
pub fn promises() -> Vec<&'static str> {
    all()
        .into_iter()
        .filter(|p| p.expectation != stateright::Expectation::Sometimes)
        .map(|p| p.name)
        .collect()
}
