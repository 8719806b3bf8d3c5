//! What a PostgreSQL error means for the job that met it: the job's own fault (the
//! server refused what the job carried; no retry can fix it), or an outage to wait
//! out (everything else: no answer, a read-only standby, a revoked privilege, a
//! missing function after a bad deploy, a full disk, too many connections).
//!
//! The rule is inverted on purpose: an error is the job's fault only if its SQLSTATE
//! class says the statement's *data* was wrong. An unknown error holds the job
//! instead of dead-lettering it, because a dead letter of a job that could have
//! been sent is a broken promise, and a hold of a truly bad job is only a delay that
//! the operator sees (readiness false, one log line naming the cause, which
//! `DbError::cause` puts in words).

/// PostgreSQL could not be reached, or refused a statement.
#[derive(Debug, Clone, thiserror::Error)]
#[error("database: {message}")]
pub struct DbError {
    message: String,
    /// The SQLSTATE (five characters), when the server answered.
    code: Option<String>,
    /// The server answered, but with something this postie cannot read (an answer
    /// of a newer schema): an outage to wait out, never the job's fault.
    unreadable: bool,
}

/// SQLSTATE classes that are the job's own fault:
/// - `22` data exception: a value the job carried does not fit its column (out of
///   range, malformed, a NUL byte in text);
/// - `23` integrity constraint violation: the row the job makes breaks a constraint
///   of the schema (a CHECK on what it carried);
/// - `54` program limit exceeded: the job is too big for the server (an index row
///   over its size limit from a huge key, a statement too complex).
const JOB_FAULT_CLASSES: [&str; 3] = ["22", "23", "54"];

impl DbError {
    /// A statement's result this postie cannot read: a refusal, not an outage.
    pub(super) fn refused(message: String) -> Self {
        Self {
            message,
            code: Some("22000".into()),
            unreadable: false,
        }
    }

    /// No answer within `limit` (a hung server or a network path that dropped its
    /// packets): an outage.
    pub(crate) fn no_answer(limit: std::time::Duration) -> Self {
        Self {
            message: format!(
                "no answer within {} (database.statement_timeout)",
                humantime::format_duration(limit)
            ),
            code: None,
            unreadable: false,
        }
    }

    /// An answer this postie does not know (a database migrated by a newer postie, or
    /// an older binary against a newer schema): an outage, so the job is held and
    /// never dead-lettered, and readiness names the mismatch.
    pub(super) fn unreadable(message: String) -> Self {
        Self {
            message,
            code: None,
            unreadable: true,
        }
    }

    /// True unless the server refused the statement for what this job carried (see
    /// [`JOB_FAULT_CLASSES`]): not the job's fault, so hold it, wait and retry.
    pub fn is_outage(&self) -> bool {
        match self.code.as_deref() {
            None => true,
            Some(code) => !JOB_FAULT_CLASSES.contains(&code.get(..2).unwrap_or(code)),
        }
    }

    /// The outage's cause in words, with its SQLSTATE, for the one log line an
    /// operator reads ("the database is read-only (25006) — a failover to a standby?").
    pub fn cause(&self) -> String {
        if self.unreadable {
            return format!(
                "postie cannot read the database's answer ({}) — a database migrated by a newer postie?",
                self.message
            );
        }
        let Some(code) = self.code.as_deref() else {
            return format!("PostgreSQL does not answer ({})", self.message);
        };
        let words = match code {
            "25006" => "the database is read-only",
            "42501" => "postie's database user lacks a privilege",
            "42883" => "a function postie needs is missing",
            "42P01" => "a table postie needs is missing",
            "42703" => "a column postie needs is missing",
            "53100" => "the database server's disk is full",
            "53200" => "the database server is out of memory",
            "53300" => "the database server has too many connections",
            "57014" => "a statement was cancelled (statement_timeout?)",
            "57P01" | "57P02" => "the database server ended the session",
            "57P03" => "the database server does not accept connections yet",
            _ => match &code[..2.min(code.len())] {
                "08" => "the connection to the database failed",
                "40" => "a transaction was rolled back by a conflict",
                "55" => "a database object is locked or in use",
                "53" => "the database server ran out of a resource",
                "58" | "XX" => "the database server failed internally",
                _ => "the database refused a statement",
            },
        };
        let hint = match code {
            "25006" => " — a failover to a standby?",
            "42501" => " — a privilege revoked?",
            "42883" | "42P01" | "42703" => " — migrations not applied, or a bad deploy?",
            "57P01" | "57P02" | "57P03" => " — a restart or a failover?",
            _ => "",
        };
        format!("{words} ({code}){hint}")
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        // The Display of a db error carries the server message; of an io error, the cause.
        match e.as_db_error() {
            Some(db) => Self {
                message: format!("{}: {}", db.code().code(), db.message()),
                code: Some(db.code().code().to_string()),
                unreadable: false,
            },
            None => Self {
                message: match std::error::Error::source(&e) {
                    Some(cause) => format!("{e}: {cause}"),
                    None => e.to_string(),
                },
                code: None,
                unreadable: false,
            },
        }
    }
}

impl From<deadpool_postgres::PoolError> for DbError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => Self {
                message: other.to_string(),
                code: None,
                unreadable: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(code: &str) -> DbError {
        DbError {
            message: format!("{code}: test"),
            code: Some(code.into()),
            unreadable: false,
        }
    }

    #[test]
    fn only_what_the_job_carried_is_its_fault() {
        for code in [
            "22003", "22P02", "22021", "23505", "23514", "54000", "54001",
        ] {
            assert!(!error(code).is_outage(), "{code} is the job's fault");
        }
        assert!(!DbError::refused("unknown status".into()).is_outage());
    }

    #[test]
    fn a_gray_database_is_an_outage() {
        for code in [
            "25006", "42501", "42883", "42P01", "53100", "53300", "57P01", "08006", "40001",
            "55P03", "XX000", "0A000", "F0000",
        ] {
            assert!(error(code).is_outage(), "{code} is an outage");
        }
        let no_answer = DbError {
            message: "connection refused".into(),
            code: None,
            unreadable: false,
        };
        assert!(no_answer.is_outage());
        assert!(no_answer.cause().contains("does not answer"));
        let newer = DbError::unreadable("postie_claim answered \"later\"".into());
        assert!(newer.is_outage(), "an unknown answer is waited out");
        assert!(newer.cause().contains("migrated by a newer postie"));
    }

    #[test]
    fn the_cause_names_the_failure_in_words() {
        assert_eq!(
            error("25006").cause(),
            "the database is read-only (25006) — a failover to a standby?"
        );
        assert!(error("42883").cause().contains("bad deploy"));
        assert!(error("53100").cause().contains("disk is full (53100)"));
        assert!(error("53300").cause().contains("too many connections"));
        assert!(error("08006").cause().contains("connection"));
        assert!(error("0A000")
            .cause()
            .contains("refused a statement (0A000)"));
    }
}
