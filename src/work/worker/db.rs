//! Database steps under the outage rule: PostgreSQL being down is never the job's
//! fault, so a step is retried with [`Backoff`] until it answers (consumption paused
//! meanwhile), and only a refusal for what the job carried stops it.

use std::time::Duration;

use super::{Interrupted, Stop, Worker};
use crate::inbox::{DbError, Scheduled};
use crate::ops::backoff::Backoff;

impl Worker {
    /// Ladder mode: records a batch of scheduled jobs in one commit, riding out a database outage. If PostgreSQL refuses the batch for what
    /// one job carried, each is tried alone, so only that one goes unlisted (it is
    /// still relayed).
    pub(crate) async fn schedule_many(&self, jobs: &[Scheduled]) -> Result<(), Interrupted> {
        match self
            .db("schedule", || self.cx.inbox.schedule_many(jobs))
            .await
        {
            Ok(()) => Ok(()),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::Refused(_)) => {
                for job in jobs {
                    match self
                        .db("schedule", || {
                            self.cx.inbox.schedule_many(std::slice::from_ref(job))
                        })
                        .await
                    {
                        Ok(()) | Err(Stop::Refused(_)) => {}
                        Err(Stop::Interrupted) => return Err(Interrupted),
                    }
                }
                Ok(())
            }
        }
    }

    /// Runs one database step until PostgreSQL answers (an outage is waited out with
    /// [`Backoff`]); a refusal for what the job carried stops it.
    pub(super) async fn db<T, F, Fut>(&self, what: &str, step: F) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        self.db_until(what, step, DbError::is_outage).await
    }

    /// Like [`Worker::db`], but every error is waited out, a refusal too: for a
    /// record that must be written (a `sent` after the relay's 250) and is never the
    /// job's fault, since it carries only what the claim already took.
    pub(super) async fn db_durable<T, F, Fut>(&self, what: &str, step: F) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        self.db_until(what, step, |_| true).await
    }

    /// Runs `step` until it succeeds, waiting out every error that `wait_out` says
    /// is not the job's; pauses consumption (readiness false) meanwhile.
    async fn db_until<T, F, Fut>(
        &self,
        what: &str,
        mut step: F,
        wait_out: fn(&DbError) -> bool,
    ) -> Result<T, Stop>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DbError>>,
    {
        let mut backoff = Backoff::new(
            Duration::from_millis(100),
            self.cx.settings.worker.outage_backoff_max,
        );
        let deadline = self.cx.settings.database.statement_timeout;
        loop {
            let answer = tokio::time::timeout(deadline, step())
                .await
                .unwrap_or_else(|_| Err(DbError::no_answer(deadline)));
            match answer {
                Ok(value) => {
                    self.cx.health.set_database_up();
                    return Ok(value);
                }
                Err(error) if !wait_out(&error) => {
                    tracing::error!(%error, step = what, "the database refused a statement for this job");
                    return Err(Stop::Refused(error));
                }
                Err(error) => {
                    tracing::debug!(%error, step = what, "database step failed");
                    self.cx
                        .health
                        .set_database_down(&error.cause(), &error.to_string());
                    if !backoff.wait(&self.cx.hard_stop).await {
                        return Err(Stop::Interrupted);
                    }
                }
            }
        }
    }
}
