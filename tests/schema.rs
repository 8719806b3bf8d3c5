//! The shipped JSON Schema of the job body (`schema/email-job.v1.json`) and the
//! runtime parser (`postie::testing::contract::EmailJob::parse`) must agree on every case in
//! `tests/jobs/`:
//!
//! - `valid/`: accepted by both;
//! - `invalid/`: rejected by both;
//! - `parser-only-invalid/`: rejected by the parser, for a rule the schema cannot
//!   express (it must still pass the schema, so a case the schema learns to
//!   express moves to `invalid/`).
//!
//! The schema's own `examples` must be accepted by both as well.

use std::fs;
use std::path::{Path, PathBuf};

use postie::testing::contract::{EmailJob, ParseRules};
use serde_json::Value;

const RULES: ParseRules<'static> = ParseRules {
    max_body_bytes: 512 * 1024,
    default_from: None,
    key_namespace: postie::config::KeyNamespace::Off,
    user_id: None,
    attachments: postie::testing::contract::AttachmentLimits::DEFAULT,
};

fn manifest_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn load_schema() -> Value {
    let path = manifest_path("schema/email-job.v1.json");
    let text =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn validator() -> jsonschema::Validator {
    let schema = load_schema();
    if let Err(e) = jsonschema::meta::validate(&schema) {
        panic!("schema/email-job.v1.json is not a valid JSON Schema: {e}");
    }
    jsonschema::validator_for(&schema)
        .unwrap_or_else(|e| panic!("schema/email-job.v1.json does not compile: {e}"))
}

/// Every `*.json` file in `tests/jobs/<dir>`, sorted, with its bytes. Panics on an
/// empty directory so that no check can pass vacuously.
fn cases(dir: &str) -> Vec<(String, Vec<u8>)> {
    let path = manifest_path(&format!("tests/jobs/{dir}"));
    let entries = fs::read_dir(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "{} holds no *.json case: the test would pass vacuously",
        path.display()
    );
    files
        .into_iter()
        .map(|file| {
            let bytes =
                fs::read(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            (format!("tests/jobs/{dir}/{}", file_name(&file)), bytes)
        })
        .collect()
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned()
}

/// The case as JSON. Every case is well-formed JSON, so "rejected by the schema"
/// never means "could not be read".
fn as_json(name: &str, bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"))
}

/// The schema's reasons for rejecting `instance`, empty if it is valid.
fn schema_errors(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator
        .iter_errors(instance)
        .map(|e| format!("at {:?}: {e}", e.instance_path.to_string()))
        .collect()
}

#[test]
fn schema_is_a_valid_draft_2020_12_schema() {
    let schema = load_schema();
    assert_eq!(
        schema["$schema"], "https://json-schema.org/draft/2020-12/schema",
        "schema/email-job.v1.json must declare draft 2020-12"
    );
    assert_eq!(
        schema["$id"],
        "https://postie.example/schema/email-job.v1.json"
    );
    validator();
}

#[test]
fn valid_jobs_pass_the_schema_and_the_parser() {
    let validator = validator();
    let mut failures = Vec::new();
    for (name, bytes) in cases("valid") {
        let errors = schema_errors(&validator, &as_json(&name, &bytes));
        if !errors.is_empty() {
            failures.push(format!("{name}: rejected by the schema: {errors:?}"));
        }
        if let Err(e) = EmailJob::parse(&bytes, &RULES) {
            failures.push(format!("{name}: rejected by the parser: {e}"));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn invalid_jobs_fail_the_schema_and_the_parser() {
    let validator = validator();
    let mut failures = Vec::new();
    for (name, bytes) in cases("invalid") {
        if validator.is_valid(&as_json(&name, &bytes)) {
            failures.push(format!("{name}: accepted by the schema"));
        }
        if let Ok(job) = EmailJob::parse(&bytes, &RULES) {
            failures.push(format!("{name}: accepted by the parser as key {}", job.key));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn parser_only_invalid_jobs_fail_the_parser_but_not_the_schema() {
    let validator = validator();
    let mut failures = Vec::new();
    for (name, bytes) in cases("parser-only-invalid") {
        if let Ok(job) = EmailJob::parse(&bytes, &RULES) {
            failures.push(format!("{name}: accepted by the parser as key {}", job.key));
        }
        let errors = schema_errors(&validator, &as_json(&name, &bytes));
        if !errors.is_empty() {
            failures.push(format!(
                "{name}: the schema rejects it too, so it belongs in tests/jobs/invalid/: {errors:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn schema_examples_pass_the_schema_and_the_parser() {
    let schema = load_schema();
    let validator = validator();
    let examples = schema["examples"]
        .as_array()
        .expect("schema/email-job.v1.json has an \"examples\" array");
    assert!(
        !examples.is_empty(),
        "schema/email-job.v1.json \"examples\" is empty"
    );
    let mut failures = Vec::new();
    for (i, example) in examples.iter().enumerate() {
        let name = format!("schema/email-job.v1.json examples[{i}]");
        let errors = schema_errors(&validator, example);
        if !errors.is_empty() {
            failures.push(format!("{name}: rejected by the schema: {errors:?}"));
        }
        let bytes = serde_json::to_vec(example).expect("serialising an example");
        if let Err(e) = EmailJob::parse(&bytes, &RULES) {
            failures.push(format!("{name}: rejected by the parser: {e}"));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn the_design_example_is_among_the_examples_and_the_valid_cases() {
    let schema = load_schema();
    let design = as_json(
        "tests/jobs/valid/design-example.json",
        &fs::read(manifest_path("tests/jobs/valid/design-example.json"))
            .expect("tests/jobs/valid/design-example.json exists"),
    );
    assert_eq!(
        design["key"], "order-42:order_confirmation",
        "tests/jobs/valid/design-example.json is the contract example of the README"
    );
    let examples = schema["examples"].as_array().expect("an examples array");
    assert!(
        examples.contains(&design),
        "schema/email-job.v1.json \"examples\" lacks the contract example of the README"
    );
}
