//! An email address with an optional display name, checked when parsed.
//!
//! The parser is lettre's (a well-kept RFC 5322 mailbox parser), but the type is
//! postie's own, so the job model does not depend on the mail transport.

use std::fmt;
use std::str::FromStr;

use lettre::message::Mailbox;

use super::{check_header_value, invalid, shorten, InvalidJob};

/// A mailbox from a job: `Name <local@domain>` or `local@domain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// The display name, if any.
    pub name: Option<String>,
    /// `local@domain`.
    pub email: String,
}

impl Address {
    /// Parses the job's field `field`: one mailbox, no control characters, and a
    /// domain name (not an address literal, not a dotless host).
    pub(crate) fn parse(field: &str, raw: &str) -> Result<Self, InvalidJob> {
        check_header_value(field, raw)?;
        let mailbox = Mailbox::from_str(raw).map_err(|e| {
            InvalidJob(format!(
                "\"{field}\" is not a valid address ({e}): {}",
                shorten(raw)
            ))
        })?;
        let domain = mailbox.email.domain();
        if domain.starts_with('[') || !domain.contains('.') {
            return invalid(format!(
                "\"{field}\" must use a domain name, not {}",
                shorten(domain)
            ));
        }
        Ok(Self {
            name: mailbox.name,
            email: mailbox.email.to_string(),
        })
    }

    /// Parses each of a list field.
    pub(crate) fn parse_all(field: &str, raw: &[String]) -> Result<Vec<Self>, InvalidJob> {
        raw.iter().map(|r| Self::parse(field, r)).collect()
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name:?} <{}>", self.email),
            None => f.write_str(&self.email),
        }
    }
}
