//! The `.eml` file transport (`transport.url = file:///dir`): for demos and local runs.
//! An email with attachments is written chunk by chunk, as it would be streamed to
//! a relay, to a `.part` file renamed to its `.eml` name once complete.

use std::path::PathBuf;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lettre::{AsyncFileTransport, AsyncTransport, Tokio1Executor};

use super::{Clearance, Email, SendError, Transport};

/// Writes each email to `<dir>/<uuid>.eml`.
pub(super) struct EmlFiles(AsyncFileTransport<Tokio1Executor>, PathBuf);

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
        Ok(Self(AsyncFileTransport::<Tokio1Executor>::new(&dir), dir))
    }
}

impl EmlFiles {
    /// Writes an email with attachments chunk by chunk; only a complete one gets its
    /// `.eml` name. A spool that fails to read is [`SendError::Unavailable`] (the
    /// instance's disk, not the job's fault), as it is for the other transports.
    async fn stream(&self, email: &Email) -> Result<(), SendError> {
        use tokio::io::AsyncWriteExt as _;
        let unwritten = |e: std::io::Error| SendError::Transient(format!("writing .eml file: {e}"));
        let name = uuid::Uuid::new_v4();
        let part = self.1.join(format!("{name}.part"));
        let mut file = tokio::fs::File::create(&part).await.map_err(unwritten)?;
        let written = async {
            for chunk in email.chunks() {
                let chunk = chunk.map_err(|e| {
                    SendError::Unavailable(format!("reading the spooled attachment: {e}"))
                })?;
                file.write_all(&chunk).await.map_err(unwritten)?;
            }
            file.flush().await.map_err(unwritten)
        }
        .await;
        if let Err(e) = written {
            let _ = tokio::fs::remove_file(&part).await;
            return Err(e);
        }
        tokio::fs::rename(&part, self.1.join(format!("{name}.eml")))
            .await
            .map_err(unwritten)
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
            if email.is_streamed() {
                return self.stream(email).await.map(|_| None);
            }
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

    /// A mailer writing `.eml` files into a new directory named after `tag`, with
    /// its settings.
    fn eml_mailer(tag: &str) -> (std::path::PathBuf, Settings, Mailer) {
        let dir = std::env::temp_dir().join(format!("postie-{tag}-{}", uuid::Uuid::new_v4()));
        let mut settings = Settings::default();
        settings.transport.url = Some(format!("file://{}", dir.display()).into());
        let mailer = Mailer::new(&settings.transport.one_transport().unwrap(), &settings).unwrap();
        (dir, settings, mailer)
    }

    #[tokio::test]
    async fn pc_the_eml_file_holds_the_email_formatted_once() {
        let (dir, settings, mailer) = eml_mailer("pc-eml");
        let rules = ParseRules {
            max_body_bytes: 1 << 16,
            default_from: Some("Shop <noreply@shop.example>"),
            key_namespace: crate::config::KeyNamespace::Off,
            user_id: None,
            attachments: crate::contract::AttachmentLimits::DEFAULT,
        };
        let body = br#"{"key": "k-1", "to": ["a@example.com"], "subject": "s", "text": "hi"}"#;
        let job = EmailJob::parse(body, &rules).unwrap();
        let email = mailer.build(&job).await.unwrap();
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

    #[tokio::test]
    async fn an_email_with_attachments_is_written_whole_and_reads_back() {
        use base64::Engine as _;
        use mail_parser::MimeHeaders as _;
        use sha2::Digest as _;
        let (dir, settings, mailer) = eml_mailer("att-eml");
        let pdf: Vec<u8> = (0..150_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let png = b"\x89PNG\r\n\x1a\n not really".to_vec();
        let ics = b"BEGIN:VCALENDAR\r\nMETHOD:REQUEST\r\nEND:VCALENDAR\r\n".to_vec();
        let file = |name: &str, ty: &str, bytes: &[u8], cid: Option<&str>| {
            let mut one = serde_json::json!({
                "filename": name, "content_type": ty, "size": bytes.len(),
                "sha256": hex::encode(sha2::Sha256::digest(bytes)),
                "source": {"inline": base64::engine::general_purpose::STANDARD.encode(bytes)},
            });
            if let Some(cid) = cid {
                one["disposition"] = "inline".into();
                one["content_id"] = cid.into();
            }
            one
        };
        let body = serde_json::json!({
            "key": "k-att", "from": "shop@example.com", "to": ["a@example.com"], "subject": "Your invoice",
            "text": "See attached.", "html": "<img src=\"cid:logo@shop\"> See attached.",
            "attachments": [
                file("Rechnung März.pdf", "application/pdf", &pdf, None),
                file("logo.png", "image/png", &png, Some("logo@shop")),
                file("invite.ics", "text/calendar; method=REQUEST; charset=UTF-8", &ics, None),
            ]
        });
        let rules = ParseRules {
            max_body_bytes: 1 << 20,
            ..ParseRules::from_settings(&settings)
        };
        let job = EmailJob::parse(body.to_string().as_bytes(), &rules).unwrap();
        let email = mailer.build(&job).await.unwrap();
        assert!(
            email.formatted().len() < 4_000,
            "the skeleton holds no file"
        );
        let slot = mailer.slot().await;
        mailer.send(&slot, &email, &Clearance::new()).await.unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        let written = std::fs::read(&files[0]).unwrap();
        assert_eq!(written.len() as u64, email.size());
        assert_eq!(written, email.whole().unwrap());
        assert!(
            written.split(|b| *b == b'\n').all(|line| line.len() <= 78),
            "76-column lines"
        );
        let parsed = mail_parser::MessageParser::default()
            .parse(&written)
            .unwrap();
        let parts: Vec<_> = parsed.attachments().collect();
        assert_eq!(parts.len(), 3);
        let find = |name: &str| {
            parts
                .iter()
                .find(|p| p.attachment_name() == Some(name))
                .unwrap()
        };
        let got = find("Rechnung März.pdf");
        assert_eq!(got.contents(), &pdf[..]);
        assert_eq!(got.content_type().unwrap().subtype(), Some("pdf"));
        let logo = find("logo.png");
        assert_eq!(logo.contents(), &png[..]);
        assert_eq!(logo.content_id(), Some("logo@shop"));
        assert!(logo.content_disposition().unwrap().is_inline());
        let invite = find("invite.ics");
        assert_eq!(invite.contents(), &ics[..]);
        assert_eq!(
            invite.content_type().unwrap().attribute("method"),
            Some("REQUEST")
        );
        assert!(parsed.body_html(0).unwrap().contains("cid:logo@shop"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A spool that fails to read while the `.eml` is written (a disk fault): not the
    /// job's fault ([`SendError::Unavailable`]: it waits, uncounted), and no file is
    /// left, whole or in part.
    #[tokio::test]
    async fn a_spool_failing_mid_write_is_unavailable_and_leaves_no_file() {
        use super::super::{stream::Content, RouteId, SendError};
        let (dir, settings, mailer) = eml_mailer("spool-eml");
        let body = serde_json::json!({
            "key": "k-spool", "from": "shop@example.com", "to": ["a@example.com"],
            "subject": "Your statement", "text": "See attached.",
            "attachments": [{
                "filename": "statement.pdf", "content_type": "application/pdf", "size": 3,
                "sha256": "039058c6f2c0cb492c533b0a4d14ef77cc0f78abccced5287d84a1a2011cfb81",
                "source": {"inline": "AQID"},
            }]
        });
        let job = EmailJob::parse(
            body.to_string().as_bytes(),
            &ParseRules::from_settings(&settings),
        )
        .unwrap();
        // The file, said to be in the spool, is not there whole: its reads come up short.
        let spooled = crate::mail::fetch::Spooled::of_file(tempfile::tempfile().unwrap(), 100_000);
        let contents = [Content::Spooled(std::sync::Arc::new(spooled))];
        let email = mailer.build_for(&job, RouteId(0), &contents).unwrap();
        let slot = mailer.slot().await;
        let sent = mailer.send(&slot, &email, &Clearance::new()).await;
        assert!(
            matches!(&sent, Err(SendError::Unavailable(why)) if why.contains("reading the spooled attachment")),
            "{sent:?}"
        );
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
