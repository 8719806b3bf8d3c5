//! An [`EmailJob`] as an RFC 5322 message: the one place where the job model meets
//! lettre's types.

use std::str::FromStr;

use lettre::message::header::{
    ContentDisposition, ContentId, ContentTransferEncoding, ContentType, HeaderName, HeaderValue,
};
use lettre::message::{Body, Mailbox, MultiPart, MultiPartBuilder, SinglePart};
use lettre::Message;

use super::SendError;
use crate::contract::{Address, Attachment, EmailJob};

/// Builds the email with the given Message-ID; an error is permanent. A job with
/// attachments gets a placeholder body for each, named by `stream::mark` under
/// `nonce`, where its bytes go when it is streamed (`stream.rs`): the text, or the
/// alternative of text and HTML, then each attachment, in a `multipart/mixed`; the
/// inline ones (`cid:` images) with the HTML in a `multipart/related`.
pub(super) fn build(job: &EmailJob, message_id: String, nonce: &str) -> Result<Message, SendError> {
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
    let built = match (job.attachments.is_empty(), text_part(job)?) {
        (true, Text::Single(part)) => builder.singlepart(part),
        (true, Text::Multi(parts)) => builder.multipart(parts),
        (false, text) => builder.multipart(with_attachments(job, text, nonce)?),
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

/// The job's text, HTML, or both as alternatives; with inline images, that and the
/// images in a `multipart/related`.
enum Text {
    Single(SinglePart),
    Multi(MultiPart),
}

impl Text {
    /// `outer` with this as its next part.
    fn within(self, outer: MultiPartBuilder) -> MultiPart {
        match self {
            Self::Single(part) => outer.singlepart(part),
            Self::Multi(parts) => outer.multipart(parts),
        }
    }
}

fn text_part(job: &EmailJob) -> Result<Text, SendError> {
    Ok(match (&job.text, &job.html) {
        (Some(text), Some(html)) => Text::Multi(MultiPart::alternative_plain_html(
            text.clone(),
            html.clone(),
        )),
        (Some(text), None) => Text::Single(SinglePart::plain(text.clone())),
        (None, Some(html)) => Text::Single(SinglePart::html(html.clone())),
        (None, None) => return Err(SendError::Permanent("job has no body".into())),
    })
}

/// `multipart/mixed`: the text (with the inline parts in a `multipart/related`), then
/// the attachments.
fn with_attachments(job: &EmailJob, text: Text, nonce: &str) -> Result<MultiPart, SendError> {
    let mut inline = job
        .attachments
        .iter()
        .enumerate()
        .filter(|(_, a)| a.content_id.is_some())
        .peekable();
    let body = if inline.peek().is_some() {
        let mut related = text.within(MultiPart::related());
        for (index, attachment) in inline {
            related = related.singlepart(file_part(attachment, nonce, index)?);
        }
        Text::Multi(related)
    } else {
        text
    };
    let mut mixed = body.within(MultiPart::mixed());
    for (index, attachment) in job.attachments.iter().enumerate() {
        if attachment.content_id.is_none() {
            mixed = mixed.singlepart(file_part(attachment, nonce, index)?);
        }
    }
    Ok(mixed)
}

/// One file's part: its type, its disposition and name, base64, and its placeholder.
fn file_part(attachment: &Attachment, nonce: &str, index: usize) -> Result<SinglePart, SendError> {
    let content_type = ContentType::parse(&attachment.content_type).map_err(|e| {
        SendError::Permanent(format!("content_type {:?}: {e}", attachment.content_type))
    })?;
    let mut part = SinglePart::builder().header(content_type);
    part = match &attachment.content_id {
        Some(id) => part
            .header(ContentDisposition::inline_with_name(&attachment.filename))
            .header(ContentId::from(format!("<{id}>"))),
        None => part.header(ContentDisposition::attachment(&attachment.filename)),
    };
    let body = Body::dangerous_pre_encoded(
        super::stream::mark(nonce, index).into_bytes(),
        ContentTransferEncoding::Base64,
    );
    Ok(part.body(body))
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
    /// The attachments, in the job's order (their bytes are the email's
    /// [`contents`](super::Email::contents)).
    pub(crate) files: Vec<FileField>,
}

/// What an API that takes files as JSON is told of one.
#[derive(Debug, Clone)]
pub(crate) struct FileField {
    pub(crate) filename: String,
    pub(crate) content_type: String,
    /// Inline (`cid:`) images' Content-ID, without brackets.
    pub(crate) content_id: Option<String>,
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
            files: job
                .attachments
                .iter()
                .map(|a| FileField {
                    filename: a.filename.clone(),
                    content_type: a.content_type.clone(),
                    content_id: a.content_id.clone(),
                })
                .collect(),
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
