//! An [`EmailJob`] as an RFC 5322 message: the one place where the job model meets
//! lettre's types.

use std::str::FromStr;

use lettre::message::header::{HeaderName, HeaderValue};
use lettre::message::{Mailbox, MultiPart, SinglePart};
use lettre::Message;

use super::SendError;
use crate::contract::{Address, EmailJob};

/// Builds the email with the given Message-ID; an error is permanent.
pub(super) fn build(job: &EmailJob, message_id: String) -> Result<Message, SendError> {
    let mut builder = Message::builder()
        .from(mailbox(&job.from)?)
        .subject(job.subject.clone())
        .message_id(Some(message_id))
        .date_now();
    for to in &job.to {
        builder = builder.to(mailbox(to)?);
    }
    for cc in &job.cc {
        builder = builder.cc(mailbox(cc)?);
    }
    for bcc in &job.bcc {
        builder = builder.bcc(mailbox(bcc)?);
    }
    if let Some(reply_to) = &job.reply_to {
        builder = builder.reply_to(mailbox(reply_to)?);
    }
    let built = match (&job.text, &job.html) {
        (Some(text), Some(html)) => builder.multipart(MultiPart::alternative_plain_html(
            text.clone(),
            html.clone(),
        )),
        (Some(text), None) => builder.singlepart(SinglePart::plain(text.clone())),
        (None, Some(html)) => builder.singlepart(SinglePart::html(html.clone())),
        (None, None) => return Err(SendError::Permanent("job has no body".into())),
    };
    let mut message =
        built.map_err(|e| SendError::Permanent(format!("cannot build email: {e}")))?;
    for (name, value) in &job.headers {
        let name = HeaderName::new_from_ascii(name.clone())
            .map_err(|e| SendError::Permanent(format!("header {name:?}: {e}")))?;
        message
            .headers_mut()
            .insert_raw(HeaderValue::new(name, value.clone()));
    }
    Ok(message)
}

/// The job's address as lettre's mailbox. The address was parsed by lettre's parser
/// when the job was read, so this cannot fail in practice; if it did, the job could
/// never be sent.
fn mailbox(address: &Address) -> Result<Mailbox, SendError> {
    let email = lettre::Address::from_str(&address.email)
        .map_err(|e| SendError::Permanent(format!("address {:?}: {e}", address.email)))?;
    Ok(Mailbox::new(address.name.clone(), email))
}

/// The job's fields for a provider whose API takes them as JSON rather than the MIME
/// message (SendGrid, Postmark): addresses as `Name <local@domain>` text and as
/// (name, address) pairs, the subject, the bodies, the job's own headers and postie's
/// Message-ID. The Date header and the MIME structure are the provider's.
#[derive(Debug, Clone)]
pub(crate) struct Fields {
    pub(crate) from: Address,
    pub(crate) to: Vec<Address>,
    pub(crate) cc: Vec<Address>,
    pub(crate) bcc: Vec<Address>,
    pub(crate) reply_to: Option<Address>,
    pub(crate) subject: String,
    pub(crate) text: Option<String>,
    pub(crate) html: Option<String>,
    /// The job's headers, then `Message-ID`.
    pub(crate) headers: Vec<(String, String)>,
}

impl Fields {
    /// The job's fields with the Message-ID postie gives it (`<…@domain>`).
    pub(super) fn of(job: &EmailJob, message_id: &str) -> Self {
        let mut headers = job.headers.clone();
        headers.push(("Message-ID".into(), message_id.to_string()));
        Self {
            from: job.from.clone(),
            to: job.to.clone(),
            cc: job.cc.clone(),
            bcc: job.bcc.clone(),
            reply_to: job.reply_to.clone(),
            subject: job.subject.clone(),
            text: job.text.clone(),
            html: job.html.clone(),
            headers,
        }
    }
}

/// `address` as a header would show it (`"Name" <local@domain>`, quoted as needed).
pub(crate) fn mailbox_text(address: &Address) -> String {
    match mailbox(address) {
        Ok(mailbox) => mailbox.to_string(),
        Err(_) => address.email.clone(),
    }
}
