//! `postie suppression import|export`: the list as CSV (RFC 4180, a header row).
//!
//! Export writes `address,scope,reason,source,created_at,expires_at,evidence`, which
//! import reads back. Import reads the columns by name, so a provider's export can be
//! fed as it is: the address from `address`, `email`, `email_address` or `recipient`;
//! `scope` (default `*`); `reason` (the four postie knows, or a provider's word for
//! one: `bounce`, `hardbounce`, `spamreport`, `abuse`, `unsubscribed`…; default
//! `--reason`); `expires_at` (RFC 3339, empty for never); `evidence` or `note`. Other
//! columns are ignored. Every row is checked before anything is added: one bad row
//! stops the import with its line number, and the list is unchanged.

use std::io::{Read, Write};

use chrono::{DateTime, Utc};

use crate::inbox::{Inbox, SuppressionEntry, SuppressionReason};

/// Rows per page of an export.
const PAGE: i64 = 5_000;
/// Bad rows named in an import's refusal (the count covers them all).
const ERRORS_SHOWN: usize = 10;

/// The columns export writes (and import reads).
const HEADER: [&str; 7] = [
    "address",
    "scope",
    "reason",
    "source",
    "created_at",
    "expires_at",
    "evidence",
];

/// Writes the live list to `out`; how many rows.
pub(super) async fn export(inbox: &Inbox, out: impl Write) -> anyhow::Result<u64> {
    let mut writer = csv::Writer::from_writer(out);
    writer.write_record(HEADER)?;
    let mut last: Option<(String, String)> = None;
    let mut rows = 0u64;
    loop {
        let after = last.as_ref().map(|(a, s)| (a.as_str(), s.as_str()));
        let page = inbox.suppression_page(after, PAGE).await?;
        for r in &page {
            writer.write_record([
                r.address.as_str(),
                &r.scope,
                r.reason.as_str(),
                &r.source,
                &r.created_at,
                r.expires_at.as_deref().unwrap_or(""),
                r.evidence.as_deref().unwrap_or(""),
            ])?;
        }
        rows += page.len() as u64;
        match page.last() {
            Some(r) if page.len() as i64 == PAGE => {
                last = Some((r.address.clone(), r.scope.clone()))
            }
            _ => break,
        }
    }
    writer.flush()?;
    Ok(rows)
}

/// Where each known column is in the file's header.
struct Columns {
    address: usize,
    scope: Option<usize>,
    reason: Option<usize>,
    expires_at: Option<usize>,
    evidence: Option<usize>,
}

impl Columns {
    fn find(header: &csv::StringRecord) -> anyhow::Result<Self> {
        let at = |names: &[&str]| {
            header.iter().position(|h| {
                let h = h.trim().to_ascii_lowercase().replace([' ', '-'], "_");
                names.contains(&h.as_str())
            })
        };
        let address = at(&[
            "address",
            "email",
            "email_address",
            "emailaddress",
            "recipient",
        ])
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the header row names no address column (address, email, email_address \
                     or recipient): {:?}",
                header.iter().collect::<Vec<_>>()
            )
        })?;
        Ok(Self {
            address,
            scope: at(&["scope"]),
            reason: at(&["reason", "type"]),
            expires_at: at(&["expires_at", "expires"]),
            evidence: at(&["evidence", "note"]),
        })
    }
}

/// A reason as postie or a provider writes it.
fn reason_of(text: &str) -> Option<SuppressionReason> {
    let word = text.trim().to_ascii_lowercase().replace([' ', '-'], "_");
    SuppressionReason::parse(&word).or(match word.as_str() {
        "bounce" | "bounced" | "hardbounce" | "hard" | "permanent" => {
            Some(SuppressionReason::HardBounce)
        }
        "spamreport" | "spam_report" | "spamcomplaint" | "spam_complaint" | "abuse"
        | "complained" => Some(SuppressionReason::Complaint),
        "unsubscribed" | "unsubscribes" | "unsubscription" => Some(SuppressionReason::Unsubscribe),
        _ => None,
    })
}

/// One data row as an entry, or why not.
fn entry(
    row: &csv::StringRecord,
    columns: &Columns,
    default_reason: SuppressionReason,
) -> Result<SuppressionEntry, String> {
    let field = |i: Option<usize>| {
        i.and_then(|i| row.get(i))
            .map(str::trim)
            .filter(|f| !f.is_empty())
    };
    let address = field(Some(columns.address)).ok_or("no address")?;
    let (local, domain) = address
        .rsplit_once('@')
        .ok_or_else(|| format!("{address:?} is not an email address"))?;
    if local.is_empty() || domain.is_empty() || address.chars().any(char::is_whitespace) {
        return Err(format!("{address:?} is not an email address"));
    }
    let reason = match field(columns.reason) {
        None => default_reason,
        Some(text) => reason_of(text).ok_or_else(|| {
            format!("reason {text:?}: one of hard_bounce, complaint, unsubscribe, manual")
        })?,
    };
    let expires_at = field(columns.expires_at)
        .map(|text| {
            DateTime::parse_from_rfc3339(text)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| format!("expires_at {text:?}: not an RFC 3339 time ({e})"))
        })
        .transpose()?;
    Ok(SuppressionEntry {
        address: address.to_owned(),
        scope: field(columns.scope).unwrap_or("*").to_owned(),
        reason,
        evidence: field(columns.evidence).map(str::to_owned),
        expires_at,
    })
}

/// Reads every row of `input`, at most `max_rows`; the entries, or every bad row
/// (the first [`ERRORS_SHOWN`] named, by line) as one error.
pub(super) fn read(
    input: impl Read,
    default_reason: SuppressionReason,
    max_rows: usize,
) -> anyhow::Result<Vec<SuppressionEntry>> {
    let mut reader = csv::ReaderBuilder::new().flexible(true).from_reader(input);
    let columns = Columns::find(reader.headers()?)?;
    let (mut entries, mut bad) = (Vec::new(), Vec::new());
    for (n, row) in reader.records().enumerate() {
        anyhow::ensure!(
            n < max_rows,
            "more than --max-rows {max_rows} rows: nothing imported"
        );
        let row = row?;
        let line = row.position().map_or(n as u64 + 2, |p| p.line());
        match entry(&row, &columns, default_reason) {
            Ok(e) => entries.push(e),
            Err(why) => bad.push(format!("line {line}: {why}")),
        }
    }
    if !bad.is_empty() {
        let shown = bad
            .iter()
            .take(ERRORS_SHOWN)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ");
        anyhow::bail!("{} bad rows, nothing imported: {shown}", bad.len());
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_text(text: &str) -> anyhow::Result<Vec<SuppressionEntry>> {
        read(text.as_bytes(), SuppressionReason::Manual, 100)
    }

    #[test]
    fn postie_s_own_export_reads_back() {
        let text = "address,scope,reason,source,created_at,expires_at,evidence\n\
                    ann@example.com,*,complaint,cli,2026-12-01T00:00:00Z,,\"ARF, report 42\"\n\
                    bob@example.com,newsletter,manual,cli,2026-12-01T00:00:00Z,2027-01-01T00:00:00Z,\n";
        let entries = read_text(text).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].reason, SuppressionReason::Complaint);
        assert_eq!(entries[0].evidence.as_deref(), Some("ARF, report 42"));
        assert_eq!(entries[1].scope, "newsletter");
        assert!(entries[1].expires_at.is_some());
    }

    #[test]
    fn a_provider_s_columns_and_words_are_understood() {
        let text = "Email Address,Reason,Last Update\nx@example.com,BOUNCE,2026\ny@example.com,spamreport,\n";
        let entries = read_text(text).unwrap();
        assert_eq!(entries[0].reason, SuppressionReason::HardBounce);
        assert_eq!(entries[1].reason, SuppressionReason::Complaint);
        assert_eq!(entries[0].scope, "*");
    }

    #[test]
    fn one_bad_row_refuses_the_file_naming_its_line() {
        let text =
            "email,reason\nok@example.com,manual\nnot-an-address,manual\nz@example.com,sometimes\n";
        let error = read_text(text).unwrap_err().to_string();
        assert!(error.contains("2 bad rows"), "{error}");
        assert!(
            error.contains("line 3") && error.contains("not-an-address"),
            "{error}"
        );
        assert!(
            error.contains("line 4") && error.contains("sometimes"),
            "{error}"
        );
        let no_address = read_text("name,reason\nann,manual\n")
            .unwrap_err()
            .to_string();
        assert!(no_address.contains("no address column"), "{no_address}");
    }

    #[test]
    fn more_rows_than_allowed_is_refused() {
        let text = "email\na@example.com\nb@example.com\nc@example.com\n";
        let error = read(text.as_bytes(), SuppressionReason::Manual, 2).unwrap_err();
        assert!(error.to_string().contains("--max-rows 2"), "{error}");
    }
}
