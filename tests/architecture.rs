//! Dependencies point one way (ARCHITECTURE.md, "Dependencies point one way"): this test
//! reads every `src/**/*.rs`, collects the modules each top-level module refers to
//! (`crate::inbox::…`, `use crate::{a, b}`, `super::super::x` that climbs to the crate
//! root, and `postie::…` in `src/main.rs`) and fails on an edge the table below does
//! not allow. Code in `#[cfg(test)]` items is exempt: a test may reach anywhere.
//!
//! A new edge is a design decision: add it to `ALLOWED` and to ARCHITECTURE.md's table
//! in the same commit, with the reason, or move the code so that it points down.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level module may use, besides itself: the layers of ARCHITECTURE.md,
/// each using only layers below it, and the job's path (`inbox`, `mail`, `broker`)
/// side by side, none using another. `root` is `src/lib.rs`'s own items
/// (`describe_error`, `error_chain`); `main` is `src/main.rs`.
const ALLOWED: &[(&str, &[&str])] = &[
    // The binary: loads settings and logging, runs a command.
    ("main", &["cli", "config", "ops", "endpoint", "root"]),
    // The integration tests' door to the internals: re-exports only, no code.
    (
        "testing",
        &[
            "broker", "console", "consume", "contract", "dlq", "endpoint", "headers", "inbox",
            "mail", "ops", "topology", "work",
        ],
    ),
    // One file per command; `serve` starts `consume`, the others reach what they show.
    (
        "cli",
        &[
            "consume", "console", "dlq", "feedback", "outbox", "work", "inbox", "mail", "broker",
            "topology", "contract", "ops", "config", "headers", "endpoint", "root",
        ],
    ),
    // `postie serve`: the consume loops around the unit of work.
    (
        "consume",
        &[
            "work", "feedback", "outbox", "inbox", "mail", "broker", "topology", "contract", "ops",
            "config", "headers", "endpoint", "root",
        ],
    ),
    // The producers' outboxes (install, a batch, the lag): reached like the inbox (its
    // dialer and errors); the publish is the session's (`consume::outbox`).
    ("outbox", &["inbox", "config", "endpoint", "root"]),
    // Bounces and complaints after the send: webhooks and reports recorded in the inbox
    // (inbox), hard bounces read as at send time (mail::bounce), an HTTPS client for
    // SNS (mail's), counted (ops).
    (
        "feedback",
        &["inbox", "mail", "ops", "config", "endpoint", "root"],
    ),
    // The operator console: what the CLI reaches, in a browser: the inbox, the dead
    // letters (dlq), queue depths (broker, topology), served by ops::http.
    (
        "console",
        &[
            "dlq", "inbox", "broker", "topology", "contract", "ops", "config", "headers",
            "endpoint", "root",
        ],
    ),
    // Dead letters for operators: reads a letter (contract), replays it (broker).
    (
        "dlq",
        &[
            "broker", "topology", "contract", "ops", "config", "headers", "endpoint", "root",
        ],
    ),
    // The unit of work: claim (inbox), send (mail), parse (contract), name a
    // disposition's target (topology); never the broker.
    (
        "work",
        &[
            "inbox", "mail", "topology", "contract", "ops", "config", "headers", "endpoint", "root",
        ],
    ),
    // The job's path, side by side: each may read the contract, none uses another.
    (
        "inbox",
        &["contract", "ops", "config", "headers", "endpoint", "root"],
    ),
    (
        "mail",
        &["contract", "ops", "config", "headers", "endpoint", "root"],
    ),
    (
        "broker",
        &[
            "topology", "contract", "ops", "config", "headers", "endpoint", "root",
        ],
    ),
    // The broker objects' names and the ladder's arithmetic: data, no I/O.
    ("topology", &["contract", "config", "root"]),
    // Backoff, health, metrics, HTTP, telemetry: for every layer above the contract.
    ("ops", &["config", "headers", "endpoint", "root"]),
    // The producers' contract knows no transport.
    ("contract", &["config", "headers", "endpoint", "root"]),
    // Leaves.
    ("config", &["endpoint", "root"]),
    ("headers", &["root"]),
    ("endpoint", &["root"]),
    ("root", &[]),
];

/// Edges the code has today against the table above. Each is to be removed by moving
/// code, not by widening `ALLOWED`; the test fails when one is gone and still listed.
/// Empty this list; do not add to it.
const KNOWN_VIOLATIONS: &[(&str, &str)] = &[];

#[test]
fn modules_depend_in_the_documented_direction() {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(from, to)| (*from, to.iter().copied().collect()))
        .collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    let mut seen_known = BTreeSet::new();
    for file in rust_files(&src) {
        let module = module_path(&src, &file);
        let from = module.first().map(String::as_str).unwrap_or("root");
        let Some(may) = allowed.get(from) else {
            wrong.push(format!(
                "{}: module `{from}` is not in ALLOWED: give it a row (and one in ARCHITECTURE.md)",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("read a source file");
        for (line, to) in references(&text, &module, from == "main") {
            if to == from || may.contains(to.as_str()) {
                continue;
            }
            if !allowed.contains_key(to.as_str()) {
                wrong.push(format!(
                    "{}:{line}: `{to}` is not in ALLOWED: give it a row (and one in ARCHITECTURE.md)",
                    file.display()
                ));
            } else if let Some(k) = KNOWN_VIOLATIONS.iter().find(|k| **k == (from, to.as_str())) {
                seen_known.insert(*k);
            } else {
                wrong.push(format!(
                    "{}:{line}: `{from}` uses `{to}`, against the direction in ARCHITECTURE.md",
                    file.display()
                ));
            }
        }
    }
    for gone in KNOWN_VIOLATIONS.iter().filter(|k| !seen_known.contains(k)) {
        wrong.push(format!(
            "KNOWN_VIOLATIONS lists {gone:?}, which the code no longer has: remove it"
        ));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_reader_finds_every_form_of_path() {
    let text = r##"
        use crate::inbox::Inbox;
        use crate::{config::Settings, ops::{health, metrics}};
        use super::super::mail::Mailer;
        fn f() { crate::broker::publish(); let s = "crate::dlq"; } // crate::cli
        /* crate::consume /* nested */ crate::consume */
        pub(in crate::work) fn g<'a>(x: &'a str) -> char { let _ = super::x; 'c' }
        const Q: [char; 2] = ['\'', '\\']; const R: &str = r#"crate::cli "quoted""#;
        #[cfg(test)]
        mod tests { use crate::cli::run; fn h() { crate::dlq::x(); } }
        #[cfg(test)]
        use crate::consume::Service;
        fn after() { crate::headers::X; }
    "##;
    let module = vec!["work".to_string(), "outcome".to_string()];
    let found: Vec<String> = references(text, &module, false)
        .into_iter()
        .map(|(_, to)| to)
        .collect();
    assert_eq!(
        found,
        ["inbox", "config", "ops", "mail", "broker", "headers"]
    );
    let main = references("use postie::cli::{self, Cli}; postie::ops::x();", &[], true);
    let found: Vec<&str> = main.iter().map(|(_, to)| to.as_str()).collect();
    assert_eq!(found, ["cli", "ops"]);
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The module a file is: `src/work/worker/due.rs` is `work::worker::due`,
/// `src/inbox/mod.rs` is `inbox`, `src/lib.rs` and `src/main.rs` the root (`main.rs`
/// reported as `main`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).expect("a file under src/");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts.last().map(String::as_str) {
        Some("mod") | Some("lib") => {
            parts.pop();
        }
        _ => {}
    }
    parts
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The source as tokens with their line numbers: comments, strings and character
/// literals dropped (their contents are no references), lifetimes kept as punctuation.
fn tokens(text: &str) -> Vec<(usize, Token)> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let count = |from: usize, to: usize| {
        c[from..to.min(c.len())]
            .iter()
            .filter(|&&x| x == '\n')
            .count()
    };
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied().unwrap_or('\0');
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == '*' {
            let (start, mut depth) = (i, 0);
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += count(start, i);
        } else if let Some(end) = raw_string_end(&c, i) {
            line += count(i, end);
            i = end;
        } else if ch == '"' || (ch == 'b' && next == '"') {
            let start = i;
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            line += count(start, i);
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{1F600}'), or a lifetime ('a).
            if next == '\\' {
                // Past the backslash and the escaped character, which may be a quote.
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                out.push((line, Token::Punct('\'')));
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((line, Token::Ident(c[start..i].iter().collect())));
        } else if ch == ':' && next == ':' {
            out.push((line, Token::PathSep));
            i += 2;
        } else {
            out.push((line, Token::Punct(ch)));
            i += 1;
        }
    }
    out
}

/// Where a raw string (`r"…"`, `r#"…"#`, `br"…"`) that starts at `i` ends.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// The tokens without the items under `#[cfg(test)]` (a `mod tests { … }`, a `use`,
/// a function): from the attribute to the item's `;` or its closing brace.
fn without_test_items(tokens: Vec<(usize, Token)>) -> Vec<(usize, Token)> {
    let is = |t: &Token, p: char| *t == Token::Punct(p);
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let cfg_test = is(&tokens[i].1, '#')
            && tokens.get(i + 1).is_some_and(|t| is(&t.1, '['))
            && tokens
                .get(i + 2)
                .is_some_and(|t| t.1 == Token::Ident("cfg".into()))
            && tokens.get(i + 3).is_some_and(|t| is(&t.1, '('))
            && tokens
                .get(i + 4)
                .is_some_and(|t| t.1 == Token::Ident("test".into()))
            && tokens.get(i + 5).is_some_and(|t| is(&t.1, ')'));
        if !cfg_test {
            out.push(tokens[i].clone());
            i += 1;
            continue;
        }
        let mut depth = 0usize;
        i += 6;
        while i < tokens.len() {
            let t = &tokens[i].1;
            i += 1;
            if is(t, '{') {
                depth += 1;
            } else if is(t, '}') {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            } else if is(t, ';') && depth == 0 {
                break;
            }
        }
    }
    out
}

/// The top-level modules a file refers to, with the line of each reference. `module` is
/// the file's own module path, against which `super::` is resolved (inline `mod x { }`
/// blocks deepen it); in `src/main.rs` (`binary`) `postie::` is the library's root.
fn references(text: &str, module: &[String], binary: bool) -> Vec<(usize, String)> {
    let t = without_test_items(tokens(text));
    let ident = |i: usize| match t.get(i) {
        Some((_, Token::Ident(s))) => Some(s.as_str()),
        _ => None,
    };
    let sep = |i: usize| matches!(t.get(i), Some((_, Token::PathSep)));
    let punct = |i: usize, p: char| matches!(t.get(i), Some((_, Token::Punct(q))) if *q == p);
    let mut found = Vec::new();
    // Inline modules: (name, the brace depth at which its block opened).
    let mut inline: Vec<usize> = Vec::new();
    let mut names: Vec<String> = module.to_vec();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        let line = t[i].0;
        if punct(i, '{') {
            depth += 1;
        } else if punct(i, '}') {
            if inline.last() == Some(&depth) {
                inline.pop();
                names.pop();
            }
            depth = depth.saturating_sub(1);
        } else if ident(i) == Some("mod") && ident(i + 1).is_some() && punct(i + 2, '{') {
            names.push(ident(i + 1).unwrap_or_default().to_string());
            inline.push(depth + 1);
        }
        let root = matches!(ident(i), Some("crate")) || (binary && ident(i) == Some("postie"));
        let after_in = i > 0 && ident(i - 1) == Some("in");
        // Only the start of a path: `a::crate` is no path, `crate::` after `::` neither.
        let starts = i == 0 || !sep(i - 1);
        if root && starts && sep(i + 1) && !after_in {
            if let Some(name) = ident(i + 2) {
                found.push((line, name.to_string()));
            } else if punct(i + 2, '{') {
                for name in group_heads(&t, i + 3) {
                    found.push((line, name));
                }
            }
        } else if ident(i) == Some("super") && starts && sep(i + 1) {
            let mut up = 1;
            let mut j = i + 2;
            while ident(j) == Some("super") && sep(j + 1) {
                up += 1;
                j += 2;
            }
            if up >= names.len() {
                // Climbed to the crate root: the next segment is a top-level module.
                if up == names.len() {
                    if let Some(name) = ident(j) {
                        found.push((line, name.to_string()));
                    } else if punct(j, '{') {
                        found.extend(group_heads(&t, j + 1).into_iter().map(|n| (line, n)));
                    }
                }
            } else {
                // Below the root: the same top-level module, which needs no check.
            }
            i = j;
            continue;
        }
        i += 1;
    }
    found
        .into_iter()
        .map(|(line, name)| {
            let top = match name.as_str() {
                n if n.chars().next().is_some_and(char::is_lowercase) && is_module(n) => n.into(),
                _ => "root".into(),
            };
            (line, top)
        })
        .collect()
}

/// Whether a name after `crate::` is a module rather than an item of `src/lib.rs`
/// (functions there are lower case too).
fn is_module(name: &str) -> bool {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    src.join(format!("{name}.rs")).exists() || src.join(name).join("mod.rs").exists()
}

/// The first segment of each path in a `{a, b::c, d::{e, f}}` group that opens just
/// before `start`.
fn group_heads(t: &[(usize, Token)], start: usize) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 1;
    let mut expect_head = true;
    let mut i = start;
    while i < t.len() && depth > 0 {
        match &t[i].1 {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => depth -= 1,
            Token::Punct(',') if depth == 1 => expect_head = true,
            Token::Ident(name) if depth == 1 && expect_head => {
                heads.push(name.clone());
                expect_head = false;
            }
            _ => {}
        }
        i += 1;
    }
    heads
}
