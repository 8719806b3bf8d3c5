//! `postie-provider-server`: an in-memory HTTP server speaking the send APIs of four
//! email providers, for postie's integration tests:
//!
//! | provider | endpoint | credentials |
//! |---|---|---|
//! | Amazon SES v2 `SendEmail` | `POST /v2/email/outbound-emails`, JSON with `Content.Raw.Data` (base64 MIME) | SigV4, recomputed here with [`SES_ACCESS_KEY`]/[`SES_SECRET`] |
//! | SendGrid v3 | `POST /v3/mail/send`, JSON (personalizations, from, content, headers) | `Authorization: Bearer` [`SENDGRID_KEY`] |
//! | Postmark | `POST /email`, JSON (From, To, TextBody/HtmlBody, Headers) | `X-Postmark-Server-Token:` [`POSTMARK_TOKEN`] |
//! | Mailgun | `POST /v3/<domain>/messages.mime`, multipart form with `to` and `message` | HTTP Basic `api:`[`MAILGUN_KEY`] |
//!
//! It records every accepted request (the email's Message-ID, the id it answered
//! with, the recipients, the raw MIME or JSON) and answers in each provider's own
//! shapes (see `reply.rs`). Faults are injected through the control API:
//! `PUT /faults` with rules like
//! `[{"provider": "ses", "to_contains": "bad", "action": {"status": 503}, "times": 2}]`,
//! where `action` is `{"throttle": true}` (the provider's 429 and headers),
//! `{"status": N}` (a server error), `{"hang": true}` (never answer, after reading the
//! request), `{"delay_ms": N}` (a slow reply), `{"suspended": true}` (the provider's
//! account-suspended rejection) or `{"reject": true}` (its invalid-recipient
//! rejection). `PUT /quota` with `{"per_second": R}` answers the provider's 429 to
//! requests beyond R accepted in any second (`{"per_second": null}`: off).
//! `GET /messages[?raw=true]`, `GET /stats` read what happened.
//!
//! On startup it prints one line, `api=127.0.0.1:PORT control=127.0.0.1:PORT`, and
//! serves until killed.

#![forbid(unsafe_code)]

mod api;
mod control;
mod mime;
mod reply;
mod sigv4;
mod state;

use std::future::IntoFuture as _;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;

/// The SES access key id the server accepts.
pub const SES_ACCESS_KEY: &str = "AKIAPOSTIETEST000001";
/// The SES secret access key the server signs with.
pub const SES_SECRET: &str = "postie-test-ses-secret-key/0000000000000";
/// The SendGrid API key the server accepts.
pub const SENDGRID_KEY: &str = "SG.postie-test.sendgrid-key";
/// The Postmark server token the server accepts.
pub const POSTMARK_TOKEN: &str = "postie-test-postmark-token";
/// The Mailgun API key the server accepts.
pub const MAILGUN_KEY: &str = "postie-test-mailgun-key";

#[derive(Debug, Parser)]
#[command(name = "postie-provider-server")]
struct Args {
    /// Address the provider APIs listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    api: SocketAddr,
    /// Address the control API listens on.
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let state = Arc::new(state::AppState::default());
    let api = TcpListener::bind(args.api)
        .await
        .context("binding the API listener")?;
    let control = TcpListener::bind(args.control)
        .await
        .context("binding the control listener")?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "api={} control={}",
            api.local_addr()?,
            control.local_addr()?
        );
        let _ = out.flush();
    }
    let api_task = tokio::spawn(axum::serve(api, api::router(state.clone())).into_future());
    let control_task = tokio::spawn(axum::serve(control, control::router(state)).into_future());
    tokio::select! {
        res = api_task => res.context("API task")?.context("API server")?,
        res = control_task => res.context("control task")?.context("control server")?,
    }
    Ok(())
}
