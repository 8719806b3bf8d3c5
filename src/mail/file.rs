//! The `.eml` file transport (`transport.url = file:///dir`): for demos and local runs.

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
            anyhow::anyhow!(
                "transport.url: cannot create directory {}: {e}",
                dir.display()
            )
        })?;
        Ok(Self(AsyncFileTransport::<Tokio1Executor>::new(dir)))
    }
}

impl Transport for EmlFiles {
    fn send<'a>(
        &'a self,
        email: &'a Email,
        clearance: &'a Clearance,
    ) -> BoxFuture<'a, Result<Option<String>, SendError>> {
        async move {
            clearance.check()?;
            self.0
                .send_raw(email.envelope(), email.formatted())
                .await
                .map(|_| None)
                .map_err(|e| SendError::Transient(format!("writing .eml file: {e}")))
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        async { true }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Clearance, Mailer};
    use crate::config::Settings;
    use crate::contract::{EmailJob, ParseRules};

    #[tokio::test]
    async fn pc_the_eml_file_holds_the_email_formatted_once() {
        let dir = std::env::temp_dir().join(format!("postie-pc-eml-{}", uuid::Uuid::new_v4()));
        let mut settings = Settings::default();
        settings.transport.url = Some(format!("file://{}", dir.display()).into());
        let mailer = Mailer::new(&settings.transport.one_transport().unwrap(), &settings).unwrap();
        let rules = ParseRules {
            max_body_bytes: 1 << 16,
            default_from: Some("Shop <noreply@shop.example>"),
            key_namespace: crate::config::KeyNamespace::Off,
            user_id: None,
        };
        let body = br#"{"key": "k-1", "to": ["a@example.com"], "subject": "s", "text": "hi"}"#;
        let job = EmailJob::parse(body, &rules).unwrap();
        let email = mailer.build(&job).unwrap();
        let slot = mailer.slot().await;
        mailer.send(&slot, &email, &Clearance::new()).await.unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "eml"))
            .collect();
        assert_eq!(files.len(), 1);
        assert_eq!(std::fs::read(&files[0]).unwrap(), email.formatted());
        let text = String::from_utf8_lossy(email.formatted()).into_owned();
        assert!(text.contains(&job.key.message_id(&settings.transport.message_id_domain)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
