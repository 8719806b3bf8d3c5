//! The inbox's state machine as ARCHITECTURE.md draws it, against the code (issue 47):
//! every transition in the page's table is a file of `src/inbox/machine/` (and, for
//! the two that are SQL functions, a function of `sql/schema.sql` that its file calls),
//! every file there is in the table, and no statement anywhere else in `src/` or in
//! `sql/schema.sql` writes a row's `status`. Reads files only: no service needed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The transitions ARCHITECTURE.md's table names: the first cell of each row of the
/// table under "## The inbox's state machine", and the names in its diagram.
fn drawn() -> (BTreeSet<String>, String) {
    let page = read(&Path::new(ROOT).join("ARCHITECTURE.md"));
    let from = page
        .find("## The inbox's state machine")
        .expect("ARCHITECTURE.md has a section \"The inbox's state machine\"");
    let section = &page[from..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |n| n + 3)];
    let mut names = BTreeSet::new();
    let mut in_table = false;
    for line in section.lines() {
        if line.starts_with("| transition |") {
            in_table = true;
            continue;
        }
        if in_table && line.starts_with('|') {
            let cell = line.split('|').nth(1).unwrap_or("").trim();
            if cell.starts_with("---") {
                continue;
            }
            let name = cell.trim_matches('`');
            assert!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "ARCHITECTURE.md: a transition's first cell is its name in backticks: {line}"
            );
            names.insert(name.to_owned());
        } else if in_table {
            in_table = false;
        }
    }
    assert!(!names.is_empty(), "no transition table in ARCHITECTURE.md");
    let diagram = section
        .split("```")
        .nth(1)
        .expect("the state machine's diagram")
        .to_owned();
    (names, diagram)
}

/// The transitions `src/inbox/machine/` codes: each file but `mod.rs` and `status.rs`
/// opens with ``//! `name`:``.
fn coded() -> Vec<(String, PathBuf)> {
    let dir = Path::new(ROOT).join("src/inbox/machine");
    let mut found = vec![];
    for entry in std::fs::read_dir(&dir).expect("src/inbox/machine") {
        let path = entry.expect("a directory entry").path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if file == "mod.rs" || file == "status.rs" {
            continue;
        }
        let text = read(&path);
        let first = text.lines().next().unwrap_or("");
        let name = first
            .strip_prefix("//! `")
            .and_then(|rest| rest.split_once("`:"))
            .map(|(name, _)| name.to_owned())
            .unwrap_or_else(|| {
                panic!("{file}: its first line names its transition: //! `name`: …")
            });
        found.push((name, path));
    }
    found.sort();
    found
}

/// Each statement in `text` that writes `postie_inbox.status`: an `INSERT INTO
/// postie_inbox` (a row is born with a status), or an `UPDATE postie_inbox` that assigns
/// `status` (`SET status =` or `, status =`, not a comparison inside an expression).
/// A statement runs to the end of its string literal or its `;`.
fn status_writes(text: &str) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let mut writes = vec![];
    for start in ["insert into postie_inbox", "update postie_inbox"] {
        let mut at = 0;
        while let Some(n) = lower[at..].find(start) {
            let from = at + n;
            let rest = &lower[from..];
            let end = rest.find(['"', ';']).unwrap_or(rest.len());
            let statement = &rest[..end];
            at = from + start.len();
            let assigns = statement
                .split_once(" set ")
                .map(|(_, set)| set.split(" where ").next().unwrap_or(set))
                .is_some_and(|set| {
                    let flat = set.split_whitespace().collect::<Vec<_>>().join(" ");
                    flat.starts_with("status =")
                        || flat.starts_with("status=")
                        || flat.contains(", status =")
                        || flat.contains(",status =")
                });
            if start.starts_with("insert") || assigns {
                writes.push(text[from..from + end.min(80)].replace('\n', " "));
            }
        }
    }
    writes
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `CREATE FUNCTION name(…) … $$;` blocks of `sql/schema.sql`: (name, text).
fn sql_functions(schema: &str) -> Vec<(String, &str)> {
    let mut found = vec![];
    let mut at = 0;
    while let Some(n) = schema[at..].find("CREATE FUNCTION ") {
        let from = at + n;
        let name_end = schema[from..].find('(').expect("a function's arguments") + from;
        let name = schema[from + "CREATE FUNCTION ".len()..name_end]
            .trim()
            .to_owned();
        let end = schema[from..]
            .find("$$;")
            .map_or(schema.len(), |e| from + e + 3);
        found.push((name, &schema[from..end]));
        at = end;
    }
    found
}

#[test]
fn every_transition_drawn_is_coded_and_every_one_coded_is_drawn() {
    let (drawn, diagram) = drawn();
    let coded = coded();
    let coded_names: BTreeSet<String> = coded.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(
        drawn, coded_names,
        "ARCHITECTURE.md's transition table (left) and src/inbox/machine/'s files (right) differ"
    );
    let schema = read(&Path::new(ROOT).join("sql/schema.sql"));
    let functions: BTreeSet<String> = sql_functions(&schema).into_iter().map(|(n, _)| n).collect();
    for (name, path) in &coded {
        let text = read(path);
        if let Some(function) = name.strip_prefix("postie_").map(|_| name.as_str()) {
            assert!(
                functions.contains(function),
                "{function}: drawn and coded, but not a function of sql/schema.sql"
            );
            assert!(
                text.contains(&format!("{function}(")),
                "{}: does not call {function}",
                path.display()
            );
        } else {
            assert!(
                text.contains("UPDATE postie_inbox") || text.contains("INSERT INTO postie_inbox"),
                "{}: transition {name} has no statement on postie_inbox",
                path.display()
            );
        }
    }
    // The diagram draws the transitions into and out of `sending`, by their names.
    for name in ["postie_claim", "renew", "complete"] {
        assert!(diagram.contains(name), "the diagram draws {name}");
        assert!(drawn.contains(name), "the table lists {name}");
    }
}

#[test]
fn no_statement_outside_the_machine_writes_status() {
    let machine = Path::new(ROOT).join("src/inbox/machine");
    let mut files = vec![];
    rust_files(&Path::new(ROOT).join("src"), &mut files);
    let mut outside = vec![];
    let mut inside = 0;
    for path in &files {
        let writes = status_writes(&read(path));
        if path.starts_with(&machine) {
            inside += writes.len();
        } else {
            outside.extend(
                writes
                    .into_iter()
                    .map(|w| format!("{}: {w}", path.display())),
            );
        }
    }
    let schema = read(&Path::new(ROOT).join("sql/schema.sql"));
    let (drawn, _) = drawn();
    let mut in_functions = 0;
    for (name, text) in sql_functions(&schema) {
        let writes = status_writes(text);
        if drawn.contains(&name) {
            in_functions += writes.len();
        } else {
            outside.extend(
                writes
                    .into_iter()
                    .map(|w| format!("sql/schema.sql {name}: {w}")),
            );
        }
    }
    assert!(
        outside.is_empty(),
        "statements that write postie_inbox.status outside src/inbox/machine/ \
         (move them there, as a transition ARCHITECTURE.md draws):\n{}",
        outside.join("\n")
    );
    // The check sees the writes it is meant to see: the machine's own statements
    // (schedule, complete, finish_cancelled, finish_unclaimed) and the SQL functions'.
    assert!(
        inside >= 4,
        "only {inside} status writes found in src/inbox/machine/"
    );
    assert!(
        in_functions >= 3,
        "only {in_functions} status writes found in postie_claim and postie_cancel"
    );
}

#[test]
fn the_check_tells_a_status_write_from_a_read() {
    let writes = status_writes(
        r#"let a = "UPDATE postie_inbox SET status = 'dead' WHERE key = $1";
           let b = "UPDATE postie_inbox
                       SET body = NULL,
                           status = $3 WHERE key = $1";
           let c = "UPDATE postie_inbox SET arrived_at = now() WHERE status = 'scheduled'";
           let d = "UPDATE postie_inbox SET fence = fence + (status = 'sending')::int";
           let e = "INSERT INTO postie_inbox (key) VALUES ($1)";"#,
    );
    assert_eq!(writes.len(), 3, "{writes:?}");
    assert!(writes[0].starts_with("INSERT"), "{writes:?}");
    assert!(
        writes[1].contains("'dead'") && writes[2].contains("body = NULL"),
        "{writes:?}"
    );
}
