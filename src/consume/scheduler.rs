//! Ladder mode's pending records, batched: each relay task asks to record its job as
//! scheduled and waits; one task writes whatever has gathered in one statement and
//! one commit, then answers them all. While one batch is written the next gathers,
//! so at the relay's concurrency a commit carries tens of jobs instead of one.
//!
//! A relay task acks its intake delivery only after its record is committed and its
//! job republished (confirmed), so a relay killed mid-batch leaves every unanswered
//! job unacked in `<p>.intake`.

use tokio::sync::{mpsc, oneshot};

use crate::contract::IdempotencyKey;
use crate::inbox::Scheduled;
use crate::work::{Interrupted, Worker};

/// The most jobs written in one statement.
const BATCH_MAX: usize = 512;

/// One job to record, and where to say it is done.
struct Request {
    job: Scheduled,
    done: oneshot::Sender<Result<(), Interrupted>>,
}

/// The handle relay tasks use; cheap to clone. The writer ends when every handle is
/// dropped.
#[derive(Clone)]
pub(super) struct Scheduler {
    requests: mpsc::Sender<Request>,
}

impl Scheduler {
    /// Starts the writer.
    pub(super) fn start(worker: Worker) -> Self {
        let (requests, mut incoming) = mpsc::channel::<Request>(BATCH_MAX * 2);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(BATCH_MAX);
            while incoming.recv_many(&mut batch, BATCH_MAX).await > 0 {
                let jobs: Vec<_> = batch.iter().map(|r| r.job.clone()).collect();
                let result = worker.schedule_many(&jobs).await;
                for request in batch.drain(..) {
                    let _ = request.done.send(result);
                }
            }
        });
        Self { requests }
    }

    /// Records `key` (at `revision`, due at `due_ms`, with its body when given) as
    /// scheduled; returns once it is committed, or `Interrupted` if the process is
    /// stopping.
    pub(super) async fn schedule(
        &self,
        key: &IdempotencyKey,
        revision: i32,
        due_ms: i64,
        body: Option<Vec<u8>>,
    ) -> Result<(), Interrupted> {
        let (done, answer) = oneshot::channel();
        let job = Scheduled {
            key: key.as_str().to_owned(),
            revision,
            due_ms,
            body,
        };
        let request = Request { job, done };
        self.requests.send(request).await.map_err(|_| Interrupted)?;
        answer.await.unwrap_or(Err(Interrupted))
    }
}
