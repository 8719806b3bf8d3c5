//! The checker over the model: exhaustive for the small configurations (in CI, as
//! part of `make test`), a random simulation of a larger one (`make model`).

use std::time::Duration;

use postie_model::{check_exhaustively, simulate, Figures, Protocol};

// Both findings of this model (issue 34) are fixed, each replayed against PostgreSQL
// in `tests/against_db.rs` (`finding_1_…`, `finding_2_…`): a reschedule recorded while
// the older revision was being sent was dropped (sql/0017), and a cancel of a row a
// crashed worker left `sending` was never finished (`Inbox::finish_cancelled`). Every
// promise must hold: a counterexample fails these tests and prints its path.

fn print(what: &str, f: &Figures) {
    println!(
        "{what}: {} states generated, {} distinct, depth {}, {:.1} s",
        f.states,
        f.unique,
        f.max_depth,
        f.elapsed.as_secs_f64()
    );
    for promise in postie_model::properties::promises() {
        let broken = f.broken().contains(&promise);
        println!("  {} {promise}", if broken { "BROKEN" } else { "holds " });
    }
    for (name, path) in &f.discoveries {
        println!(
            "  discovered {name:?}:\n{}",
            path.trim_end().replace('\n', "\n    ")
        );
    }
}

#[test]
fn one_revision_exhaustively() {
    let figures = check_exhaustively(Protocol::small());
    print(
        "exhaustive, 2 workers, 1 revision, a cancel, 3 faults",
        &figures,
    );
    assert!(figures.broken().is_empty(), "broken promises: see above");
}

#[test]
fn a_reschedule_exhaustively() {
    let figures = check_exhaustively(Protocol::reschedule());
    print(
        "exhaustive, 2 workers, 2 revisions, a cancel, 2 faults",
        &figures,
    );
    assert!(figures.broken().is_empty(), "broken promises: see above");
}

#[test]
#[ignore = "a minute or more: `make model`"]
fn large_configuration_by_simulation() {
    let seconds = std::env::var("POSTIE_MODEL_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let figures = simulate(Protocol::large(), 34, Duration::from_secs(seconds));
    print(
        "simulation, 3 workers, 2 revisions, a cancel, 5 faults",
        &figures,
    );
    let broken = figures.broken();
    assert!(broken.is_empty(), "broken promises: {broken:?}");
}
