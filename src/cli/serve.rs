//! `postie serve`: consume until SIGTERM or Ctrl-C, then drain.
//!
//! Under `worker.key_namespace = "user_id"` it first checks that postie's RabbitMQ
//! user may re-publish producers' `user_id` (`broker::may_impersonate`). With
//! `console.listen` set it starts the console beside `consume::serve`, with settings
//! loaded again from the same file and environment.

use tokio_util::sync::CancellationToken;

use std::path::Path;

use crate::broker;
use crate::config::{KeyNamespace, Settings};
use crate::console::{self, Credentials};

/// Serves until a stop signal, and the console too when `console.listen` is set.
pub(super) async fn run(settings: Settings, config: Option<&Path>) -> anyhow::Result<()> {
    if settings.worker.key_namespace == KeyNamespace::UserId {
        check_impersonation(&settings).await?;
    }
    let stop = shutdown_signal();
    if let Some(listen) = settings.console.listen {
        // The console keeps settings of its own: the same file and environment.
        let own = Settings::load(config)?;
        console::start(own, listen, Credentials::from_env(), stop.clone()).await?;
    }
    crate::consume::serve(settings, stop).await
}

/// Under `worker.key_namespace = "user_id"` postie re-publishes every job (ladder,
/// retries, dead letters) with its producer's `user_id`, which RabbitMQ refuses
/// unless postie's own user has the `impersonator` tag: without it, refuse to start.
/// A broker that cannot be reached now is not a reason to stop (serve waits for it):
/// the check is then skipped, with a warning.
async fn check_impersonation(settings: &Settings) -> anyhow::Result<()> {
    let conn = match broker::connect(
        &settings.amqp.addresses()?,
        "postie-impersonation-check",
        settings.amqp.connect_timeout,
    )
    .await
    .map(|c| c.connection)
    {
        Ok(conn) => conn,
        Err(error) => {
            tracing::warn!(%error, "cannot check that postie's RabbitMQ user may re-publish producers' user_id; going on");
            return Ok(());
        }
    };
    let allowed = broker::may_impersonate(&conn).await;
    let _ = conn.close(200, "done".into()).await;
    match allowed {
        Ok(true) => Ok(()),
        Ok(false) => anyhow::bail!(
            "worker.key_namespace = \"user_id\" needs postie's RabbitMQ user to have the \
             impersonator tag: postie re-publishes each job (ladder, retries, dead letters) \
             with its producer's user_id, which RabbitMQ refuses otherwise; run \
             rabbitmqctl set_user_tags <postie's user> impersonator, or set \
             worker.key_namespace = \"off\""
        ),
        Err(error) => {
            tracing::warn!(%error, "cannot check that postie's RabbitMQ user may re-publish producers' user_id; going on");
            Ok(())
        }
    }
}

/// A token cancelled on SIGTERM or Ctrl-C.
pub(super) fn shutdown_signal() -> CancellationToken {
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
