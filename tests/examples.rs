//! The producer examples in `examples/` against the real broker: each publishes one
//! job to a test's own topology with a 1 s delay, an in-process `postie serve` sends
//! it, and the SMTP sink must hold exactly that email (by its derived Message-ID), no
//! earlier than its due time.
//!
//! The Python, Node.js and Go examples need their client libraries. A missing one
//! fails the test with the command that installs it (never a silent pass):
//!
//! ```sh
//! pip install -r examples/python/requirements.txt
//! npm ci --prefix examples/node
//! apt-get install -y golang-go golang-github-rabbitmq-amqp091-go-dev
//! ```
//!
//! (The Go example is built in GOPATH mode against Debian's packaged amqp091-go, as
//! this machine cannot reach the Go module proxy.) The Rust example is compiled into
//! this test with `#[path]`, so the test runs the very code `cargo run --example
//! publish` runs, minus its `main`.

mod support;

#[path = "../examples/publish.rs"]
#[allow(dead_code)]
mod publish_example;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use postie::contract::IdempotencyKey;
use support::{amqp_url, eventually, TestEnv};

/// `x-delay` of every example job.
const DELAY_MS: i64 = 1000;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Runs a command to completion (at most 120 s) and returns its stdout, or panics with
/// its stderr.
async fn run(what: &str, cmd: &mut tokio::process::Command) -> String {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 120 s"))
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

/// Whether `program args…` runs and exits 0 (in `dir`).
fn works(program: &str, args: &[&str], dir: &Path) -> bool {
    std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The key from the example's `published key=<key> exchange=<x> delay_ms=<n>` line.
fn published_key(stdout: &str, exchange: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("published "))
        .unwrap_or_else(|| panic!("no \"published …\" line in {stdout:?}"));
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|part| part.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
            .to_string()
    };
    assert_eq!(field("exchange"), exchange, "{line}");
    assert_eq!(field("delay_ms"), DELAY_MS.to_string(), "{line}");
    field("key")
}

/// Environment variables every example reads.
fn example_env(env: &TestEnv, to: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AMQP_URL", amqp_url()),
        ("POSTIE_PREFIX", env.prefix.clone()),
        ("EMAIL_TO", to.to_string()),
        ("EMAIL_DELAY_MS", DELAY_MS.to_string()),
    ]
}

/// The sink receives exactly one email, the one for `key`, not before
/// `published_after_ms + DELAY_MS`; postie recorded it as sent.
async fn assert_sent_once(
    env: &TestEnv,
    key: &str,
    to: &str,
    published_after_ms: i64,
    language: &str,
) {
    let message_id = IdempotencyKey::parse(key)
        .expect("the example's key is valid")
        .message_id("postie.local");
    let id = &message_id;
    let message = eventually(
        &format!("the {language} example's email"),
        Duration::from_secs(60),
        || async move {
            env.sink
                .messages(true)
                .await
                .into_iter()
                .find(|m| &m.message_id == id)
        },
    )
    .await;
    let due = published_after_ms + DELAY_MS;
    assert!(
        message.received_at_ms >= due,
        "sent {} ms early (received at {}, due no earlier than {due})",
        due - message.received_at_ms,
        message.received_at_ms
    );
    assert_eq!(message.rcpt_to, vec![to.to_string()]);
    assert_eq!(message.subject, "Welcome!");
    let raw = message.raw.as_deref().unwrap_or_default();
    assert!(
        raw.contains(&format!("Hello from the {language} producer example.")),
        "{raw}"
    );

    // Exactly one: nothing else arrives, and postie recorded the key as sent.
    let row = eventually("the inbox row", Duration::from_secs(10), || async move {
        env.inbox_row(key).await.filter(|r| r.status == "sent")
    })
    .await;
    assert_eq!(row.attempts, 1, "{row:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = env.sink.messages(false).await;
    assert_eq!(all.len(), 1, "expected exactly one email: {all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_example_publishes_a_delayed_job_that_is_sent_once() {
    let dir = repo("examples/python");
    assert!(
        works("python3", &["-c", "import pika"], &dir),
        "the Python example needs python3 with pika: pip install -r examples/python/requirements.txt"
    );
    let env = TestEnv::new("ex-python").await;
    let serving = env.serve(env.settings());
    let to = "python@example.com";

    let before = now_ms();
    // No key given: the example makes one up and prints it.
    let stdout = run(
        "examples/python/publish.py",
        tokio::process::Command::new("python3")
            .arg(dir.join("publish.py"))
            .envs(example_env(&env, to)),
    )
    .await;
    let key = published_key(&stdout, &format!("{}.delayed", env.prefix));
    assert!(
        key.starts_with("demo-") && key.ends_with(":welcome"),
        "{key}"
    );

    assert_sent_once(&env, &key, to, before, "Python").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_example_publishes_a_delayed_job_that_is_sent_once() {
    let dir = repo("examples/node");
    assert!(
        works("node", &["-e", "require('amqplib')"], &dir),
        "the Node.js example needs node (18+) and its dependencies: npm ci --prefix examples/node"
    );
    let env = TestEnv::new("ex-node").await;
    let serving = env.serve(env.settings());
    let to = "node@example.com";
    let key = format!("order-{}:order_confirmation", uuid::Uuid::new_v4().simple());

    let before = now_ms();
    // Flags win over the environment: the recipient given as a flag is the one used.
    let stdout = run(
        "examples/node/publish.js",
        tokio::process::Command::new("node")
            .arg(dir.join("publish.js"))
            .args(["--key", &key, "--to", to])
            .envs(example_env(&env, "not-this-one@example.com")),
    )
    .await;
    assert_eq!(
        published_key(&stdout, &format!("{}.delayed", env.prefix)),
        key
    );

    assert_sent_once(&env, &key, to, before, "Node.js").await;
    serving.stop().await;
}

/// Debian's packaged amqp091-go, for a GOPATH-mode build without the module proxy.
const DEBIAN_GOPATH: &str = "/usr/share/gocode";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_example_publishes_a_delayed_job_that_is_sent_once() {
    let dir = repo("examples/go");
    assert!(
        works("go", &["version"], &dir)
            && Path::new(DEBIAN_GOPATH).join("src/github.com/rabbitmq/amqp091-go").is_dir(),
        "the Go example needs go and amqp091-go: apt-get install -y golang-go golang-github-rabbitmq-amqp091-go-dev"
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-example");
    let binary = out.join("publish");
    run(
        "go build (examples/go)",
        tokio::process::Command::new("go")
            .args(["build", "-o"])
            .arg(&binary)
            .arg(".")
            .current_dir(&dir)
            .env("GO111MODULE", "off")
            .env("GOPATH", DEBIAN_GOPATH)
            .env("GOCACHE", out.join("cache"))
            .env("GOFLAGS", ""),
    )
    .await;

    let env = TestEnv::new("ex-go").await;
    let serving = env.serve(env.settings());
    let to = "go@example.com";
    let key = format!("order-{}:order_confirmation", uuid::Uuid::new_v4().simple());

    let before = now_ms();
    let stdout = run(
        "examples/go",
        tokio::process::Command::new(&binary)
            .args(["-key", &key])
            .envs(example_env(&env, to)),
    )
    .await;
    assert_eq!(
        published_key(&stdout, &format!("{}.delayed", env.prefix)),
        key
    );

    assert_sent_once(&env, &key, to, before, "Go").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_example_publishes_a_delayed_job_that_is_sent_once() {
    let env = TestEnv::new("ex-rust").await;
    let serving = env.serve(env.settings());
    let to = "rust@example.com";
    let key = format!("order-{}:order_confirmation", uuid::Uuid::new_v4().simple());
    let vars: Vec<(&str, String)> = example_env(&env, to);
    let args = ["--key", &key].map(String::from);
    let options = publish_example::Options::from_args(args, |name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
    })
    .expect("options");
    assert_eq!(options.exchange(), format!("{}.delayed", env.prefix));
    assert_eq!(options.delay_ms, DELAY_MS);

    let before = now_ms();
    publish_example::publish(&options)
        .await
        .expect("the Rust example publishes");

    assert_sent_once(&env, &key, to, before, "Rust").await;
    serving.stop().await;
}

#[test]
fn rust_example_reads_flags_then_environment_then_defaults() {
    use publish_example::Options;
    let none = |_: &str| None;

    let defaults = Options::from_args(Vec::new(), none).unwrap();
    assert_eq!(defaults.amqp_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
    assert_eq!(defaults.prefix, "postie");
    assert_eq!(defaults.exchange(), "postie.delayed");
    assert_eq!(defaults.to, "alice@example.com");
    assert_eq!(defaults.delay_ms, 5000);
    assert!(
        IdempotencyKey::parse(&defaults.key).is_ok(),
        "{}",
        defaults.key
    );

    let env = |name: &str| match name {
        "POSTIE_PREFIX" => Some("env".to_string()),
        "EMAIL_DELAY_MS" => Some("250".to_string()),
        "EMAIL_KEY" => Some("from-env".to_string()),
        _ => None,
    };
    let args = [
        "--prefix",
        "flag",
        "--delay-ms=-5",
        "--to",
        "bob@example.com",
    ]
    .map(String::from);
    let o = Options::from_args(args, env).unwrap();
    assert_eq!(o.prefix, "flag");
    assert_eq!(o.delay_ms, 0, "a negative delay means now");
    assert_eq!(o.to, "bob@example.com");
    assert_eq!(o.key, "from-env");

    for bad in [
        vec!["--delay-ms", "1.5"],
        vec!["--delay-ms"],
        vec!["--colour", "red"],
        vec!["stray"],
    ] {
        let args = bad.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(Options::from_args(args, none).is_err(), "{bad:?}");
    }
}
