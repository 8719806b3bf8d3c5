//! Asynchronous feedback (issue 30): bounces and complaints reported after the email
//! was accepted, recorded by [`Inbox::record_feedback`] (the job's row, the
//! suppression list). Two ways in:
//!
//! - the webhooks, `/feedback/<provider>` on `feedback.listen` (off by default; axum,
//!   served by `ops::http::serve`): SES
//!   through SNS (`sns.rs`), SendGrid, Postmark and Mailgun (`providers.rs`), each
//!   authenticated as its provider documents (`verify.rs`); every request's body
//!   bounded by `feedback.max_body_bytes` and the whole request by
//!   `feedback.request_timeout`. Unsigned: 401; badly signed, stale, from a topic
//!   not named, a signature token seen with another request (Mailgun) or not
//!   configured: 403; malformed: 400; the same notification again: 200 and nothing
//!   changes; a database that does not answer: 503 (the provider retries). Counted
//!   in `postie_feedback_notifications_total{provider,result}`.
//! - reports, `postie feedback ingest` (`report.rs`): an RFC 3464 DSN or an RFC 5965
//!   ARF report on stdin.
//!
//! - one-click unsubscribe (issue 50), `GET`/`POST /u/TOKEN` on the same listener
//!   when `unsubscribe.url` is set (`unsubscribe.rs`); the mailto form through
//!   `postie feedback unsubscribe`.
//!
//! Either way a notice suppresses an address only when it names an email postie sent
//! to that address (`Inbox::record_feedback`), unless `feedback.trust_unmatched`
//! names its source (issue 45).
//!
//! `fuzz.rs` (test only) feeds the property tests of every reader.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio_util::sync::CancellationToken;

use sha2::{Digest, Sha256};

use crate::config::Settings;
use crate::inbox::{Feedback, Inbox, Recorded, TokenSeen};
use crate::mail::unsubscribe::Links;
use crate::ops::metrics::{FeedbackLabel, FeedbackResult, FeedbackSource, SharedMetrics};

#[cfg(test)]
mod fuzz;
mod providers;
pub(crate) mod report;
mod sns;
pub(crate) mod unsubscribe;
mod verify;

/// Why a request was not read.
#[derive(Debug)]
pub(crate) enum Refused {
    /// No credentials at all (401).
    Unauthenticated(&'static str),
    /// Bad credentials or signature, a stale timestamp, a webhook not configured, a
    /// host not allowed (403).
    Forbidden(&'static str),
    /// Not a payload of the provider's (400).
    Malformed(String),
    /// A fetch it needed (SNS's certificate or subscription URL) failed (502).
    Upstream(String),
    /// What it needs cannot be had now: the database, or room for another signature
    /// token (503: the provider sends it again later).
    Unavailable(String),
}

/// The webhooks' shared state.
struct Hooks {
    settings: crate::config::FeedbackSettings,
    inbox: Inbox,
    metrics: SharedMetrics,
    sns: sns::Sns,
}

/// Binds `feedback.listen` and serves the webhooks until `stop`; the bound address.
pub(crate) async fn start(
    settings: &Settings,
    addr: SocketAddr,
    inbox: Inbox,
    metrics: SharedMetrics,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let cfg = settings.feedback.clone();
    let links = Links::new(&settings.unsubscribe, &settings.transport.message_id_domain);
    let unsubscribe = links.map(|links| {
        Arc::new(unsubscribe::Unsubscribe {
            links,
            inbox: inbox.clone(),
            metrics: metrics.clone(),
        })
    });
    let hooks = Arc::new(Hooks {
        sns: sns::Sns::new(&cfg.sns, cfg.request_timeout, cfg.max_body_bytes)?,
        settings: cfg.clone(),
        inbox,
        metrics,
    });
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        anyhow::anyhow!("cannot listen for feedback on {addr} (feedback.listen): {e}")
    })?;
    let bound = listener.local_addr()?;
    let timeout = cfg.request_timeout;
    let mut app = Router::new()
        .route("/feedback/{provider}", post(feedback))
        .with_state(hooks);
    let one_click = unsubscribe.is_some();
    if let Some(state) = unsubscribe {
        let links = Router::new()
            .route("/u/{token}", get(unsubscribe::page).post(unsubscribe::post))
            .with_state(state);
        app = app.merge(links);
    }
    let app =
        app.layer(DefaultBodyLimit::max(cfg.max_body_bytes))
            .layer(axum::middleware::from_fn(
                move |req: Request, next: Next| within(timeout, req, next),
            ));
    let limits = crate::ops::http::Limits::new(&settings.http, cfg.max_body_bytes);
    crate::ops::http::serve(listener, app, limits, stop, "feedback endpoint");
    tracing::info!(%bound, one_click, "feedback endpoint: /feedback/{{ses,sendgrid,postmark,mailgun}}, one-click unsubscribe /u/TOKEN if one_click");
    Ok(bound)
}

/// The whole request, its body read included, within `timeout` (503 past it).
async fn within(timeout: Duration, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "timed out\n").into_response(),
    }
}

/// `POST /feedback/<provider>`.
async fn feedback(
    State(hooks): State<Arc<Hooks>>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let source = match provider.as_str() {
        "ses" => FeedbackSource::Ses,
        "sendgrid" => FeedbackSource::Sendgrid,
        "postmark" => FeedbackSource::Postmark,
        "mailgun" => FeedbackSource::Mailgun,
        _ => return (StatusCode::NOT_FOUND, "no such provider\n").into_response(),
    };
    let now = chrono::Utc::now().timestamp();
    let cfg = &hooks.settings;
    let read = match source {
        FeedbackSource::Ses => match hooks.sns.read(&body).await {
            Ok(sns::Read::Notes(notes)) => Ok(notes),
            Ok(sns::Read::Subscribed) => return (StatusCode::OK, "subscribed\n").into_response(),
            Err(refused) => Err(refused),
        },
        FeedbackSource::Sendgrid => providers::sendgrid(&cfg.sendgrid, &headers, &body, now),
        FeedbackSource::Postmark => providers::postmark(&cfg.postmark, &headers, &body),
        FeedbackSource::Mailgun => match providers::mailgun(&cfg.mailgun, &body, now) {
            Ok(signed) => hooks.once(&signed, &body).await.map(|()| signed.notes),
            Err(refused) => Err(refused),
        },
    };
    match read {
        Ok(notes) => hooks.record(source, &notes).await,
        Err(refused) => hooks.refuse(source, refused),
    }
}

impl Hooks {
    fn count(&self, provider: FeedbackSource, result: FeedbackResult) {
        self.metrics
            .feedback_notifications
            .get_or_create(&FeedbackLabel { provider, result })
            .inc();
    }

    /// Counts and answers a refusal (its reason in the log and the reply; never a
    /// secret, never the body).
    fn refuse(&self, source: FeedbackSource, refused: Refused) -> Response {
        let (status, result, why) = match refused {
            Refused::Unauthenticated(why) => (
                StatusCode::UNAUTHORIZED,
                FeedbackResult::Refused,
                why.to_string(),
            ),
            Refused::Forbidden(why) => (
                StatusCode::FORBIDDEN,
                FeedbackResult::Refused,
                why.to_string(),
            ),
            Refused::Malformed(why) => (StatusCode::BAD_REQUEST, FeedbackResult::Malformed, why),
            Refused::Upstream(why) => (StatusCode::BAD_GATEWAY, FeedbackResult::Refused, why),
            Refused::Unavailable(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                FeedbackResult::Refused,
                why,
            ),
        };
        self.count(source, result);
        tracing::warn!(provider = source.as_str(), status = status.as_u16(), reason = %why, "feedback refused");
        (status, format!("{why}\n")).into_response()
    }

    /// Remembers a signed token (Mailgun signs no more than a timestamp and a token)
    /// with the digest of its request, in PostgreSQL for every instance: the same
    /// token with another request is a replay (403); the same request again, the
    /// provider retrying (let through: its notes are duplicates).
    async fn once(&self, signed: &providers::Signed, body: &[u8]) -> Result<(), Refused> {
        let digest = hex::encode(Sha256::digest(body));
        let cfg = &self.settings.mailgun;
        let seen = self
            .inbox
            .remember_token(
                "mailgun",
                &signed.token,
                &digest,
                signed.remember_until,
                cfg.max_tokens,
            )
            .await;
        match seen {
            Ok(TokenSeen::New | TokenSeen::Same) => Ok(()),
            Ok(TokenSeen::Other) => Err(Refused::Forbidden(
                "a replay: this signature's token came with another request",
            )),
            Ok(TokenSeen::Full) => Err(Refused::Unavailable(
                "feedback.mailgun.max_tokens signature tokens are remembered: try later".into(),
            )),
            Err(error) => Err(Refused::Unavailable(format!(
                "database unavailable: {}",
                error.cause()
            ))),
        }
    }

    /// Records each notification; 503 if the database does not take one (the
    /// provider sends it again, and what was recorded is then a duplicate).
    async fn record(&self, source: FeedbackSource, notes: &[Feedback]) -> Response {
        let trusted = self.settings.trusts_unmatched(source.as_str());
        for note in notes {
            let result = match self.inbox.record_feedback(note, trusted).await {
                Ok(Recorded::Matched { .. }) => FeedbackResult::Recorded,
                Ok(Recorded::Duplicate) => FeedbackResult::Duplicate,
                Ok(Recorded::Unmatched { why, suppressed }) => {
                    tracing::info!(
                        provider = source.as_str(),
                        why = why.as_str(),
                        suppressed,
                        "feedback names no email sent to its address"
                    );
                    FeedbackResult::Unmatched
                }
                Ok(Recorded::Invalid(why)) => {
                    tracing::warn!(provider = source.as_str(), reason = %why, "feedback about an address no job could have: not recorded");
                    FeedbackResult::Malformed
                }
                Err(error) => {
                    tracing::warn!(provider = source.as_str(), error = %error.cause(), "feedback not recorded: database");
                    return (StatusCode::SERVICE_UNAVAILABLE, "database unavailable\n")
                        .into_response();
                }
            };
            self.count(source, result);
            tracing::info!(
                provider = source.as_str(),
                kind = note.kind.as_str(),
                result = result.as_str(),
                "feedback"
            );
        }
        (StatusCode::OK, "ok\n").into_response()
    }
}
