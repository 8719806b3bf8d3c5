//! The guard: the SQL the model mirrors is the SQL it was checked against.

use postie_model::sql::{sha256, MIRRORED};

#[test]
fn the_model_mirrors_the_sql_postie_runs() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let mut changed = vec![];
    for m in MIRRORED {
        let path = format!("{root}/{}", m.file);
        let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let text = m.text(&source).unwrap_or_else(|e| panic!("{e}"));
        let now = sha256(text);
        if now != m.sha256 {
            changed.push(format!(
                "  {} in {}: sha256 {now} (the model has {:?})",
                m.what, m.file, m.sha256
            ));
        }
    }
    assert!(
        changed.is_empty(),
        "SQL the model mirrors has changed:\n{}\n\
         Update the model to match (tests/model/src/inbox.rs and the steps that use it), \
         run `make model` and `cargo test -p postie-model`, then put the new digests in \
         tests/model/src/sql.rs.",
        changed.join("\n")
    );
}
