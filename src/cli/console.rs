//! `postie console [--listen ADDR]`: the operator console until SIGTERM or Ctrl-C;
//! `postie console --new-token`: a token for it.

use std::net::SocketAddr;

use crate::config::Settings;
use crate::console::{self, Credentials};

/// Where the console listens when neither `--listen` nor `console.listen` says.
const DEFAULT_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 9092);

/// Arguments of `postie console`.
#[derive(clap::Args)]
pub struct ConsoleArgs {
    /// Listen here (default: console.listen, else 127.0.0.1:9092). Off loopback,
    /// POSTIE_CONSOLE_TOKEN or POSTIE_CONSOLE_READ_TOKEN must be set.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Print a new random token (256 bits, base64url) for POSTIE_CONSOLE_TOKEN or
    /// POSTIE_CONSOLE_READ_TOKEN, and exit.
    #[arg(long, conflicts_with = "listen")]
    new_token: bool,
}

/// Serves the console until a stop signal.
pub(super) async fn run(settings: Settings, args: &ConsoleArgs) -> anyhow::Result<()> {
    if args.new_token {
        out!("{}", console::new_token()?);
        return Ok(());
    }
    let listen = args
        .listen
        .or(settings.console.listen)
        .unwrap_or_else(|| SocketAddr::from(DEFAULT_LISTEN));
    let stop = super::serve::shutdown_signal();
    let bound = console::start(settings, listen, Credentials::from_env(), stop.clone()).await?;
    out!("console: http://{bound}/");
    stop.cancelled().await;
    Ok(())
}
