//! The suppression list at send time (issue 30): a claimed job's recipients checked
//! against it before the send, and a relay's refusal of a recipient read for hard
//! bounces (`mail::bounce`) that put the address on it. Suppressed recipients are
//! left out of the send; a job left with none is recorded `suppressed`.

use super::{Stop, Worker};
use crate::contract::{Address, EmailJob};
use crate::inbox::{normalise, Completion, Suppress, SuppressionReason};
use crate::mail::bounce::{self, Bounce};
use crate::mail::{Clearance, RouteId};
use crate::ops::metrics::Suppressed;
use crate::work::Outcome;

/// What the check found.
pub(super) enum Checked {
    /// No recipient is suppressed (or the check is off, or the job overrides it).
    Clear,
    /// Some are: the job without them.
    Some(Box<EmailJob>),
    /// All are: the job is recorded `suppressed`.
    All(Outcome),
}

impl From<SuppressionReason> for Suppressed {
    fn from(reason: SuppressionReason) -> Self {
        match reason {
            SuppressionReason::HardBounce => Self::HardBounce,
            SuppressionReason::Complaint => Self::Complaint,
            SuppressionReason::Unsubscribe => Self::Unsubscribe,
            SuppressionReason::Manual => Self::Manual,
        }
    }
}

impl Worker {
    /// Checks `job`'s recipients (to, cc, bcc) against the list, for its type, under
    /// the claim `fence`: one indexed lookup.
    pub(super) async fn check_suppression(
        &self,
        job: &EmailJob,
        fence: i64,
    ) -> Result<Checked, Stop> {
        if !self.cx.settings.suppression.enabled {
            return Ok(Checked::Clear);
        }
        let recipients = || job.to.iter().chain(&job.cc).chain(&job.bcc);
        let addresses: Vec<String> = recipients().map(|a| normalise(&a.email)).collect();
        // Every email, the job's type, and the scope its unsubscribe link leaves.
        let mut scopes = vec!["*", job.kind.as_deref().unwrap_or("")];
        if let Some(scope) = job.unsubscribe.as_ref().and_then(|u| u.scope.as_deref()) {
            scopes.push(scope);
        }
        let found = self
            .db("suppression check", || {
                self.cx.inbox.suppressed(&addresses, &scopes)
            })
            .await?;
        if found.is_empty() {
            return Ok(Checked::Clear);
        }
        let why = found
            .iter()
            .map(|(address, reason)| format!("{address}: {}", reason.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        if job.ignore_suppression {
            tracing::warn!(key = %job.key, suppressed = %why, "ignore_suppression: sending to suppressed recipients");
            return Ok(Checked::Clear);
        }
        let metrics = self.cx.metrics();
        let reason_of = |a: &Address| {
            let address = normalise(&a.email);
            found.iter().find(|(s, _)| *s == address).map(|(_, r)| *r)
        };
        for reason in recipients().filter_map(reason_of) {
            metrics.recipients_suppressed.inc(reason.into());
        }
        let mut kept = job.clone();
        for list in [&mut kept.to, &mut kept.cc, &mut kept.bcc] {
            list.retain(|a| reason_of(a).is_none());
        }
        if !(kept.to.is_empty() && kept.cc.is_empty() && kept.bcc.is_empty()) {
            tracing::info!(key = %job.key, suppressed = %why, "suppressed recipients left out");
            return Ok(Checked::Some(Box::new(kept)));
        }
        self.db("record suppressed", || {
            self.cx.inbox.complete(
                job.key.as_str(),
                fence,
                job.kind.as_deref(),
                Completion::Suppressed { why: &why },
            )
        })
        .await?;
        Ok(Checked::All(Outcome::Suppressed {
            key: job.key.clone(),
            reason: found[0].1.into(),
            why,
        }))
    }

    /// After a permanent refusal: the recipient the relay refused at RCPT TO, if the
    /// reply is a hard bounce (or the strike that reaches the threshold), goes on the
    /// list. Either is recorded as a bounce of `job` for the rates. True if that
    /// recipient is suppressed now.
    pub(super) async fn note_bounce(
        &self,
        route: RouteId,
        clearance: &Clearance,
        job: &EmailJob,
    ) -> Result<bool, Stop> {
        let settings = &self.cx.settings.suppression;
        let Some((address, reply)) = clearance.refused().filter(|_| settings.enabled) else {
            return Ok(false);
        };
        let source = &self.cx.mailer.routes().get(route).name;
        let bounced = bounce::classify(&reply, &settings.hard_bounce_codes);
        if bounced == Bounce::Not {
            return Ok(false);
        }
        let kind = job.kind.as_deref().unwrap_or("");
        let normalised = normalise(&address);
        self.db("record bounce", || {
            self.cx
                .inbox
                .record_send_bounce(job.key.as_str(), kind, &normalised, source, &reply)
        })
        .await?;
        let (suppressed, added) = match bounced {
            Bounce::Not => return Ok(false),
            Bounce::Hard(code) => {
                let added = self
                    .db("suppress", || {
                        self.cx.inbox.suppress(Suppress {
                            address: &address,
                            scope: "*",
                            reason: SuppressionReason::HardBounce,
                            source,
                            evidence: Some(&reply),
                            lasts: None,
                        })
                    })
                    .await?;
                if added {
                    tracing::warn!(%address, %code, "hard bounce: the address is suppressed");
                }
                // On the list either way (another instance may have added it).
                (true, added)
            }
            Bounce::Strike => {
                let (window, threshold) = (settings.strike_window, settings.strikes);
                let added = self
                    .db("strike", || {
                        self.cx
                            .inbox
                            .strike(&address, window, threshold, source, &reply)
                    })
                    .await?;
                if added {
                    tracing::warn!(%address, strikes = threshold, "repeated permanent refusals: the address is suppressed");
                }
                (added, added)
            }
        };
        if added {
            self.cx
                .metrics()
                .suppressions_added
                .inc(Suppressed::HardBounce);
        }
        Ok(suppressed)
    }
}
