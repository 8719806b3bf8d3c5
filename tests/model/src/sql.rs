//! The SQL the model mirrors, held by its digest: when one of these texts changes,
//! `tests/sql_digest.rs` fails and names it, so that whoever changed it updates the
//! model (`inbox.rs`, and the steps that call it) and then the digest here.

use sha2::{Digest, Sha256};

/// One text the model mirrors: where it is (from the repository's root), where it
/// starts and where it ends (both included), and the SHA-256 of that text the model
/// was last checked against.
pub struct Mirrored {
    pub what: &'static str,
    pub file: &'static str,
    pub start: &'static str,
    pub end: &'static str,
    pub sha256: &'static str,
}

/// Everything `inbox.rs` mirrors.
pub const MIRRORED: &[Mirrored] = &[
    Mirrored {
        what: "postie_claim (inbox::postie_claim)",
        file: "sql/schema.sql",
        start: "CREATE FUNCTION postie_claim(",
        end: "$$;",
        sha256: "5ccca5f2bd49234e2fd2554c4ff83dfb9ac33cd9f023ab366b0f7487c69e5bbf",
    },
    Mirrored {
        what: "postie_cancel (inbox::postie_cancel)",
        file: "sql/schema.sql",
        start: "CREATE FUNCTION postie_cancel(",
        end: "$$;",
        sha256: "25649b54f1365a0ea3d1318dfcb6fb497ccff141dc54180492f5f4ad2fa81d07",
    },
    // A batch of claims calls postie_claim once per row, in key order, in one
    // transaction: each row is the model's claim step, and the rows take effect
    // together at the commit, before any caller hears its answer (until then another
    // claim of one of those keys waits on its row lock). So the model is unchanged.
    Mirrored {
        what: "CLAIM_MANY, a batch of claims (inbox::postie_claim)",
        file: "src/inbox/claim_many.rs",
        start: "const CLAIM_MANY: &str",
        end: "ORDER BY c.n\";",
        sha256: "ca979b2c6921faab617ccc2ed3b557b76b240c96892b3e7050b3a805458cdd3f",
    },
    // Issue 45 added a send's recipients to both completions (`recipients`, set with
    // `sent`): data that no transition reads, so the model is unchanged.
    Mirrored {
        what: "COMPLETE, one completion (inbox::complete)",
        file: "src/inbox/claim.rs",
        start: "pub(super) const COMPLETE: &str",
        end: "\n);",
        sha256: "015f0610225f46a3d2ce7dcf0f9a7760c380f5f8a34fca02e4e88f89544d04bf",
    },
    Mirrored {
        what: "COMPLETE_MANY, a batch of completions (inbox::complete)",
        file: "src/inbox/complete.rs",
        start: "const COMPLETE_MANY: &str",
        end: "\n);",
        sha256: "d4b880bd37ce0a977515d144c662c7df8bc7651cf4535ca5a77ef06d92e49e33",
    },
    Mirrored {
        what: "Inbox::renew (inbox::renew)",
        file: "src/inbox/claim.rs",
        start: "SET lease_until = clock_timestamp()",
        end: "status = 'sending'",
        sha256: "466e6edee9bdcc4ed9f47f27d6fed46d40ea908dc8d5f8eab9a4f62560577df4",
    },
    // Issue 33 added a job's lane to schedule_many's row and a lane filter to
    // overdue: the model has one lane, and a lane's reconciler pass is the one-lane
    // pass over that lane's rows (its own queue and frontier), so the model is unchanged.
    Mirrored {
        what: "Inbox::schedule_many (inbox::schedule)",
        file: "src/inbox/claim.rs",
        start: "INSERT INTO postie_inbox AS i (key, status, revision, due_at, body, lane)",
        end: "EXCLUDED.revision > i.cancelled_through)",
        sha256: "c6d41d9b16682f54077a37793823021c3515c5b6c94a76d001fa6af138ece427",
    },
    Mirrored {
        what: "Inbox::finish_cancelled (inbox::finish_cancelled)",
        file: "src/inbox/queries.rs",
        start: "SET status = 'cancelled', body = NULL",
        end: "RETURNING key, type, message_id, attempts)",
        sha256: "cdba287cd339a3a9931dcee8b52c80d62cc67c6d43468e33480038f9f61ee680",
    },
    Mirrored {
        what: "Inbox::overdue (protocol::reconcilable)",
        file: "src/inbox/reconcile.rs",
        start: "SELECT key, (extract(epoch FROM due_at) * 1000)::bigint FROM postie_inbox",
        end: "ORDER BY due_at LIMIT $3",
        sha256: "428959fd6577847e998cdb73d6c04844984990f47d308c304df42e92fd84b9f6",
    },
];

impl Mirrored {
    /// The text as it is now in `source` (the file's contents), or why it cannot be found.
    pub fn text<'a>(&self, source: &'a str) -> Result<&'a str, String> {
        let from = source
            .find(self.start)
            .ok_or_else(|| format!("{}: {:?} not found in {}", self.what, self.start, self.file))?;
        let len = source[from..].find(self.end).ok_or_else(|| {
            format!(
                "{}: no {:?} after its start in {}",
                self.what, self.end, self.file
            )
        })?;
        Ok(&source[from..from + len + self.end.len()])
    }
}

/// SHA-256 of a text, in hex.
pub fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}
