//! `postie-provider-server`: an in-memory HTTP server speaking the send APIs of four
//! email providers, and the account endpoint of each that postie's circuit-breaker
//! probe asks, for postie's integration tests:
//!
//! | provider | send endpoint | account endpoint (probe) | credentials |
//! |---|---|---|---|
//! | Amazon SES v2 | `SendEmail`: `POST /v2/email/outbound-emails`, JSON with `Content.Raw.Data` (base64 MIME) | `GetAccount`: `GET /v2/email/account` → `{"SendingEnabled": true, "ProductionAccessEnabled": true, "SendQuota": {"Max24HourSend": 50000.0, "MaxSendRate": 14.0, "SentLast24Hours": n}}` (n: SES sends accepted in the last 24 h) | SigV4, recomputed here with [`SES_ACCESS_KEY`]/[`SES_SECRET`] (a GET's payload hash is the empty string's) |
//! | SendGrid v3 | `POST /v3/mail/send`, JSON (personalizations, from, content, headers) | `GET /v3/scopes` → `{"scopes": ["mail.send"]}` | `Authorization: Bearer` [`SENDGRID_KEY`] |
//! | Postmark | `POST /email`, JSON (From, To, TextBody/HtmlBody, Headers) | `GET /server` → `{"ID": 1, "Name": "postie-test"}` | `X-Postmark-Server-Token:` [`POSTMARK_TOKEN`] |
//! | Mailgun | `POST /v3/<domain>/messages.mime`, multipart form with `to` and `message` | `GET /v3/domains/<domain>` → `{"domain": {"name": "<domain>", "state": "active"}}` | HTTP Basic `api:`[`MAILGUN_KEY`] |
//!
//! Wrong credentials get the provider's refusal (SES 403, the others 401) from either
//! endpoint.
//!
//! It records every accepted request (the email's Message-ID, the id it answered
//! with, the recipients, the raw MIME or JSON) and answers in each provider's own
//! shapes (see `reply.rs`). Faults are injected through the control API:
//! `PUT /faults` with rules like
//! `[{"provider": "ses", "to_contains": "bad", "action": {"status": 503}, "times": 2}]`,
//! where `action` is `{"throttle": true}` (the provider's 429 and headers),
//! `{"status": N}` (a server error), `{"hang": true}` (never answer, after reading the
//! request), `{"delay_ms": N}` (a slow reply), `{"suspended": true}` (the provider's
//! account-suspended rejection), `{"reject": true}` (its invalid-recipient
//! rejection), `{"slow_read_ms": N}` (the request's body left unread N ms before
//! it is read, so a large one stalls in the socket; by `provider` only) or
//! `{"endless_reply": true}` (a 200 whose body never ends; `GET /stats`
//! counts the requests so answered in `endless` and the bytes written in
//! `reply_bytes`). A rule applies to sends, or with `"probe": true` to the account
//! endpoints instead (which have no recipient: such a rule has no `to_contains`).
//! `PUT /quota` with `{"per_second": R}` answers the provider's 429 to
//! requests beyond R accepted in any second (`{"per_second": null}`: off).
//! `GET /messages[?raw=true]`, `GET /stats` read what happened (`requests` and the
//! other counters are about sends; account requests count as `probes` alone).
//!
//! Down mode, a provider that refuses connections (`down.rs`): `PUT /down` with
//! `{"seconds": N}` (fractions allowed) closes the API listener at once (a connect is
//! refused: `ECONNREFUSED`) and every open API connection, hung ones included; after
//! N seconds the API listens again on the same address. A new `PUT /down` replaces the
//! window; `{"seconds": 0}` or `DELETE /down` brings the API back at once. Each answers
//! once it holds, with `{"down": bool}`, as `GET /down` does. Messages, counters, fault
//! rules and the quota are kept. The control API is never down.
//!
//! Files for postie's `url` attachments (`files.rs`), on the API listener:
//! `GET /files/{seed}/{size}[?corrupt=true]` (deterministic bytes) and
//! `GET /redirect?to=URL`.
//!
//! `--keep-bytes N` keeps only the first N bytes of each request's raw MIME or JSON.
//!
//! On startup it prints one line, `api=127.0.0.1:PORT control=127.0.0.1:PORT`, and
//! serves until killed.

#![forbid(unsafe_code)]

mod api;
mod control;
mod down;
mod files;
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
    /// Keep only the first N bytes of each request's raw MIME or JSON (for runs of
    /// many large emails, which would otherwise all be held in memory).
    #[arg(long, value_name = "N")]
    keep_bytes: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut state = state::AppState::default();
    state.keep_bytes = args.keep_bytes;
    let state = Arc::new(state);
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
    let (switch, api) = down::server(api, api::router(state.clone()))?;
    let api_task = tokio::spawn(api.run());
    let control_task =
        tokio::spawn(axum::serve(control, control::router(state, switch)).into_future());
    tokio::select! {
        res = api_task => res.context("API task")?.context("API server")?,
        res = control_task => res.context("control task")?.context("control server")?,
    }
    Ok(())
}
