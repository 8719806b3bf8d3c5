//! One email's SMTP transaction on a connection: the envelope, `DATA` and the body.
//!
//! A relay that advertises PIPELINING (RFC 2920) gets MAIL FROM, every RCPT TO and
//! DATA in one write, and its replies are read in order; the body and its final dot
//! follow the 354 in one more write. That is two round trips an email instead of four, and what most
//! of postie's CPU per email paid for: system calls and wake-ups, one per command and
//! reply. A relay without PIPELINING gets one command at a time, as before.
//!
//! A relay that advertises CHUNKING (RFC 3030) as well, when `smtp.chunking` allows
//! it, gets an email for one recipient
//! in a single write: MAIL FROM, RCPT TO, `BDAT <size> LAST` and the body, with the
//! three replies read in order; one round trip an email. The body then goes before
//! the relay has answered the envelope, which is safe only with one recipient: a
//! refused RCPT TO leaves no recipient, and the relay must refuse the chunk, where
//! with two a refused one would let the email through to the other. So emails for
//! several recipients, and bodies that are not text, take the DATA path. Once the
//! group is written, a reply that never comes (a closed connection, a timeout) may
//! follow a delivery, whichever reply it was: the send is marked uncertain.
//!
//! An email with attachments ([`Email::is_streamed`]) always takes the DATA path, its
//! body streamed in chunks of at most 64 KiB (`stream.rs`) through lettre's
//! `message_iter`, which dot-stuffs across the chunks and ends with the final dot;
//! that step may take `transport.timeout` plus the email's transfer time. It is
//! refused before MAIL FROM when it is larger than the relay's `SIZE`, and MAIL FROM
//! names its size. Should the spool fail to read mid-body, the chunk iterator unwinds
//! (`resume_unwind`, caught here) instead of letting the final dot end a truncated
//! message: the connection is dropped without it, the relay discards the
//! transaction, and the send is transient.
//!
//! Either way the body is never started once the send's [`Clearance`] is withdrawn: a
//! pipelined DATA is answered 354 and then left without a body, which the connection's
//! drop ends (the relay discards a transaction that never saw its final dot); a
//! chunked email is written only after the clearance's last check.

use std::fmt;

use futures_util::FutureExt as _;

use lettre::address::{Address, Envelope};
use lettre::transport::smtp::client::AsyncSmtpConnection;
use lettre::transport::smtp::commands::{Data, Mail, Rcpt};
use lettre::transport::smtp::extension::{Extension, MailBodyParameter, MailParameter, ServerInfo};
use lettre::transport::smtp::response::Response;

use super::SmtpRelay;
use crate::mail::{Clearance, Email, SendError};

/// A connection to the relay and what its EHLO said beyond what lettre keeps.
pub(super) struct Session {
    pub(super) connection: AsyncSmtpConnection,
    /// The relay advertised PIPELINING.
    pub(super) pipelining: bool,
    /// The relay advertised CHUNKING as well as PIPELINING.
    pub(super) chunking: bool,
    /// The largest message the relay takes (`SIZE n`, RFC 1870), if it said.
    pub(super) size: Option<u64>,
}

impl Session {
    /// A session on `connection`, with the extensions its EHLO reply advertised
    /// (CHUNKING only if `chunking`, `smtp.chunking`, allows it).
    pub(super) fn new(connection: AsyncSmtpConnection, ehlo: &Response, chunking: bool) -> Self {
        let pipelining = advertises(ehlo, "PIPELINING");
        Self {
            connection,
            pipelining,
            chunking: chunking && pipelining && advertises(ehlo, "CHUNKING"),
            size: size_limit(ehlo),
        }
    }
}

/// Whether an EHLO reply advertises `extension` (a line of its own, any case).
fn advertises(ehlo: &Response, extension: &str) -> bool {
    ehlo.message().any(|line| {
        line.split_whitespace()
            .next()
            .is_some_and(|word| word.eq_ignore_ascii_case(extension))
    })
}

/// The relay's `SIZE n` (0 or none: no limit).
fn size_limit(ehlo: &Response) -> Option<u64> {
    ehlo.message().find_map(|line| {
        let mut words = line.split_whitespace();
        let named = words.next()?.eq_ignore_ascii_case("SIZE");
        let n: u64 = words.next()?.parse().ok()?;
        (named && n > 0).then_some(n)
    })
}

/// Unwinds the chunk iterator when the spool cannot be read (see the module's doc).
struct SpoolFailed(String);

/// How a transaction failed.
pub(super) enum Failed {
    /// The first reply was no reply at all (the connection was closed or reset) or a
    /// 421 (the relay closing the session): on a connection reused without a NOOP that
    /// is a stale connection, and nothing was handed over.
    AtFirstReply(SendError),
    /// Anything else.
    Later(SendError),
}

impl Failed {
    pub(super) fn into_error(self) -> SendError {
        match self {
            Self::AtFirstReply(error) | Self::Later(error) => error,
        }
    }
}

impl From<SendError> for Failed {
    fn from(error: SendError) -> Self {
        Self::Later(error)
    }
}

/// MAIL FROM, every RCPT TO and DATA as one write (what a pipelining relay takes).
struct EnvelopeGroup<'a> {
    mail: Mail,
    envelope: &'a Envelope,
}

impl fmt::Display for EnvelopeGroup<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.mail.fmt(f)?;
        for to in self.envelope.to() {
            Rcpt::new(to.clone(), vec![]).fmt(f)?;
        }
        Data.fmt(f)
    }
}

/// MAIL FROM, the one RCPT TO, `BDAT <size> LAST` and the body as one write (what a
/// relay with PIPELINING and CHUNKING takes): the body goes as it is, neither
/// dot-stuffed nor ended by a dot, its size in octets.
struct ChunkedGroup<'a> {
    mail: Mail,
    to: &'a Address,
    body: &'a str,
}

impl fmt::Display for ChunkedGroup<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.mail.fmt(f)?;
        Rcpt::new(self.to.clone(), vec![]).fmt(f)?;
        write!(f, "BDAT {} LAST\r\n", self.body.len())?;
        f.write_str(self.body)
    }
}

/// The body as sent after DATA's 354: dot-stuffed (a line that starts with `.` gets
/// one more, RFC 5321 §4.5.2, lines ending CRLF as the formatted message's do), then
/// `CRLF . CRLF`: what lettre's `message` writes, as one text.
struct DataContent<'a>(&'a str);

impl fmt::Display for DataContent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        if rest.starts_with('.') {
            f.write_str(".")?;
        }
        while let Some(at) = rest.find("\r\n.") {
            let (line, next) = rest.split_at(at + 3);
            f.write_str(line)?;
            f.write_str(".")?;
            rest = next;
        }
        f.write_str(rest)?;
        f.write_str("\r\n.\r\n")
    }
}

impl SmtpRelay {
    /// MAIL, RCPT, DATA and the body on `session` (or MAIL, RCPT and BDAT where the
    /// relay and the email allow), each reply under `transport.timeout`. The body is never
    /// started once `clearance` is withdrawn.
    pub(super) async fn transaction(
        &self,
        session: &mut Session,
        email: &Email,
        clearance: &Clearance,
    ) -> Result<(), Failed> {
        let (envelope, body) = (email.envelope(), email.formatted());
        let streamed = email.is_streamed();
        if let Some(limit) = session.size.filter(|limit| email.size() > *limit) {
            return Err(Failed::Later(SendError::Permanent(format!(
                "the email is {} bytes, over the relay's SIZE limit of {limit}",
                email.size()
            ))));
        }
        let connection = &mut session.connection;
        let mut options = mail_options(connection.server_info(), envelope, body)?;
        if streamed && session.size.is_some() {
            options.push(MailParameter::Size(email.size() as usize));
        }
        clearance.check()?;
        let mail = Mail::new(envelope.from().cloned(), options);
        let text = std::str::from_utf8(body).ok();
        let chunked = session.chunking && !streamed;
        if let ([to], Some(body), true) = (envelope.to(), text, chunked) {
            let group = ChunkedGroup { mail, to, body };
            return self.chunked(connection, group, clearance).await;
        }
        if session.pipelining {
            // lettre writes a command as its text: the group goes out in one write,
            // and the reply read is MAIL's; the others follow in order.
            let group = EnvelopeGroup { mail, envelope };
            let first = connection.command(group);
            self.first_reply(first).await?;
            for to in envelope.to() {
                let rcpt = connection.read_response();
                let replied = self.bounded("RCPT TO", self.step, rcpt).await;
                refused(clearance, to, &replied);
                replied?;
            }
            let data = connection.read_response();
            self.bounded("DATA", self.step, data).await?;
        } else {
            self.first_reply(connection.command(mail)).await?;
            for to in envelope.to() {
                let rcpt = connection.command(Rcpt::new(to.clone(), vec![]));
                let replied = self.bounded("RCPT TO", self.step, rcpt).await;
                refused(clearance, to, &replied);
                replied?;
            }
            clearance.check()?;
            let data = connection.command(Data);
            self.bounded("DATA", self.step, data).await?;
        }
        clearance.check()?;
        // The body and its final dot in one write when it is text (lettre's `message`
        // writes them apart); the bytes on the wire are the same.
        let ended = match text {
            _ if streamed => self.stream(connection, email).await,
            Some(text) => {
                let content = connection.command(DataContent(text));
                self.bounded("the end of data", self.step, content).await
            }
            None => {
                let content = connection.message(body);
                self.bounded("the end of data", self.step, content).await
            }
        };
        ended.inspect_err(|error| unanswered(clearance, error))?;
        Ok(())
    }

    /// The body of an email with attachments, chunk by chunk, and the final dot,
    /// within `transport.timeout` plus its transfer time. A spool that fails to read
    /// abandons the message before the final dot: the relay took nothing, and the
    /// fault is this instance's disk, not the job's ([`SendError::Unavailable`]: the
    /// job waits in the retry ladder, its files fetched again, no attempt counted).
    async fn stream(
        &self,
        connection: &mut AsyncSmtpConnection,
        email: &Email,
    ) -> Result<Response, SendError> {
        let chunks = email.chunks().map(|chunk| match chunk {
            Ok(chunk) => chunk,
            Err(e) => std::panic::resume_unwind(Box::new(SpoolFailed(e.to_string()))),
        });
        let limit = self.step + email.transfer_time();
        let body = std::panic::AssertUnwindSafe(connection.message_iter(chunks));
        match tokio::time::timeout(limit, body.catch_unwind()).await {
            Ok(Ok(Ok(reply))) => Ok(reply),
            Ok(Ok(Err(error))) => Err(super::classify(error, &self.throttles)),
            Ok(Err(unwound)) => match unwound.downcast::<SpoolFailed>() {
                Ok(failed) => Err(SendError::Unavailable(format!(
                    "reading the spooled attachment: {}; the message was abandoned before its end",
                    failed.0
                ))),
                Err(other) => std::panic::resume_unwind(other),
            },
            Err(_) => Err(super::no_answer("the end of data", limit)),
        }
    }

    /// The envelope and the body in one write, then MAIL's, RCPT's and BDAT's replies
    /// in order. A definite refusal of any of them means the relay took nothing; no
    /// reply at all, to any of them, may follow a delivery (uncertain).
    async fn chunked(
        &self,
        connection: &mut AsyncSmtpConnection,
        group: ChunkedGroup<'_>,
        clearance: &Clearance,
    ) -> Result<(), Failed> {
        let to = group.to;
        let first = self.first_reply(connection.command(group)).await;
        if let Err(Failed::AtFirstReply(error) | Failed::Later(error)) = &first {
            unanswered(clearance, error);
        }
        first?;
        let rcpt = connection.read_response();
        let replied = self.bounded("RCPT TO", self.step, rcpt).await;
        refused(clearance, to, &replied);
        replied.inspect_err(|error| unanswered(clearance, error))?;
        let bdat = connection.read_response();
        let ended = self.bounded("BDAT", self.step, bdat).await;
        ended.inspect_err(|error| unanswered(clearance, error))?;
        Ok(())
    }

    /// MAIL FROM's reply, telling a stale connection (closed, reset, or 421) apart.
    async fn first_reply(
        &self,
        step: impl std::future::Future<Output = Result<Response, lettre::transport::smtp::Error>>,
    ) -> Result<Response, Failed> {
        match tokio::time::timeout(self.step, step).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(error)) => {
                let stale = error.status().is_none_or(|code| code.to_string() == "421");
                let error = super::classify(error, &self.throttles);
                Err(if stale {
                    Failed::AtFirstReply(error)
                } else {
                    Failed::Later(error)
                })
            }
            Err(_) => Err(Failed::Later(super::no_answer("MAIL FROM", self.step))),
        }
    }
}

/// Marks `clearance` uncertain when a step after the body went out got no reply: the
/// relay may have taken the email.
fn unanswered(clearance: &Clearance, error: &SendError) {
    if let SendError::Unreachable(_) = error {
        clearance.mark_uncertain();
    }
}

/// Notes on `clearance` a recipient the relay refused for good at RCPT TO.
fn refused<T>(clearance: &Clearance, to: &lettre::Address, replied: &Result<T, SendError>) {
    if let Err(SendError::Permanent(reply)) = replied {
        clearance.refuse(to.to_string(), reply.clone());
    }
}

/// MAIL FROM's parameters, as lettre's own `send` picks them: SMTPUTF8 for non-ASCII
/// addresses, 8BITMIME for a non-ASCII body; a relay without the extension can never
/// take the email (permanent).
fn mail_options(
    server: &ServerInfo,
    envelope: &Envelope,
    body: &[u8],
) -> Result<Vec<MailParameter>, SendError> {
    let mut options = Vec::new();
    let non_ascii_address = envelope
        .to()
        .iter()
        .chain(envelope.from())
        .any(|address| !AsRef::<str>::as_ref(address).is_ascii());
    if non_ascii_address {
        if !server.supports_feature(Extension::SmtpUtfEight) {
            return Err(SendError::Permanent(
                "the envelope has non-ASCII addresses and the relay does not support SMTPUTF8"
                    .into(),
            ));
        }
        options.push(MailParameter::SmtpUtfEight);
    }
    if !body.is_ascii() {
        if !server.supports_feature(Extension::EightBitMime) {
            return Err(SendError::Permanent(
                "the message is not ASCII and the relay does not support 8BITMIME".into(),
            ));
        }
        options.push(MailParameter::Body(MailBodyParameter::EightBitMime));
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ehlo(lines: &str) -> Response {
        lines.parse().expect("an SMTP reply")
    }

    #[test]
    fn pipelining_and_chunking_are_read_from_the_ehlo_reply() {
        let with = ehlo("250-relay.example\r\n250-SIZE 1000\r\n250-pipelining\r\n250 8BITMIME\r\n");
        assert!(advertises(&with, "PIPELINING"));
        let without = ehlo("250-relay.example\r\n250-SIZE 1000\r\n250 8BITMIME\r\n");
        assert!(!advertises(&without, "PIPELINING"));
        let lookalike = ehlo("250-relay.example\r\n250 XPIPELININGX\r\n");
        assert!(!advertises(&lookalike, "PIPELINING"));
        let both = ehlo("250-relay.example\r\n250-PIPELINING\r\n250 Chunking\r\n");
        assert!(advertises(&both, "PIPELINING") && advertises(&both, "CHUNKING"));
        assert!(!advertises(&with, "CHUNKING"));
    }

    #[test]
    fn the_chunked_group_is_mail_rcpt_bdat_with_the_size_and_the_body_as_it_is() {
        let to: Address = "a@example.com".parse().unwrap();
        let mail = Mail::new(Some("from@example.com".parse().unwrap()), vec![]);
        let body = "Subject: é\r\n\r\n.first\r\nlast";
        let group = ChunkedGroup {
            mail,
            to: &to,
            body,
        };
        assert_eq!(body.len(), 27, "octets, not characters");
        assert_eq!(
            group.to_string(),
            "MAIL FROM:<from@example.com>\r\nRCPT TO:<a@example.com>\r\n\
             BDAT 27 LAST\r\nSubject: é\r\n\r\n.first\r\nlast"
        );
    }

    #[test]
    fn data_content_is_dot_stuffed_and_ends_with_the_final_dot() {
        let cases = [
            (
                "Subject: x\r\n\r\nhello",
                "Subject: x\r\n\r\nhello\r\n.\r\n",
            ),
            (".first\r\n..two\r\n.", "..first\r\n...two\r\n..\r\n.\r\n"),
            ("a\r\n.\r\n.b", "a\r\n..\r\n..b\r\n.\r\n"),
            ("a.b\n.c\r\n", "a.b\n.c\r\n\r\n.\r\n"),
            ("", "\r\n.\r\n"),
        ];
        for (body, wire) in cases {
            assert_eq!(DataContent(body).to_string(), wire, "{body:?}");
        }
    }

    #[test]
    fn the_envelope_group_is_mail_each_rcpt_and_data_in_order() {
        let envelope = Envelope::new(
            Some("from@example.com".parse().unwrap()),
            vec![
                "a@example.com".parse().unwrap(),
                "b@example.com".parse().unwrap(),
            ],
        )
        .unwrap();
        let mail = Mail::new(envelope.from().cloned(), vec![]);
        let group = EnvelopeGroup {
            mail,
            envelope: &envelope,
        };
        assert_eq!(
            group.to_string(),
            "MAIL FROM:<from@example.com>\r\nRCPT TO:<a@example.com>\r\n\
             RCPT TO:<b@example.com>\r\nDATA\r\n"
        );
    }
}
