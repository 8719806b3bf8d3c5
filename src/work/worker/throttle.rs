//! Job-type throttles (`throttle.<type>`), applied under the claim: at most `limit`
//! emails of a type per recipient per `window`; over it, the job is dropped or
//! deferred as the type's policy says.

use super::{Outcome, Stop, Worker};
use crate::config::ThrottlePolicy;
use crate::contract::EmailJob;
use crate::inbox::{Completion, Throttle};

impl Worker {
    /// Applies the job type's throttle, if any, under the claim: `None` to go on.
    pub(super) async fn throttle(
        &self,
        job: &EmailJob,
        fence: i64,
        due_ms: i64,
    ) -> Result<Option<Outcome>, Stop> {
        let Some(rule) = job
            .kind
            .as_ref()
            .and_then(|kind| self.cx.settings.throttle.get(kind))
        else {
            return Ok(None);
        };
        let kind = job.kind.as_deref().unwrap_or_default();
        let recipient = job.throttle_recipient();
        let verdict = self
            .db("throttle", || {
                self.cx
                    .inbox
                    .throttle(kind, &recipient, rule.limit, rule.window)
            })
            .await?;
        let Throttle::Limited { next_ms } = verdict else {
            return Ok(None);
        };
        let key = job.key.clone();
        Ok(Some(match rule.policy {
            ThrottlePolicy::Drop => {
                self.db("record throttled", || {
                    self.cx
                        .inbox
                        .complete(key.as_str(), fence, Some(kind), Completion::Throttled)
                })
                .await?;
                Outcome::Throttled {
                    key,
                    until_ms: None,
                }
            }
            ThrottlePolicy::Defer => {
                self.db("defer", || {
                    let why = "throttled (defer policy)";
                    self.cx.inbox.complete(
                        key.as_str(),
                        fence,
                        Some(kind),
                        Completion::Unclaimed { why },
                    )
                })
                .await?;
                Outcome::Throttled {
                    key,
                    until_ms: Some(next_ms.max(due_ms)),
                }
            }
        }))
    }
}
