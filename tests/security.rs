//! Transport security: the start-up refusal of plaintext PostgreSQL to a remote host
//! (before any connection), verified TLS to the local PostgreSQL, STARTTLS required by
//! default for SMTP relays that are not this machine, and `amqps://` through a local
//! TLS terminator.

mod support;

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postie::config::{DatabaseSettings, Settings};
use postie::testing::inbox::Inbox;
use postie::testing::mail::{Clearance, Email, Mailer, SendError};
use secrecy::SecretString;
use support::{amqp_url, free_port, pg_admin, pg_base, TestEnv};

/// `postie ARGS` with exactly `env`: (exit code, stdout, stderr).
fn run_postie(args: &[&str], env: &[(String, String)]) -> (Option<i32>, String, String) {
    let run = support::run_postie(args, env);
    (run.code, run.stdout, run.stderr)
}

fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn serve_refuses_plaintext_postgres_off_the_machine_in_one_line_before_connecting() {
    let env = vars(&[
        ("RUST_LOG", "debug,lapin=debug"),
        (
            "POSTIE__DATABASE__URL",
            "postgres://postie:s3cr3t-db-pw@db.example.invalid:5432/x",
        ),
        ("POSTIE__HTTP__LISTEN", ""),
    ]);
    let started = Instant::now();
    let (code, stdout, stderr) = run_postie(&["serve"], &env);
    assert_ne!(code, Some(0), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        started.elapsed()
    );
    let lines: Vec<&str> = stderr.lines().collect();
    // One line, and nothing before it: no log of a connection attempt, even at debug.
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(
        lines[0].split(": the").next().unwrap(),
        "postie: configuration error: database.url points at db.example.invalid without sslmode=require",
        "{stderr}"
    );
    assert!(
        lines[0].ends_with(
            "set sslmode=require (or verify-full), or database.allow_plaintext = true to accept the risk"
        ),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cr3t-db-pw") && !stdout.contains("s3cr3t-db-pw"),
        "{stderr}"
    );
    assert!(stdout.is_empty(), "{stdout}");

    // Every command loads the same settings, so none of them gets as far as connecting.
    for args in [&["status"][..], &["migrate"][..], &["dlq", "list"][..]] {
        let (code, _, stderr) = run_postie(args, &env);
        assert_ne!(code, Some(0), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains("database.url points at db.example.invalid"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("s3cr3t-db-pw"), "{args:?}: {stderr}");
    }
}

/// The local server's certificate, if it speaks TLS and the file can be read: Debian's
/// `ssl-cert-snakeoil.pem` (self-signed, valid for the name `localhost`).
async fn local_postgres_certificate() -> Option<PathBuf> {
    let client = admin().await;
    let ssl: String = client.query_one("SHOW ssl", &[]).await.ok()?.get(0);
    let cert: String = client
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .ok()?
        .get(0);
    let cert = PathBuf::from(cert);
    (ssl == "on"
        && std::fs::read_to_string(&cert).is_ok_and(|pem| pem.contains("BEGIN CERTIFICATE")))
    .then_some(cert)
}

async fn admin() -> tokio_postgres::Client {
    pg_admin("postgres").await
}

/// A database of its own, dropped at the end.
struct Database(String);

impl Database {
    async fn create(name: &str) -> Self {
        let db = format!(
            "postie_t_{name}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        admin()
            .await
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        Self(db)
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.0);
        let _ = Command::new("psql")
            .args([&format!("{}/postgres", pg_base()), "-qAtc", &sql])
            .stdout(Stdio::null())
            .status();
    }
}

/// Builds an inbox for `url` and connects once.
async fn connect_inbox(url: &str, ca_file: Option<&Path>) -> Result<Inbox, String> {
    let settings = DatabaseSettings {
        url: SecretString::from(url.to_string()),
        ca_file: ca_file.map(Path::to_path_buf),
        pool_size: 2,
        ..Default::default()
    };
    let inbox = settings
        .plan()
        .map_err(anyhow::Error::from)
        .and_then(|plan| Inbox::new(&plan, &settings))
        .map_err(|e| postie::describe_error(&e))?;
    inbox
        .check(&settings.url)
        .await
        .map_err(|e| postie::describe_error(&e))?;
    Ok(inbox)
}

#[tokio::test]
async fn postgres_tls_verifies_the_chain_and_the_host_name() {
    let Some(cert) = local_postgres_certificate().await else {
        eprintln!("skipped: the local PostgreSQL does not offer TLS with a readable certificate");
        return;
    };
    let db = Database::create("tls").await;
    let base = url::Url::parse(&pg_base()).unwrap();
    let port = base.port().unwrap_or(5432);
    let user = base.username();
    let by_name = |mode: &str| {
        format!(
            "postgres://{user}@localhost:{port}/{}?sslmode={mode}&hostaddr=127.0.0.1",
            db.0
        )
    };
    let by_ip = |mode: &str| format!("postgres://{user}@127.0.0.1:{port}/{}?sslmode={mode}", db.0);

    // Chain to ca_file and the name `localhost`: connected, and encrypted.
    for mode in ["verify-full", "require"] {
        let inbox = connect_inbox(&by_name(mode), Some(&cert))
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        let encrypted: i64 = admin()
            .await
            .query_one(
                "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
                 WHERE a.datname = $1 AND s.ssl",
                &[&db.0],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            encrypted >= 1,
            "{mode}: no TLS connection seen in pg_stat_ssl"
        );
        drop(inbox);
    }
    // `require` is not libpq's unverified require: a certificate for another name fails…
    let err = connect_inbox(&by_ip("require"), Some(&cert))
        .await
        .err()
        .expect("name mismatch refused");
    assert!(
        err.contains("invalid peer certificate: certificate not valid for name"),
        "{err}"
    );
    // verify-ca: the chain to ca_file alone, whatever the name.
    connect_inbox(&by_ip("verify-ca"), Some(&cert))
        .await
        .expect("verify-ca ignores the name");
    let public_roots = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if public_roots.exists() {
        let err = connect_inbox(&by_ip("verify-ca"), Some(public_roots))
            .await
            .err()
            .expect("wrong CA refused");
        assert!(
            err.contains("invalid peer certificate: UnknownIssuer"),
            "{err}"
        );
        // …and a certificate the system's roots do not vouch for fails too. (Debian links
        // its snakeoil certificate into /etc/ssl/certs, so the system store of this
        // machine trusts it: narrow the roots to the public bundle, in a child process.)
        let env = vars(&[
            ("POSTIE__DATABASE__URL", &by_name("require")),
            ("SSL_CERT_FILE", &public_roots.display().to_string()),
        ]);
        let (code, _, stderr) = run_postie(&["migrate"], &env);
        assert_ne!(code, Some(0), "{stderr}");
        assert!(
            stderr.contains("invalid peer certificate: UnknownIssuer"),
            "{stderr}"
        );
    }
    // Plaintext to this machine stays the default.
    connect_inbox(
        &format!("postgres://{user}@127.0.0.1:{port}/{}", db.0),
        None,
    )
    .await
    .expect("plaintext on loopback");
}

/// A name for this machine that is neither `localhost` nor an address, so the rules
/// treat it as remote (they never ask DNS), while /etc/hosts sends it to 127.0.0.1.
fn this_machine_by_name() -> Option<String> {
    let hostname = std::fs::read_to_string("/etc/hostname")
        .ok()?
        .trim()
        .to_string();
    let local = (hostname.as_str(), 1u16)
        .to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.any(|a| a.ip() == std::net::Ipv4Addr::LOCALHOST));
    (!hostname.is_empty() && !postie::testing::endpoint::is_loopback_host(&hostname) && local)
        .then_some(hostname)
}

fn message(to: &str) -> lettre::Message {
    lettre::Message::builder()
        .from("Shop <noreply@shop.example>".parse().unwrap())
        .to(to.parse().unwrap())
        .subject("security test")
        .body("hello".to_string())
        .unwrap()
}

/// Sends one email to `to` through a mailer built for `url`.
async fn send_to(url: &str, to: &str) -> Result<(), SendError> {
    let mut settings = Settings::default();
    settings.transport.url = Some(SecretString::from(url.to_string()));
    settings.transport.timeout = Duration::from_secs(5);
    let mailer = settings
        .transport
        .one_transport()
        .map_err(anyhow::Error::from)
        .and_then(|transport| Mailer::new(&transport, &settings))
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let slot = mailer.slot().await;
    mailer
        .send(&slot, &Email::new(&message(to)), &Clearance::new())
        .await
        .map(|_| ())
}

#[tokio::test]
async fn smtp_to_a_host_that_is_not_loopback_requires_starttls_unless_told_tls_none() {
    let sink = support::SmtpSink::start().await;
    let port = sink.smtp_addr().rsplit(':').next().unwrap().to_string();
    // Loopback: plaintext by default (the sink offers no STARTTLS).
    send_to(&format!("smtp://127.0.0.1:{port}"), "a@example.com")
        .await
        .expect("loopback");
    let Some(hostname) = this_machine_by_name() else {
        eprintln!(
            "skipped the remote-name half: this machine's name does not resolve to 127.0.0.1"
        );
        return;
    };
    let remote = format!("smtp://{hostname}:{port}");
    let err = send_to(&remote, "b@example.com")
        .await
        .expect_err("STARTTLS is required");
    assert!(
        err.to_string().to_lowercase().contains("starttls") || err.to_string().contains("TLS"),
        "{err}"
    );
    send_to(&format!("{remote}?tls=none"), "c@example.com")
        .await
        .expect("explicit tls=none");
    let received: Vec<String> = sink
        .messages(false)
        .await
        .into_iter()
        .flat_map(|m| m.rcpt_to)
        .collect();
    assert_eq!(received, ["a@example.com", "c@example.com"]);
}

/// A throwaway CA and a server certificate for `localhost` and 127.0.0.1, made with the
/// openssl command; removed when dropped.
struct TestPki {
    dir: PathBuf,
}

impl TestPki {
    fn create() -> Option<Self> {
        let dir =
            std::env::temp_dir().join(format!("postie-pki-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).ok()?;
        let pki = Self { dir };
        std::fs::write(
            pki.path("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .ok()?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let steps: [Vec<&str>; 3] = [
            [
                &["req", "-x509"][..],
                &ec,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=postie test CA",
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign",
                ],
            ]
            .concat(),
            [
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    "server.key",
                    "-out",
                    "server.csr",
                    "-subj",
                    "/CN=localhost",
                ],
            ]
            .concat(),
            vec![
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
        ];
        for args in steps {
            let ok = Command::new("openssl")
                .args(&args)
                .current_dir(&pki.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                return None;
            }
        }
        Some(pki)
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// socat terminating TLS on `port` in front of the test broker; killed when dropped.
struct TlsTerminator(std::process::Child);

impl TlsTerminator {
    fn start(pki: &TestPki, port: u16, upstream: &str) -> Option<Self> {
        let child = Command::new("socat")
            .arg(format!(
                "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
                pki.path("server.pem"),
                pki.path("server.key")
            ))
            .arg(format!("TCP:{upstream}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let terminator = Self(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(terminator)
    }
}

impl Drop for TlsTerminator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_connects_with_the_broker_certificate_verified() {
    let have = |tool: &str| {
        Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    if !have("socat") || !have("openssl") {
        eprintln!("skipped: socat and openssl are needed to put TLS in front of the broker");
        return;
    }
    let Some(pki) = TestPki::create() else {
        panic!("openssl could not make the test certificates");
    };
    let broker = url::Url::parse(&amqp_url()).unwrap();
    let upstream = format!(
        "{}:{}",
        broker.host_str().unwrap(),
        broker.port().unwrap_or(5672)
    );
    let port = free_port();
    let _tls = TlsTerminator::start(&pki, port, &upstream).expect("socat listens");
    let env = TestEnv::new("amqps").await;
    let amqps = format!(
        "amqps://{}:{}@localhost:{port}{}",
        broker.username(),
        broker.password().unwrap_or(""),
        broker.path()
    );
    let mut vars = env.env_vars();
    vars.push(("POSTIE__AMQP__URL".into(), amqps.clone()));
    vars.push(("RUST_LOG".into(), "warn".into()));
    let publish = [
        "publish",
        "--key",
        "tls-1",
        "--to",
        "a@example.com",
        "--from",
        "s@example.com",
        "--subject",
        "s",
        "--text",
        "t",
    ];

    // Trusting the test CA (rustls-native-certs reads SSL_CERT_FILE): published.
    let mut trusted = vars.clone();
    trusted.push(("SSL_CERT_FILE".into(), pki.path("ca.pem")));
    let (code, stdout, stderr) = run_postie(&publish, &trusted);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("published tls-1"), "{stdout}");
    assert_eq!(env.depth(env.topology.intake_queue()).await, 1);

    // The system's roots do not vouch for the test CA: refused, password not shown.
    let (code, stdout, stderr) = run_postie(&publish, &vars);
    assert_ne!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains("cannot connect to RabbitMQ at amqps://"),
        "{stderr}"
    );
    let credentials = format!("{}:{}@", broker.username(), broker.password().unwrap_or(""));
    assert!(!stderr.contains(&credentials), "{stderr}");
    assert_eq!(env.depth(env.topology.intake_queue()).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_amqp_to_a_host_that_is_not_loopback_is_warned_about_once() {
    let Some(hostname) = this_machine_by_name() else {
        eprintln!("skipped: this machine's name does not resolve to 127.0.0.1");
        return;
    };
    let env = TestEnv::new("amqpwarn").await;
    let mut broker = url::Url::parse(&amqp_url()).unwrap();
    if broker.host_str() != Some("127.0.0.1") {
        eprintln!("skipped: the test broker is not on 127.0.0.1");
        return;
    }
    broker.set_host(Some(&hostname)).unwrap();
    // `auto` probes on a connection of its own before the main one: two connects.
    let mut process = env.spawn_process(&[
        ("POSTIE__AMQP__URL", broker.as_str()),
        ("POSTIE__DELAY__MODE", "auto"),
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !process.log().contains("postie serving") {
        assert!(
            Instant::now() < deadline,
            "serve did not start: {}",
            process.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        process
            .terminate(Duration::from_secs(30))
            .is_some_and(|s| s.success()),
        "{}",
        process.log()
    );
    let log = process.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("amqp.url points at"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains(&format!("amqp.url points at {hostname} without TLS")),
        "{log}"
    );
    assert!(warnings[0].contains("WARN"), "{log}");
    assert!(
        !log.contains(&format!(":{}@", broker.password().unwrap_or("guest"))),
        "{log}"
    );
}
