//! One statement for many callers: each caller's row joins a queue, and one task runs
//! whatever has queued as one statement (one round trip, one commit), answers each
//! caller, then takes the next batch. Under load many rows share a statement; alone,
//! a row goes at once (the task waits for nothing but the statement in flight).
//!
//! Used for the two statements every email pays: its claim (`machine/claim.rs`) and its
//! completion (`machine/complete.rs`). Rows are run in key order, so that two batches (of two
//! instances, or a claim batch and a completion batch) lock rows in the same order and
//! cannot deadlock. A batch PostgreSQL refuses for what one row carried is run again
//! row by row, so that the refusal reaches only that row's caller; an outage reaches
//! every caller of the batch, who each try again as they would after a statement of
//! their own.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot};

use super::DbError;

/// The most rows one statement carries; more wait for the next batch.
pub(super) const BATCH_MAX: usize = 256;

/// A statement's future, borrowing the pool and the rows.
pub(super) type Running<'a, T> = Pin<Box<dyn Future<Output = Result<T, DbError>> + Send + 'a>>;

/// A statement that can run for one row or for many.
pub(super) trait Statement: Send + Sync + 'static {
    /// One caller's row.
    type Row: Send + Sync + 'static;
    /// What the caller hears back.
    type Answer: Send + 'static;
    /// The row's key: batches run in its order.
    fn key(row: &Self::Row) -> &str;
    /// The rows in one statement: one answer per row, in their order.
    fn many<'a>(&'a self, pool: &'a Pool, rows: &'a [Self::Row]) -> Running<'a, Vec<Self::Answer>>;
    /// One row alone.
    fn one<'a>(&'a self, pool: &'a Pool, row: &'a Self::Row) -> Running<'a, Self::Answer>;
}

/// A row waiting for its batch, and where its answer goes.
type Waiting<S> = (
    <S as Statement>::Row,
    oneshot::Sender<Result<<S as Statement>::Answer, DbError>>,
);

/// The queue into a statement's batching task, started by the first row (so that an
/// `Inbox` can be built outside the runtime). The task ends when the last clone is
/// dropped.
pub(super) struct Batcher<S: Statement> {
    queue: Arc<OnceLock<mpsc::Sender<Waiting<S>>>>,
    /// `database.statement_timeout`: a batch without an answer by then is an outage
    /// for each of its callers (who try again), and the next batch goes.
    deadline: Duration,
}

impl<S: Statement> Clone for Batcher<S> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            deadline: self.deadline,
        }
    }
}

impl<S: Statement> Batcher<S> {
    pub(super) fn new(deadline: Duration) -> Self {
        Self {
            queue: Arc::default(),
            deadline,
        }
    }

    /// `database.statement_timeout`.
    pub(super) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Runs `row` in the next batch and returns its answer. `statement` builds the
    /// statement when this is the first row (it then lives as long as the task).
    pub(super) async fn run(
        &self,
        pool: &Pool,
        statement: impl FnOnce() -> S,
        row: S::Row,
    ) -> Result<S::Answer, DbError> {
        let queue = self.queue.get_or_init(|| {
            let (queue, batches) = mpsc::channel(BATCH_MAX);
            tokio::spawn(run_batches(
                statement(),
                pool.clone(),
                batches,
                self.deadline,
            ));
            queue
        });
        let (answer, answered) = oneshot::channel();
        let gone = || DbError::unreadable("the inbox's batching task has stopped".into());
        queue.send((row, answer)).await.map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

/// The batching task: takes what has queued (up to [`BATCH_MAX`]), runs it, answers
/// each caller, and again.
async fn run_batches<S: Statement>(
    statement: S,
    pool: Pool,
    mut queue: mpsc::Receiver<Waiting<S>>,
    deadline: Duration,
) {
    let mut batch: Vec<Waiting<S>> = Vec::with_capacity(BATCH_MAX);
    let mut rows: Vec<S::Row> = Vec::with_capacity(BATCH_MAX);
    let mut answers = Vec::with_capacity(BATCH_MAX);
    while queue.recv_many(&mut batch, BATCH_MAX).await > 0 {
        batch.sort_by(|a, b| S::key(&a.0).cmp(S::key(&b.0)));
        for (row, answer) in batch.drain(..) {
            rows.push(row);
            answers.push(answer);
        }
        let ran = tokio::time::timeout(deadline, statement.many(&pool, &rows))
            .await
            .unwrap_or_else(|_| Err(DbError::no_answer(deadline)));
        match ran {
            Ok(ran) => {
                for (answer, ran) in answers.drain(..).zip(ran) {
                    let _ = answer.send(Ok(ran));
                }
            }
            Err(error) if error.is_outage() || rows.len() == 1 => {
                for answer in answers.drain(..) {
                    let _ = answer.send(Err(error.clone()));
                }
            }
            // Refused for what some row carried: each row alone.
            Err(_) => {
                for (row, answer) in rows.iter().zip(answers.drain(..)) {
                    let one = tokio::time::timeout(deadline, statement.one(&pool, row))
                        .await
                        .unwrap_or_else(|_| Err(DbError::no_answer(deadline)));
                    let _ = answer.send(one);
                }
            }
        }
        rows.clear();
    }
}
