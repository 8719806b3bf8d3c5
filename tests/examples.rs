//! Each language's delivery-event consumer (`events.py`, `events.js`, `publish
//! events` in Go, `cargo run --example events`) binds its queue, and prints the `sent`
//! event of a job postie sends, then exits (`--count 1`).
//!
//! The producer examples in `examples/` against the real broker: each publishes one
//! job to a test's own topology with a 1 s delay, an in-process `postie serve` sends
//! it, and the SMTP sink must hold exactly that email (by its derived Message-ID), no
//! earlier than its due time. In bulk mode (`--count 50 --window 10`, pipelined
//! publisher confirms) each must deliver 50 distinct emails, each once, none early.
//!
//! The outbox variants (`outbox.py`, `outbox.js`, `publish outbox` in Go, `cargo run
//! --example outbox`; issue 31) each write an order and enqueue its email in one
//! transaction of a producer database of the test's own, where `postie outbox
//! install` made the outbox, and `postie serve` relays it: a committed order's email
//! is sent once, a rolled-back one's never.
//!
//! The Python, Node.js and Go examples need their client libraries. A missing one
//! fails the test with the command that installs it (never a silent pass):
//!
//! ```sh
//! pip install -r examples/python/requirements.txt
//! npm ci --prefix examples/node
//! apt-get install -y golang-go golang-github-rabbitmq-amqp091-go-dev golang-github-jackc-pgx-v4-dev
//! ```
//!
//! (The Go example is built in GOPATH mode against Debian's packaged amqp091-go, as
//! this machine cannot reach the Go module proxy; once for the whole suite, into
//! `target/tmp/go-examples/`, and rebuilt only when its sources, `go version` or the
//! packaged libraries change: see `go_example`.) The Rust example is compiled into
//! this test with `#[path]`, so the test runs the very code `cargo run --example
//! publish` runs, minus its `main`.

mod support;

#[path = "../examples/publish.rs"]
#[allow(dead_code)]
mod publish_example;

#[path = "../examples/events.rs"]
#[allow(dead_code)]
mod events_example;

#[path = "../examples/outbox.rs"]
#[allow(dead_code)]
mod outbox_example;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use postie::testing::contract::IdempotencyKey;
use support::{admin_sql_in, amqp_url, eventually, pg_admin, pg_base, TestEnv};

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
    let keys = published_keys(stdout, exchange);
    assert_eq!(keys.len(), 1, "one job, one line: {stdout:?}");
    assert!(
        !stdout.contains(" jobs in "),
        "no summary line for one job: {stdout:?}"
    );
    keys.into_iter().next().unwrap()
}

/// The keys from every `published key=<key> exchange=<x> delay_ms=<n>` line, in order.
fn published_keys(stdout: &str, exchange: &str) -> Vec<String> {
    let keys: Vec<String> = stdout
        .lines()
        .filter(|l| l.starts_with("published key="))
        .map(|line| job_line_key(line, exchange))
        .collect();
    assert!(
        !keys.is_empty(),
        "no \"published key=…\" line in {stdout:?}"
    );
    keys
}

/// The bulk examples' last line: `published N jobs in S s (R jobs/s, window W)`.
fn assert_summary(stdout: &str, count: usize, window: usize) {
    let line = stdout.lines().last().unwrap_or_default();
    let words: Vec<&str> = line.split_whitespace().collect();
    let ok = matches!(
        words.as_slice(),
        ["published", n, "jobs", "in", s, "s", r, "jobs/s,", "window", w]
            if *n == count.to_string()
                && s.parse::<f64>().is_ok()
                && r.strip_prefix('(').is_some_and(|r| r.parse::<f64>().is_ok())
                && *w == format!("{window})")
    );
    assert!(ok, "summary line {line:?} in {stdout:?}");
}

/// The key of one `published key=<key> exchange=<x> delay_ms=<n>` line.
fn job_line_key(line: &str, exchange: &str) -> String {
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
    let text = format!("Hello from the {language} producer example.");
    let email = Email {
        key,
        to,
        subject: "Welcome!",
        text: &text,
    };
    assert_one_email(env, &email, published_after_ms + DELAY_MS, language).await;
}

/// What an example's email must say.
struct Email<'a> {
    key: &'a str,
    to: &'a str,
    subject: &'a str,
    /// A line of the body.
    text: &'a str,
}

/// The sink receives exactly one email, `email`, not before `due_ms`; postie
/// recorded its key as sent at the first attempt.
async fn assert_one_email(env: &TestEnv, email: &Email<'_>, due_ms: i64, language: &str) {
    let message_id = IdempotencyKey::parse(email.key)
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
    assert!(
        message.received_at_ms >= due_ms,
        "sent {} ms early (received at {}, due no earlier than {due_ms})",
        due_ms - message.received_at_ms,
        message.received_at_ms
    );
    assert_eq!(message.rcpt_to, vec![email.to.to_string()]);
    assert_eq!(message.subject, email.subject);
    let raw = message.raw.as_deref().unwrap_or_default();
    assert!(raw.contains(email.text), "{raw}");

    // Exactly one: nothing else arrives, and postie recorded the key as sent.
    let key = email.key;
    let row = eventually("the inbox row", Duration::from_secs(10), || async move {
        env.inbox_row(key).await.filter(|r| r.status == "sent")
    })
    .await;
    assert_eq!(row.attempts, 1, "{row:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = env.sink.messages(false).await;
    assert_eq!(all.len(), 1, "expected exactly one email: {all:?}");
}

/// Jobs in a bulk test.
const BULK_COUNT: usize = 50;
/// Unconfirmed publishes at most, in a bulk test.
const BULK_WINDOW: usize = 10;

/// The bulk flags the Python, Node.js and Go tests pass (Go takes `-flag` too).
fn bulk_args(key: &str) -> Vec<String> {
    vec![
        "--key".into(),
        key.into(),
        "--count".into(),
        BULK_COUNT.to_string(),
        "--window".into(),
        BULK_WINDOW.to_string(),
    ]
}

/// The keys were `<key>-0` … `<key>-49` (each once, in any order), and the sink
/// receives exactly those 50 emails, each once, none before
/// `published_after_ms + DELAY_MS`.
async fn assert_bulk_sent_once(
    env: &TestEnv,
    key: &str,
    published: Vec<String>,
    to: &str,
    published_after_ms: i64,
    language: &str,
) {
    let mut sorted = published.clone();
    sorted.sort();
    let mut expected: Vec<String> = (0..BULK_COUNT).map(|i| format!("{key}-{i}")).collect();
    expected.sort();
    assert_eq!(sorted, expected, "published keys");

    let ids: std::collections::BTreeMap<String, &String> = published
        .iter()
        .map(|k| {
            let id = IdempotencyKey::parse(k)
                .expect("the example's key is valid")
                .message_id("postie.local");
            (id, k)
        })
        .collect();
    let ids = &ids;
    eventually(
        &format!("the {language} example's {BULK_COUNT} emails"),
        Duration::from_secs(60),
        || async move {
            let count = env.sink.count().await;
            (count >= ids.len()).then_some(())
        },
    )
    .await;
    // Anything extra (a duplicate) has had time to arrive too.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = env.sink.messages(true).await;
    let due = published_after_ms + DELAY_MS;
    let mut seen = std::collections::BTreeSet::new();
    for m in &all {
        let key = ids
            .get(&m.message_id)
            .unwrap_or_else(|| panic!("an email for no published key: {m:?}"));
        assert!(seen.insert(&m.message_id), "{key} sent twice");
        assert!(
            m.received_at_ms >= due,
            "{key} sent {} ms early (received at {}, due no earlier than {due})",
            due - m.received_at_ms,
            m.received_at_ms
        );
        assert_eq!(m.rcpt_to, vec![to.to_string()], "{key}");
        assert_eq!(m.subject, "Welcome!", "{key}");
        let raw = m.raw.as_deref().unwrap_or_default();
        assert!(
            raw.contains(&format!("Hello from the {language} producer example.")),
            "{raw}"
        );
    }
    assert_eq!(all.len(), BULK_COUNT, "one email per key");
    // postie recorded each as sent at the first attempt.
    let sent = env
        .inbox_count(&format!(
            "key LIKE '{key}-%' AND status = 'sent' AND attempts = 1"
        ))
        .await;
    assert_eq!(
        sent, BULK_COUNT as i64,
        "inbox rows sent at the first attempt"
    );
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

/// The Go example's binary, built once for the whole suite (nextest runs each test in
/// its own process, possibly at the same time) and reused after: in
/// `CARGO_TARGET_TMPDIR/go-examples/<hash>/publish`, where the hash covers the
/// example's sources, `go version`, the packaged libraries in [`DEBIAN_GOPATH`]
/// (each file's path, size and modification time) and the build flags, so any change
/// builds afresh. One process builds, under an exclusive `flock` of the directory's
/// `lock` file (released by the kernel even if that process dies), while the others
/// wait on it and then find the binary; it is written under a temporary name and
/// renamed into place, so a half-written binary is never run. The Go build cache
/// (`go-examples/cache`) is shared, so a changed source rebuilds little.
async fn go_example() -> PathBuf {
    let dir = repo("examples/go");
    let go_version = std::process::Command::new("go")
        .arg("version")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| o.stdout);
    assert!(
        go_version.is_some()
            && Path::new(DEBIAN_GOPATH).join("src/github.com/rabbitmq/amqp091-go").is_dir()
            && Path::new(DEBIAN_GOPATH).join("src/github.com/jackc/pgx/v4").is_dir(),
        "the Go example needs go, amqp091-go and pgx v4: apt-get install -y golang-go golang-github-rabbitmq-amqp091-go-dev golang-github-jackc-pgx-v4-dev"
    );
    const BUILD_ENV: [(&str, &str); 3] = [
        ("GO111MODULE", "off"),
        ("GOPATH", DEBIAN_GOPATH),
        ("GOFLAGS", ""),
    ];

    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update(go_version.unwrap());
    hash.update(format!("{BUILD_ENV:?}"));
    for file in files_under(&dir) {
        hash.update(
            file.strip_prefix(&dir)
                .unwrap()
                .to_string_lossy()
                .as_bytes(),
        );
        hash.update([0]);
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    }
    let libraries = Path::new(DEBIAN_GOPATH).join("src");
    for file in files_under(&libraries) {
        let meta = std::fs::metadata(&file).ok();
        let modified = meta
            .as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default();
        hash.update(file.to_string_lossy().as_bytes());
        hash.update([0]);
        hash.update(meta.map_or(0, |m| m.len()).to_le_bytes());
        hash.update(modified.as_nanos().to_le_bytes());
    }
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-examples");
    let out = root.join(&hex::encode(hash.finalize())[..16]);
    let binary = out.join("publish");
    if binary.is_file() {
        return binary;
    }

    std::fs::create_dir_all(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(out.join("lock"))
        .unwrap_or_else(|e| panic!("{}/lock: {e}", out.display()));
    // Blocks until no other test process builds; the lock goes with `lock`'s close.
    let lock = tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor this closure owns (through `lock`).
        while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            let error = std::io::Error::last_os_error();
            assert_eq!(
                error.kind(),
                std::io::ErrorKind::Interrupted,
                "flock: {error}"
            );
        }
        lock
    })
    .await
    .unwrap();
    if !binary.is_file() {
        let partial = out.join(format!("publish.partial-{}", std::process::id()));
        run(
            "go build (examples/go)",
            tokio::process::Command::new("go")
                .args(["build", "-o"])
                .arg(&partial)
                .arg(".")
                .current_dir(&dir)
                .envs(BUILD_ENV)
                .env("GOCACHE", root.join("cache")),
        )
        .await;
        std::fs::rename(&partial, &binary)
            .unwrap_or_else(|e| panic!("rename to {}: {e}", binary.display()));
    }
    drop(lock);
    binary
}

/// Every file under `dir`, recursively, sorted by path.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push(entry.path()),
                Ok(_) => files.push(entry.path()),
                Err(_) => {}
            }
        }
    }
    files.sort();
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_example_publishes_a_delayed_job_that_is_sent_once() {
    let binary = go_example().await;

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
    let mut confirmed = Vec::new();
    publish_example::publish(&options, |k| confirmed.push(k.to_string()))
        .await
        .expect("the Rust example publishes");
    assert_eq!(confirmed, [key.as_str()]);

    assert_sent_once(&env, &key, to, before, "Rust").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_example_publishes_many_jobs_with_pipelined_confirms() {
    let dir = repo("examples/python");
    assert!(
        works("python3", &["-c", "import pika"], &dir),
        "the Python example needs python3 with pika: pip install -r examples/python/requirements.txt"
    );
    let env = TestEnv::new("ex-python-bulk").await;
    let serving = env.serve(env.settings());
    let to = "python@example.com";
    let key = format!("import-{}:welcome", uuid::Uuid::new_v4().simple());

    let before = now_ms();
    let stdout = run(
        "examples/python/publish.py (bulk)",
        tokio::process::Command::new("python3")
            .arg(dir.join("publish.py"))
            .args(bulk_args(&key))
            .envs(example_env(&env, to)),
    )
    .await;
    assert_summary(&stdout, BULK_COUNT, BULK_WINDOW);
    let keys = published_keys(&stdout, &format!("{}.delayed", env.prefix));

    assert_bulk_sent_once(&env, &key, keys, to, before, "Python").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_example_publishes_many_jobs_with_pipelined_confirms() {
    let dir = repo("examples/node");
    assert!(
        works("node", &["-e", "require('amqplib')"], &dir),
        "the Node.js example needs node (18+) and its dependencies: npm ci --prefix examples/node"
    );
    let env = TestEnv::new("ex-node-bulk").await;
    let serving = env.serve(env.settings());
    let to = "node@example.com";
    let key = format!("import-{}:welcome", uuid::Uuid::new_v4().simple());

    let before = now_ms();
    // The count and window from the environment this time.
    let mut vars = example_env(&env, to);
    vars.push(("EMAIL_COUNT", BULK_COUNT.to_string()));
    vars.push(("EMAIL_WINDOW", BULK_WINDOW.to_string()));
    let stdout = run(
        "examples/node/publish.js (bulk)",
        tokio::process::Command::new("node")
            .arg(dir.join("publish.js"))
            .args(["--key", &key])
            .envs(vars),
    )
    .await;
    assert_summary(&stdout, BULK_COUNT, BULK_WINDOW);
    let keys = published_keys(&stdout, &format!("{}.delayed", env.prefix));

    assert_bulk_sent_once(&env, &key, keys, to, before, "Node.js").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_example_publishes_many_jobs_with_pipelined_confirms() {
    let binary = go_example().await;
    let env = TestEnv::new("ex-go-bulk").await;
    let serving = env.serve(env.settings());
    let to = "go@example.com";
    let key = format!("import-{}:welcome", uuid::Uuid::new_v4().simple());

    let before = now_ms();
    let stdout = run(
        "examples/go (bulk)",
        tokio::process::Command::new(&binary)
            .args(bulk_args(&key))
            .envs(example_env(&env, to)),
    )
    .await;
    assert_summary(&stdout, BULK_COUNT, BULK_WINDOW);
    let keys = published_keys(&stdout, &format!("{}.delayed", env.prefix));

    assert_bulk_sent_once(&env, &key, keys, to, before, "Go").await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_example_publishes_many_jobs_with_pipelined_confirms() {
    let env = TestEnv::new("ex-rust-bulk").await;
    let serving = env.serve(env.settings());
    let to = "rust@example.com";
    let key = format!("import-{}:welcome", uuid::Uuid::new_v4().simple());
    let vars: Vec<(&str, String)> = example_env(&env, to);
    let options = publish_example::Options::from_args(bulk_args(&key), |name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
    })
    .expect("options");
    assert_eq!((options.count, options.window), (50, 10));

    let before = now_ms();
    let mut keys = Vec::new();
    publish_example::publish(&options, |k| keys.push(k.to_string()))
        .await
        .expect("the Rust example publishes");

    assert_bulk_sent_once(&env, &key, keys, to, before, "Rust").await;
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
    assert_eq!((defaults.count, defaults.window), (1, 256));
    assert_eq!(defaults.keys(), [defaults.key.as_str()]);
    assert!(
        IdempotencyKey::parse(&defaults.key).is_ok(),
        "{}",
        defaults.key
    );

    let env = |name: &str| match name {
        "POSTIE_PREFIX" => Some("env".to_string()),
        "EMAIL_DELAY_MS" => Some("250".to_string()),
        "EMAIL_KEY" => Some("from-env".to_string()),
        "EMAIL_COUNT" => Some("3".to_string()),
        "EMAIL_WINDOW" => Some("7".to_string()),
        _ => None,
    };
    let args = [
        "--prefix",
        "flag",
        "--delay-ms=-5",
        "--to",
        "bob@example.com",
        "--window=2",
    ]
    .map(String::from);
    let o = Options::from_args(args, env).unwrap();
    assert_eq!(o.prefix, "flag");
    assert_eq!(o.delay_ms, 0, "a negative delay means now");
    assert_eq!(o.to, "bob@example.com");
    assert_eq!(o.key, "from-env");
    assert_eq!((o.count, o.window), (3, 2));
    assert_eq!(o.keys(), ["from-env-0", "from-env-1", "from-env-2"]);

    for bad in [
        vec!["--delay-ms", "1.5"],
        vec!["--delay-ms"],
        vec!["--count", "0"],
        vec!["--count", "-1"],
        vec!["--window", "0"],
        vec!["--window", "many"],
        vec!["--colour", "red"],
        vec!["stray"],
    ] {
        let args = bad.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(Options::from_args(args, none).is_err(), "{bad:?}");
    }
}

/// A consumer example's `event …` line, as its fields.
fn event_fields(line: &str) -> std::collections::BTreeMap<String, String> {
    line.strip_prefix("event ")
        .unwrap_or_else(|| panic!("not an event line: {line:?}"))
        .split_whitespace()
        .filter_map(|part| part.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Runs a consumer example (`--count 1`, its settings from the environment), waits
/// until it says it listens, has postie send one job, and checks the one event line
/// it printed before it exited.
async fn consumer_example_prints_the_sent_event(
    name: &str,
    language: &str,
    cmd: &mut tokio::process::Command,
) {
    use tokio::io::AsyncBufReadExt;
    let env = TestEnv::new(name).await;
    cmd.envs(example_env(&env, "unused@example.com"))
        .env("EVENTS_COUNT", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the {language} consumer: {e}"));
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("the {language} consumer did not listen within 60 s"))
        .unwrap()
        .unwrap_or_default();
    assert!(
        first.starts_with("listening queue=producer.events-")
            && first.contains(&format!(" exchange={}.events ", env.prefix))
            && first.ends_with(" binding=email.#"),
        "{language}: {first:?}"
    );
    let serving = env.serve(env.settings());
    let key = format!("order-{}:welcome", uuid::Uuid::new_v4().simple());
    let mut job = support::job(&key, "events@example.com");
    job["type"] = serde_json::json!("welcome");
    env.publish(&job).await;
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .unwrap_or_else(|_| panic!("the {language} consumer did not exit within 60 s"))
        .unwrap();
    let mut rest = Vec::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        rest.push(line);
    }
    assert!(status.success(), "{language}: {status} {rest:?}");
    assert_eq!(rest.len(), 1, "{language}: {rest:?}");
    let fields = event_fields(&rest[0]);
    assert_eq!(fields["outcome"], "sent", "{language}");
    assert_eq!(fields["key"], key, "{language}");
    assert_eq!(fields["type"], "welcome", "{language}");
    assert_eq!(fields["routing_key"], "email.sent.welcome", "{language}");
    assert!(
        fields["id"].parse::<u64>().is_ok(),
        "{language}: {fields:?}"
    );
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_example_consumes_delivery_events() {
    let dir = repo("examples/python");
    assert!(
        works("python3", &["-c", "import pika"], &dir),
        "the Python example needs python3 with pika: pip install -r examples/python/requirements.txt"
    );
    let mut cmd = tokio::process::Command::new("python3");
    cmd.arg(dir.join("events.py"));
    consumer_example_prints_the_sent_event("ex-events-python", "Python", &mut cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_example_consumes_delivery_events() {
    let dir = repo("examples/node");
    assert!(
        works("node", &["-e", "require('amqplib')"], &dir),
        "the Node.js example needs node (18+) and its dependencies: npm ci --prefix examples/node"
    );
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(dir.join("events.js"));
    consumer_example_prints_the_sent_event("ex-events-node", "Node.js", &mut cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_example_consumes_delivery_events() {
    let binary = go_example().await;
    let mut cmd = tokio::process::Command::new(&binary);
    cmd.arg("events");
    consumer_example_prints_the_sent_event("ex-events-go", "Go", &mut cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_example_consumes_delivery_events() {
    let env = TestEnv::new("ex-events-rust").await;
    let vars: Vec<(&str, String)> = example_env(&env, "unused@example.com");
    let mut options = events_example::Options::from_args(["--count", "1"].map(String::from), |n| {
        vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.clone())
    })
    .expect("options");
    assert_eq!(options.exchange(), format!("{}.events", env.prefix));
    assert_eq!(
        (options.binding.as_str(), options.queue.as_deref()),
        ("email.#", None)
    );
    options.binding = "email.sent.*".into();
    let (listening, listened) = tokio::sync::oneshot::channel();
    let consumer = tokio::spawn(async move {
        let mut got = Vec::new();
        events_example::consume(
            &options,
            |queue| {
                let _ = listening.send(queue.to_string());
            },
            |e| got.push(e.clone()),
        )
        .await
        .map_err(|e| e.to_string())
        .map(|()| got)
    });
    let queue = tokio::time::timeout(Duration::from_secs(60), listened)
        .await
        .expect("the Rust consumer listens within 60 s")
        .unwrap();
    assert!(queue.starts_with("producer.events-"), "{queue}");
    let serving = env.serve(env.settings());
    let key = format!("order-{}:welcome", uuid::Uuid::new_v4().simple());
    let mut job = support::job(&key, "events@example.com");
    job["type"] = serde_json::json!("welcome");
    env.publish(&job).await;
    let got = tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .expect("the Rust consumer ends within 60 s")
        .unwrap()
        .expect("the Rust consumer");
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        (
            got[0].outcome.as_str(),
            got[0].key.as_str(),
            got[0].kind.as_str()
        ),
        ("sent", key.as_str(), "welcome")
    );
    assert_eq!(got[0].routing_key, "email.sent.welcome");
    serving.stop().await;
}

// --- The outbox variants (issue 31) -------------------------------------------------

/// A producer's own database, with postie's outbox installed by `postie outbox
/// install`; dropped by [`ProducerDb::drop_db`].
struct ProducerDb {
    name: String,
    url: String,
}

impl ProducerDb {
    async fn new(env: &TestEnv) -> Self {
        let name = format!("{}_producer", env.db_name);
        admin_sql_in("postgres", &format!("CREATE DATABASE {name}")).await;
        let url = format!("{}/{name}", pg_base());
        env.postie(&["outbox", "install", "--database", &url])
            .expect("postie outbox install");
        Self { name, url }
    }

    async fn drop_db(self) {
        admin_sql_in(
            "postgres",
            &format!("DROP DATABASE {} WITH (FORCE)", self.name),
        )
        .await;
    }
}

/// An outbox example, by language.
enum Producer {
    Python,
    Node,
    /// The Go example's binary (`publish outbox …`).
    Go(PathBuf),
    /// `examples/outbox.rs`, compiled into this test.
    Rust,
}

/// Runs the outbox example with `args` and the environment `vars`; its stdout.
async fn run_outbox(producer: &Producer, args: &[String], vars: &[(&str, String)]) -> String {
    let vars = vars.iter().map(|(k, v)| (*k, v.as_str()));
    match producer {
        Producer::Python => {
            let mut cmd = tokio::process::Command::new("python3");
            cmd.arg(repo("examples/python/outbox.py"));
            run("examples/python/outbox.py", cmd.args(args).envs(vars)).await
        }
        Producer::Node => {
            let mut cmd = tokio::process::Command::new("node");
            cmd.arg(repo("examples/node/outbox.js"));
            run("examples/node/outbox.js", cmd.args(args).envs(vars)).await
        }
        Producer::Go(binary) => {
            let mut cmd = tokio::process::Command::new(binary);
            cmd.arg("outbox");
            run("examples/go outbox", cmd.args(args).envs(vars)).await
        }
        Producer::Rust => {
            let vars: Vec<(&str, &str)> = vars.collect();
            let options = outbox_example::Options::from_args(args.to_vec(), |name| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            })
            .expect("options");
            let id = outbox_example::enqueue(&options)
                .await
                .expect("the Rust outbox example enqueues");
            options.outcome(id)
        }
    }
}

/// One order rolled back, one committed, each with its email enqueued in the same
/// transaction through the example: the committed one's email is sent once, not
/// before its due time counted from the enqueue; the rolled-back one's never; the
/// producer's database holds the committed order only, and its outbox is emptied.
async fn outbox_example_sends_committed_orders_once(
    name: &str,
    language: &str,
    producer: Producer,
) {
    let env = TestEnv::new(name).await;
    let producer_db = ProducerDb::new(&env).await;
    let mut settings = env.settings();
    settings.outbox.sources = vec![secrecy::SecretString::from(producer_db.url.clone())];
    let serving = env.serve(settings);
    let to = format!("{name}@example.com");
    let vars = [
        ("PRODUCER_DATABASE_URL", producer_db.url.clone()),
        ("EMAIL_TO", to.clone()),
        ("EMAIL_DELAY_MS", DELAY_MS.to_string()),
    ];
    let order = uuid::Uuid::new_v4().simple().to_string();
    let (rolled, committed) = (format!("{order}-r"), format!("{order}-c"));
    let key_of = |id: &str| format!("order-{id}:order_confirmation");

    let args = ["--order-id", &rolled, "--rollback"].map(String::from);
    let stdout = run_outbox(&producer, &args, &vars).await;
    assert_eq!(
        stdout.trim(),
        format!("rolled back key={}", key_of(&rolled))
    );

    let before = now_ms();
    let args = ["--order-id", &committed].map(String::from);
    let stdout = run_outbox(&producer, &args, &vars).await;
    let enqueued = format!("enqueued key={} outbox_id=", key_of(&committed));
    assert!(stdout.trim().starts_with(&enqueued), "{stdout}");

    let key = key_of(&committed);
    let subject = format!("Order {committed} confirmed");
    let text = format!("Hello from the {language} outbox example.");
    let email = Email {
        key: &key,
        to: &to,
        subject: &subject,
        text: &text,
    };
    // Exactly one email in the sink: the rolled-back order's never came.
    assert_one_email(&env, &email, before + DELAY_MS, language).await;
    assert!(env.inbox_row(&key_of(&rolled)).await.is_none());

    let db = pg_admin(&producer_db.name).await;
    let orders: Vec<String> = db
        .query("SELECT id FROM example_orders", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        orders,
        std::slice::from_ref(&committed),
        "only the committed order"
    );
    let db = &db;
    eventually(
        "the outbox emptied",
        Duration::from_secs(10),
        || async move {
            let row = db
                .query_one("SELECT count(*) FROM postie.outbox", &[])
                .await
                .unwrap();
            (row.get::<_, i64>(0) == 0).then_some(())
        },
    )
    .await;
    serving.stop().await;
    producer_db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_outbox_example_sends_committed_orders_once() {
    let dir = repo("examples/python");
    assert!(
        works("python3", &["-c", "import psycopg"], &dir),
        "the Python outbox example needs python3 with psycopg: pip install -r examples/python/requirements.txt"
    );
    outbox_example_sends_committed_orders_once("ex-py-outbox", "Python", Producer::Python).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_outbox_example_sends_committed_orders_once() {
    let dir = repo("examples/node");
    assert!(
        works("node", &["-e", "require('pg')"], &dir),
        "the Node.js outbox example needs node (18+) and its dependencies: npm ci --prefix examples/node"
    );
    outbox_example_sends_committed_orders_once("ex-node-outbox", "Node.js", Producer::Node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_outbox_example_sends_committed_orders_once() {
    let binary = go_example().await;
    outbox_example_sends_committed_orders_once("ex-go-outbox", "Go", Producer::Go(binary)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_outbox_example_sends_committed_orders_once() {
    outbox_example_sends_committed_orders_once("ex-rust-outbox", "Rust", Producer::Rust).await;
}

#[test]
fn rust_outbox_example_reads_flags_then_environment_then_defaults() {
    use outbox_example::Options;
    let none = |_: &str| None;
    let defaults = Options::from_args(Vec::new(), none).unwrap();
    assert_eq!(
        defaults.database_url,
        "postgres://postgres@127.0.0.1:5432/shop"
    );
    assert_eq!((defaults.delay_ms, defaults.rollback), (5000, false));
    assert!(IdempotencyKey::parse(&defaults.key()).is_ok());

    let env = |name: &str| (name == "ORDER_ID").then(|| "42".to_string());
    let args = ["--delay-ms", "250", "--rollback"].map(String::from);
    let o = Options::from_args(args, env).unwrap();
    assert_eq!(o.key(), "order-42:order_confirmation");
    assert_eq!((o.delay_ms, o.rollback), (250, true));
    assert_eq!(o.outcome(7), "rolled back key=order-42:order_confirmation");

    for bad in [vec!["--delay-ms", "soon"], vec!["--to"], vec!["stray"]] {
        let args = bad.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(Options::from_args(args, none).is_err(), "{bad:?}");
    }
}
