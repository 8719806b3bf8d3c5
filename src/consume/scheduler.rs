//! Ladder mode's pending records, batched: each relay task asks to record its job as
//! scheduled and waits; one task writes whatever has gathered in one statement and
//! one commit, then answers them all. While one batch is written the next gathers,
//! so at the relay's concurrency a commit carries tens of jobs instead of one.
//!
//! A relay task acks its intake delivery only after its record is committed and its
//! job republished (confirmed), so a relay killed mid-batch leaves every unanswered
//! job unacked in `<p>.intake`.
//!
//! A body is moved in, not copied, and handed back once its record is committed: the
//! relay publishes it next.

use tokio::sync::{mpsc, oneshot};

use crate::contract::IdempotencyKey;
use crate::inbox::Scheduled;
use crate::work::{Interrupted, Worker};

/// The most jobs written in one statement.
const BATCH_MAX: usize = 512;

/// What a relay task gets back: its body once the record is committed.
type Answer = Result<Option<Vec<u8>>, Interrupted>;

/// One job to record, and where to say it is done.
struct Request {
    job: Scheduled,
    done: oneshot::Sender<Answer>,
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
                let (jobs, answers): (Vec<_>, Vec<_>) =
                    batch.drain(..).map(|r| (r.job, r.done)).unzip();
                let result = worker.schedule_many(&jobs).await;
                for (job, done) in jobs.into_iter().zip(answers) {
                    let _ = done.send(result.map(|()| job.body));
                }
            }
        });
        Self { requests }
    }

    /// Records `key` (at `revision`, due at `due_ms`, with its body when given) as
    /// scheduled (in `lane`, `None` for the default); returns the body once the record is committed, or `Interrupted` if
    /// the process is stopping.
    pub(super) async fn schedule(
        &self,
        key: &IdempotencyKey,
        revision: i32,
        due_ms: i64,
        lane: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Answer {
        let (done, answer) = oneshot::channel();
        let job = Scheduled {
            key: key.as_str().to_owned(),
            revision,
            due_ms,
            lane: lane.map(str::to_owned),
            body,
        };
        let request = Request { job, done };
        self.requests.send(request).await.map_err(|_| Interrupted)?;
        answer.await.unwrap_or(Err(Interrupted))
    }
}
