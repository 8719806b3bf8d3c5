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
//!
//! **Formula injection.** A spreadsheet evaluates a cell that begins with `=`, `+`,
//! `-` or `@` (and some a tab or a carriage return) as a formula, and an address may
//! well begin with `=`, `+` or `-` (`=?x@example.com` is valid). Export neutralises
//! such a cell as OWASP advises, with a single quote in front ([`neutralise`]), and
//! quotes a cell that begins with a quote too, so that the mark is never ambiguous in
//! postie's own files. Import takes one leading quote off a cell that begins with a
//! quote followed by one of those characters or another quote ([`restore`]): postie's
//! exports read back exactly. A cell of someone else's file that begins so (an
//! address `'=x@example.com`, which no provider has been seen to write) would lose
//! its quote; every other cell is read as it is.
//!
//! **Bounds.** Import reads at most [`BYTES_PER_ROW`] × `--max-rows` bytes (plus a
//! header's worth): a longer input is refused before more of it is read, so a file
//! of one endless line costs no more memory than a full one.

use std::borrow::Cow;
use std::io::{Read, Write};

use chrono::{DateTime, Utc};

use crate::inbox::{Inbox, SuppressionEntry, SuppressionReason};

/// Rows per page of an export.
const PAGE: i64 = 5_000;
/// Bad rows named in an import's refusal (the count covers them all).
const ERRORS_SHOWN: usize = 10;
/// Bytes of input an import allows per row of `--max-rows` (an exported row is
/// about 100).
pub(super) const BYTES_PER_ROW: u64 = 4096;
/// Bytes of input an import allows beyond its rows (the header).
const HEADER_BYTES: u64 = 64 * 1024;
/// The characters a spreadsheet may take as the start of a formula (OWASP's list),
/// and the quote that marks a neutralised cell.
const FORMULA_STARTS: [char; 7] = ['=', '+', '-', '@', '\t', '\r', '\''];

/// `cell` as export writes it: with a single quote in front if it begins with one of
/// [`FORMULA_STARTS`], so that a spreadsheet shows it as text.
pub(super) fn neutralise(cell: &str) -> Cow<'_, str> {
    if cell.starts_with(FORMULA_STARTS) {
        Cow::Owned(format!("'{cell}"))
    } else {
        Cow::Borrowed(cell)
    }
}

/// `cell` as [`neutralise`] had it: one leading quote taken off a cell that begins
/// with a quote and then one of [`FORMULA_STARTS`]; any other cell as it is.
pub(super) fn restore(cell: &str) -> &str {
    match cell.strip_prefix('\'') {
        Some(rest) if rest.starts_with(FORMULA_STARTS) => rest,
        _ => cell,
    }
}

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
            let cells = [
                r.address.as_str(),
                &r.scope,
                r.reason.as_str(),
                &r.source,
                &r.created_at,
                r.expires_at.as_deref().unwrap_or(""),
                r.evidence.as_deref().unwrap_or(""),
            ];
            writer.write_record(cells.map(neutralise).iter().map(|c| c.as_ref()))?;
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
            .map(|f| restore(f.trim()))
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
    let bound = (max_rows as u64)
        .saturating_mul(BYTES_PER_ROW)
        .saturating_add(HEADER_BYTES);
    let input = Bounded {
        inner: input,
        left: bound,
    };
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

/// A reader that fails once its input goes past `left` bytes, instead of reading on
/// (or stopping silently, as `Read::take` would).
struct Bounded<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        // One byte more than allowed tells "exactly at the bound" from "past it".
        let room = usize::try_from(self.left.saturating_add(1)).unwrap_or(usize::MAX);
        let n = buf.len().min(room);
        let read = self.inner.read(&mut buf[..n])?;
        if read as u64 > self.left {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the input is longer than {BYTES_PER_ROW} bytes a row of --max-rows                      allows: nothing imported"
                ),
            ));
        }
        self.left -= read as u64;
        Ok(read)
    }
}

#[cfg(test)]
mod tests;
