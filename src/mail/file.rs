//! The `.eml` file transport (`smtp.url = file:///dir`): for demos and local runs.

use std::path::PathBuf;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lettre::{AsyncFileTransport, AsyncTransport, Tokio1Executor};

use super::{Clearance, Email, SendError, Transport};

/// Writes each email to `<dir>/<uuid>.eml`.
pub(super) struct EmlFiles(AsyncFileTransport<Tokio1Executor>);

impl EmlFiles {
    /// Creates `dir` if needed.
    pub(super) fn new(dir: &str) -> anyhow::Result<Self> {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).map_err(|e| {
            anyhow::anyhow!("smtp.url: cannot create directory {}: {e}", dir.display())
        })?;
        Ok(Self(AsyncFileTransport::<Tokio1Executor>::new(dir)))
    }
}

impl Transport for EmlFiles {
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<(), SendError>> {
        async move {
            clearance.check()?;
            self.0
                .send_raw(email.envelope(), email.formatted())
                .await
                .map(|_| ())
                .map_err(|e| SendError::Transient(format!("writing .eml file: {e}")))
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        async { true }.boxed()
    }
}
