//! One-click unsubscribe at send time (issue 50): a job on a lane with
//! `unsubscribe = true`, or naming `"unsubscribe"` itself, gets the
//! `List-Unsubscribe` and `List-Unsubscribe-Post` headers for its one recipient
//! (`mail::unsubscribe`), and its suppression check covers the scope its link
//! leaves. A job with several recipients is refused rather than split: one key is
//! one email with one Message-ID, and a link in an email to three people would let
//! any of them unsubscribe the others.

use super::Worker;
use crate::contract::{EmailJob, Unsubscribe};
use crate::mail::unsubscribe::LIST_UNSUBSCRIBE;
use crate::topology::LaneId;
use crate::work::now_ms;

impl Worker {
    /// Adds the one-click headers to `job` if it or its lane asks for them, and
    /// records the scope in `job.unsubscribe` for the suppression check. A producer's
    /// own `List-Unsubscribe` is left alone (nothing is added). The error is the
    /// reason the job is refused for.
    pub(super) fn add_unsubscribe(&self, job: &mut EmailJob, lane: LaneId) -> Result<(), String> {
        let lane_asks = self.lane_settings(lane).is_some_and(|l| l.unsubscribe);
        let scope = match &job.unsubscribe {
            Some(Unsubscribe { scope: Some(scope) }) => scope.clone(),
            Some(Unsubscribe { scope: None }) => job_type(job)?,
            None if lane_asks => job_type(job)?,
            None => return Ok(()),
        };
        job.unsubscribe = Some(Unsubscribe {
            scope: Some(scope.clone()),
        });
        if job
            .headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(LIST_UNSUBSCRIBE))
        {
            return Ok(());
        }
        let recipients: Vec<_> = job.to.iter().chain(&job.cc).chain(&job.bcc).collect();
        let [recipient] = recipients.as_slice() else {
            return Err(format!(
                "a one-click unsubscribe link is for one recipient and this job has {}: publish one job per recipient",
                recipients.len()
            ));
        };
        let Some(links) = self.cx.mailer.unsubscribe_links() else {
            return Err(
                "the job asks for a one-click unsubscribe link but unsubscribe.url is not configured".into(),
            );
        };
        let now_s = now_ms() / 1000;
        let headers = links
            .headers(&recipient.email, &scope, job.key.as_str(), now_s)
            .ok_or("the recipient's address or the unsubscribe scope is over 255 bytes")?;
        job.headers.extend(headers);
        Ok(())
    }
}

/// The job's type, the default scope.
fn job_type(job: &EmailJob) -> Result<String, String> {
    job.kind.clone().ok_or_else(|| {
        "a one-click unsubscribe link needs a scope: give the job a \"type\" or \"unsubscribe.scope\"".into()
    })
}
