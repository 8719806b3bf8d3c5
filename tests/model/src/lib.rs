//! A model of postie's claim protocol (issue 34), checked with [stateright]: workers
//! that claim, send and record under a lease and a fencing token; the inbox row and
//! the statements that move it (`inbox.rs`, each the mirror of its SQL); the broker
//! (the ladder's intake, the relay's record, the ladder, retry queues, `<p>.send`);
//! the reconciler; a clock in steps; a producer that may publish twice, cancel or
//! reschedule; and faults: a crash at any step, a pause longer than the lease (the
//! clock passes while a worker does nothing), a lost ack, a lost publish confirm, a
//! lost 250, a job the broker loses.
//!
//! `sql.rs` holds the digest of the SQL the model mirrors: a test fails when that SQL
//! changes, until the model is checked against it again. `tests/against_db.rs` runs
//! the model's scenarios as real statements against PostgreSQL.
//!
//! [stateright]: https://docs.rs/stateright

pub mod inbox;
pub mod properties;
pub mod protocol;
pub mod sql;
pub mod state;
mod step;

use std::time::{Duration, Instant};

use stateright::{Checker, Model};

pub use protocol::{Action, Protocol};
pub use state::{Job, State};

impl Protocol {
    /// The configuration checked exhaustively in CI: two workers, one job, a cancel,
    /// three faults.
    pub fn small() -> Self {
        Protocol {
            workers: 2,
            jobs: vec![Job { rev: 0, due: 1 }],
            cancel: Some(0),
            faults: 3,
            lease: 2,
            send_deadline: 1,
            grace: 1,
            horizon: 32,
        }
    }

    /// The small configuration with a reschedule (revision 1, due later), two faults;
    /// also checked exhaustively in CI.
    pub fn reschedule() -> Self {
        Protocol {
            jobs: vec![Job { rev: 0, due: 1 }, Job { rev: 1, due: 2 }],
            faults: 2,
            ..Self::small()
        }
    }

    /// A larger one, for random simulation: three workers, a reschedule, five faults.
    pub fn large() -> Self {
        Protocol {
            workers: 3,
            faults: 5,
            horizon: 48,
            ..Self::reschedule()
        }
    }
}

/// What a run of the checker found.
#[derive(Debug)]
pub struct Figures {
    pub states: usize,
    pub unique: usize,
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Properties with a discovery: a counterexample of a promise, an example of a
    /// `sometimes`, each with its path formatted.
    pub discoveries: Vec<(&'static str, String)>,
}

impl Figures {
    fn of<C: Checker<Protocol>>(checker: &C, started: Instant) -> Self {
        let mut discoveries: Vec<_> = checker
            .discoveries()
            .into_iter()
            .map(|(name, path)| (name, format!("{path}")))
            .collect();
        discoveries.sort();
        Figures {
            states: checker.state_count(),
            unique: checker.unique_state_count(),
            max_depth: checker.max_depth(),
            elapsed: started.elapsed(),
            discoveries,
        }
    }

    /// The promises (`always`, `eventually`) with a counterexample, in the order
    /// `properties::all` lists them.
    pub fn broken(&self) -> Vec<&'static str> {
        properties::promises()
            .into_iter()
            .filter(|p| self.discoveries.iter().any(|(n, _)| n == p))
            .collect()
    }
}

/// Checks every reachable state of `model` (breadth first, one thread: the shortest
/// path to each discovery).
pub fn check_exhaustively(model: Protocol) -> Figures {
    let started = Instant::now();
    let checker = model.checker().spawn_bfs().join();
    Figures::of(&checker, started)
}

/// Random walks through `model` for `duration`.
pub fn simulate(model: Protocol, seed: u64, duration: Duration) -> Figures {
    let started = Instant::now();
    let checker = model
        .checker()
        .timeout(duration)
        .spawn_simulation(seed, stateright::UniformChooser)
        .join();
    Figures::of(&checker, started)
}
