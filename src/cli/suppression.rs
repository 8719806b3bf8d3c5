//! `postie suppression list|add|remove|import|export`: the addresses postie does not
//! send to.

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;

use crate::config::Settings;
use crate::inbox::{Inbox, Suppress, SuppressionReason};

mod csv_file;

/// What to do with the suppression list.
#[derive(Subcommand)]
pub enum SuppressionCommand {
    /// List suppressed addresses (live entries), one per line, tab-separated.
    List {
        /// Only this address.
        #[arg(long)]
        address: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 1_000)]
        limit: i64,
    },
    /// Suppress an address (no-op if it already is, in that scope).
    Add {
        /// The address.
        address: String,
        /// hard_bounce, complaint, unsubscribe or manual.
        #[arg(long, default_value = "manual")]
        reason: String,
        /// `*` (every email) or one job type.
        #[arg(long, default_value = "*")]
        scope: String,
        /// Why, for the audit trail.
        #[arg(long)]
        note: Option<String>,
        /// Lifts itself after this long (`30d`, `12h`); default: until removed.
        #[arg(long, value_parser = humantime::parse_duration)]
        expires: Option<Duration>,
    },
    /// Stop suppressing an address (in one scope, or every one).
    Remove {
        /// The address.
        address: String,
        /// Only this scope (`*` or a job type); default: every scope.
        #[arg(long)]
        scope: Option<String>,
    },
    /// Add the addresses of a CSV file (a header row; see `export` for the columns, or
    /// a provider's export with an `email` column), all or none: one bad row refuses
    /// the file.
    Import {
        /// The CSV file; `-` reads standard input.
        file: PathBuf,
        /// The reason of rows without one.
        #[arg(long, default_value = "manual")]
        reason: String,
        /// The source named in the audit trail.
        #[arg(long, default_value = "import")]
        source: String,
        /// Refuse a file of more rows than this (the file is read whole first).
        #[arg(long, default_value_t = 1_000_000)]
        max_rows: usize,
    },
    /// Write the live list as CSV (address, scope, reason, source, created_at,
    /// expires_at, evidence), which `import` reads back.
    Export {
        /// The file to write; default: standard output.
        #[arg(long)]
        file: Option<PathBuf>,
    },
}

/// `--reason`'s word as a reason.
fn reason_arg(reason: &str) -> anyhow::Result<SuppressionReason> {
    SuppressionReason::parse(reason).ok_or_else(|| {
        anyhow::anyhow!("--reason {reason:?}: one of hard_bounce, complaint, unsubscribe, manual")
    })
}

/// Runs `command` against the inbox database.
pub(super) async fn run(settings: &Settings, command: SuppressionCommand) -> anyhow::Result<()> {
    let inbox = Inbox::connect(&settings.database).await?;
    inbox.migrate().await?;
    match command {
        SuppressionCommand::List { address, limit } => {
            let rows = inbox.suppression_list(address.as_deref(), limit).await?;
            for r in &rows {
                out!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    r.address,
                    r.scope,
                    r.reason.as_str(),
                    r.source,
                    r.created_at,
                    r.expires_at.as_deref().unwrap_or("-"),
                    crate::contract::readable(r.evidence.as_deref().unwrap_or("-"), 200)
                );
            }
            out!("{} suppressed", rows.len());
        }
        SuppressionCommand::Add {
            address,
            reason,
            scope,
            note,
            expires,
        } => {
            let reason = reason_arg(&reason)?;
            anyhow::ensure!(address.contains('@'), "{address:?} is not an email address");
            let added = inbox
                .suppress(Suppress {
                    address: &address,
                    scope: &scope,
                    reason,
                    source: "cli",
                    evidence: note.as_deref(),
                    lasts: expires,
                })
                .await?;
            out!(
                "{address}: {}",
                if added {
                    "suppressed"
                } else {
                    "already suppressed in that scope (unchanged)"
                }
            );
        }
        SuppressionCommand::Remove { address, scope } => {
            let removed = inbox.unsuppress(&address, scope.as_deref(), "cli").await?;
            out!(
                "{address}: {removed} entr{} removed",
                if removed == 1 { "y" } else { "ies" }
            );
        }
        SuppressionCommand::Import {
            file,
            reason,
            source,
            max_rows,
        } => import(&inbox, &file, reason_arg(&reason)?, &source, max_rows).await?,
        SuppressionCommand::Export { file } => {
            let rows = match file {
                Some(path) => {
                    let out = std::fs::File::create(&path)
                        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
                    csv_file::export(&inbox, std::io::BufWriter::new(out)).await?
                }
                None => {
                    csv_file::export(&inbox, std::io::BufWriter::new(std::io::stdout())).await?
                }
            };
            eprintln!("{rows} suppressed addresses exported");
        }
    }
    Ok(())
}

/// `postie suppression import`: reads and checks the whole file, then adds it in one
/// transaction.
async fn import(
    inbox: &Inbox,
    file: &std::path::Path,
    reason: SuppressionReason,
    source: &str,
    max_rows: usize,
) -> anyhow::Result<()> {
    let entries = if file.as_os_str() == "-" {
        csv_file::read(std::io::stdin().lock(), reason, max_rows)?
    } else {
        let input = std::fs::File::open(file)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?;
        csv_file::read(std::io::BufReader::new(input), reason, max_rows)?
    };
    let added = inbox.suppress_many(&entries, source).await?;
    out!(
        "{} rows read: {added} added, {} unchanged (already on the list, or repeated in the file)",
        entries.len(),
        entries.len() as u64 - added
    );
    Ok(())
}
