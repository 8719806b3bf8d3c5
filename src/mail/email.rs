//! [`Email`]: an email ready to be handed over, built once by the mailer: its
//! envelope, its formatted text (with attachments, the skeleton and its splices,
//! streamed by `stream.rs`), and for the JSON APIs the job's fields.

use std::sync::Arc;
use std::time::Duration;

use lettre::address::Envelope;
use lettre::Message;

use super::stream::{self, Content};
use super::{message, SendError};

/// An email ready to be handed over: its envelope and its RFC 5322 text, formatted
/// once when it is built. Transports borrow it: nothing of the message is copied on
/// the way to the relay or the file. An email with attachments is a skeleton and
/// its splices ([`Email::chunks`]): their bytes are read as they are sent.
#[derive(Debug, Clone)]
pub struct Email {
    envelope: Envelope,
    /// The message, or with attachments its skeleton (the placeholders taken out).
    formatted: Arc<[u8]>,
    /// Where each attachment's encoded bytes go in `formatted`, in the MIME's order
    /// (inline images before the attachments).
    splices: Arc<[stream::Splice]>,
    /// The attachments' bytes in the job's order, which the splices index (and an
    /// API that takes files as JSON fields reads).
    contents: Arc<[Content]>,
    /// What the attachments add to a send's deadline (their encoded size at
    /// `attachments.min_rate`).
    pub(super) transfer: Duration,
    /// The job's fields, for a transport that asks for them
    /// ([`Transport::wants_fields`]: SendGrid, Postmark).
    pub(super) fields: Option<Box<message::Fields>>,
}

impl Email {
    /// `message`, formatted.
    pub fn new(message: &Message) -> Self {
        Self {
            envelope: message.envelope().clone(),
            formatted: message.formatted().into(),
            splices: Arc::new([]),
            contents: Arc::new([]),
            transfer: Duration::ZERO,
            fields: None,
        }
    }

    /// `message`, formatted with a mark under `nonce` for each attachment
    /// ([`stream::mark`]), each replaced by a splice of its attachment's `contents`.
    pub(super) fn spliced(
        message: &Message,
        nonce: &str,
        contents: &[Content],
    ) -> Result<Self, SendError> {
        let text = message.formatted();
        let marks: Vec<String> = (0..contents.len())
            .map(|i| stream::mark(nonce, i))
            .collect();
        let (pieces, order) = stream::cut(&text, &marks).ok_or_else(|| {
            SendError::Permanent("an attachment has no place in the email".into())
        })?;
        let mut formatted = Vec::with_capacity(text.len());
        let mut splices = Vec::with_capacity(order.len());
        for (piece, index) in pieces.iter().zip(order) {
            formatted.extend_from_slice(piece);
            splices.push(stream::Splice {
                at: formatted.len(),
                index,
            });
        }
        formatted.extend_from_slice(pieces[pieces.len() - 1]);
        Ok(Self {
            envelope: message.envelope().clone(),
            formatted: formatted.into(),
            splices: splices.into(),
            contents: contents.into(),
            transfer: Duration::ZERO,
            fields: None,
        })
    }

    /// Whether it carries attachments, to be streamed ([`Email::chunks`]) rather than
    /// written from [`Email::formatted`].
    pub(crate) fn is_streamed(&self) -> bool {
        !self.splices.is_empty()
    }

    /// Its size in bytes as sent (before any dot-stuffing).
    pub(crate) fn size(&self) -> u64 {
        self.formatted.len() as u64 + self.attachments_size()
    }

    /// What its attachments come to, base64-encoded.
    pub(super) fn attachments_size(&self) -> u64 {
        self.contents
            .iter()
            .map(|content| stream::encoded_len(content.len()))
            .sum()
    }

    /// The message in chunks of at most 64 KiB: the skeleton's text and each
    /// attachment's base64 lines. A read of the spool that fails ends it with the
    /// error: the transport must then abandon the message.
    pub(crate) fn chunks(&self) -> stream::Chunks {
        stream::Chunks::new(
            self.formatted.clone(),
            self.splices.clone(),
            self.contents.clone(),
        )
    }

    /// The attachments' bytes, in the job's order.
    pub(crate) fn contents(&self) -> &[Content] {
        &self.contents
    }

    /// The whole message in memory, for tests to compare with what a server received.
    #[cfg(test)]
    pub(crate) fn whole(&self) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.size() as usize);
        for chunk in self.chunks() {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }

    /// What its attachments add to a send's deadline.
    pub(crate) fn transfer_time(&self) -> Duration {
        self.transfer
    }

    /// The job's fields, when the mailer's transport asked for them.
    pub(crate) fn fields(&self) -> Option<&message::Fields> {
        self.fields.as_deref()
    }

    /// MAIL FROM and RCPT TO.
    pub(crate) fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// The message as sent after `DATA` (an email with attachments: its skeleton).
    pub fn formatted(&self) -> &[u8] {
        &self.formatted
    }
}
