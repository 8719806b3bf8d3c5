//! The life of an inbox row, as the `status` column spells it.

use std::fmt;

use super::super::DbError;

/// Where a key stands. `sending`, `retrying` and `scheduled` are in flight; the rest
/// are finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Status {
    /// Not seen before (only reported by a cancel that leaves a tombstone).
    New,
    /// Ladder mode: the relay has routed it into the ladder; not yet due.
    Scheduled,
    /// Claimed under a lease: an email may be leaving now.
    Sending,
    /// Failed transiently (or given back); waiting in a retry queue.
    Retrying,
    /// Sent and recorded.
    Sent,
    /// Dead-lettered after an SMTP attempt.
    Dead,
    /// Cancelled by a cancel request (or a tombstone for a key never seen).
    Cancelled,
    /// Dropped by a per-type throttle.
    Throttled,
    /// Every recipient suppressed (hard bounce, complaint, unsubscribe, manual): never
    /// sent.
    Suppressed,
}

impl Status {
    /// Every status, in the order `postie status` lists them.
    pub(crate) const ALL: [Status; 9] = [
        Self::New,
        Self::Scheduled,
        Self::Sending,
        Self::Retrying,
        Self::Sent,
        Self::Dead,
        Self::Cancelled,
        Self::Throttled,
        Self::Suppressed,
    ];

    /// The value of the `status` column.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Scheduled => "scheduled",
            Self::Sending => "sending",
            Self::Retrying => "retrying",
            Self::Sent => "sent",
            Self::Dead => "dead",
            Self::Cancelled => "cancelled",
            Self::Throttled => "throttled",
            Self::Suppressed => "suppressed",
        }
    }

    /// Reads the `status` column; `None` for a value this postie does not know.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// True for rows that still have work ahead of them (never pruned).
    #[cfg(test)]
    pub(crate) fn in_flight(self) -> bool {
        matches!(self, Self::Scheduled | Self::Sending | Self::Retrying)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reads a `status` column value.
pub(in crate::inbox) fn status_of(text: &str) -> Result<Status, DbError> {
    Status::parse(text).ok_or_else(|| DbError::refused(format!("unknown inbox status {text:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_reads_back_from_its_column_value() {
        for status in Status::ALL {
            assert_eq!(Status::parse(status.as_str()), Some(status));
        }
        assert_eq!(Status::parse("bogus"), None);
        let in_flight: Vec<_> = Status::ALL.into_iter().filter(|s| s.in_flight()).collect();
        assert_eq!(
            in_flight,
            [Status::Scheduled, Status::Sending, Status::Retrying]
        );
    }
}
