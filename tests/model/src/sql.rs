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
        what: "CLAIM, a batch of claims (inbox::postie_claim)",
        file: "src/inbox/machine/claim.rs",
        start: "const CLAIM: &str",
        end: "ORDER BY c.n\";",
        sha256: "10470547dfa5cc5a1618099dc4050e8466de908a829f26c722fe617e98a31992",
    },
    // Issue 45 added a send's recipients to the completion (`recipients`, set with
    // `sent`): data that no transition reads, so the model is unchanged. Issue 47 made
    // one completion a batch of one: one text, `COMPLETE` (it was two, `COMPLETE` and
    // `COMPLETE_MANY`, the same transition), moved with the other transitions into
    // `src/inbox/machine/`, each as a `const` of its own; no statement changed.
    Mirrored {
        what: "COMPLETE, a batch of completions (inbox::complete)",
        file: "src/inbox/machine/complete.rs",
        start: "const COMPLETE: &str",
        end: "\n);",
        sha256: "432376799bc5248df955ef4e796c73de09495b722792040542cf93a40af41971",
    },
    Mirrored {
        what: "Inbox::renew (inbox::renew)",
        file: "src/inbox/machine/renew.rs",
        start: "const RENEW: &str",
        end: "status = 'sending'\";",
        sha256: "046af61066e3715807eb05d60fd8060e411fbd915e2c6731f628832d2cbaed35",
    },
    // Issue 33 added a job's lane to schedule_many's row and a lane filter to
    // overdue: the model has one lane, and a lane's reconciler pass is the one-lane
    // pass over that lane's rows (its own queue and frontier), so the model is unchanged.
    Mirrored {
        what: "Inbox::schedule_many (inbox::schedule)",
        file: "src/inbox/machine/schedule.rs",
        start: "const SCHEDULE: &str",
        end: "EXCLUDED.revision > i.cancelled_through)\";",
        sha256: "e02cc512c15ff5fad68d3377400f6318386a29dba41afb3b44023d5985a49036",
    },
    Mirrored {
        what: "Inbox::finish_cancelled (inbox::finish_cancelled)",
        file: "src/inbox/machine/finish_cancelled.rs",
        start: "const FINISH_CANCELLED: &str",
        end: "SELECT key FROM done\";",
        sha256: "3972f3e598b78c06f2926b8665d1defc27bed646def28022b2e164a1cc7392d6",
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
