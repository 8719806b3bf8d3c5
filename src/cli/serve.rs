//! `postie serve`: consume until SIGTERM or Ctrl-C, then drain.

use tokio_util::sync::CancellationToken;

use crate::config::Settings;

/// Serves until a stop signal.
pub(super) async fn run(settings: Settings) -> anyhow::Result<()> {
    crate::consume::serve(settings, shutdown_signal()).await
}

/// A token cancelled on SIGTERM or Ctrl-C.
fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing the SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("stop requested; draining");
        cancel.cancel();
    });
    token
}
