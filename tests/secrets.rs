//! No password, and no connection URL with its credentials, ever reaches postie's
//! output: a real `postie serve` process with distinctive passwords in all three URLs
//! (its own RabbitMQ user, its own PostgreSQL role, an SMTP relay that demands AUTH),
//! logging at debug (lapin too), driven through sends, an SMTP 4xx and a 5xx, a
//! malformed job and a duplicate; then `postie status` and `postie publish` with the
//! same environment, and both again with wrong passwords and an unreachable database.

mod support;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use support::{admin_sql_in, amqp_url, eventually, job, pg_base, TestEnv};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// A RabbitMQ user of the test's own, allowed only on the test's prefix; deleted on drop.
struct BrokerUser {
    name: String,
}

impl BrokerUser {
    fn create(name: &str, password: &str, prefix: &str, vhost: &str) -> Self {
        rabbitmqctl(&["add_user", name, password]);
        let user = Self {
            name: name.to_string(),
        };
        let only_ours = format!("^{}\\.", prefix.replace('.', "\\."));
        rabbitmqctl(&[
            "set_permissions",
            "-p",
            vhost,
            name,
            &only_ours,
            &only_ours,
            &only_ours,
        ]);
        user
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = support::rabbitmqctl_command(&["delete_user", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn rabbitmqctl(args: &[&str]) {
    let out = support::rabbitmqctl_command(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {}: {}",
        args[0],
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A PostgreSQL login role with a password; dropped on drop (after the test database,
/// which it owns, is gone: declare it before the `TestEnv`).
struct DbRole {
    name: String,
}

impl DbRole {
    async fn create(name: &str, password: &str) -> Self {
        admin_sql(&format!("CREATE ROLE {name} LOGIN PASSWORD '{password}'")).await;
        Self {
            name: name.to_string(),
        }
    }
}

impl Drop for DbRole {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([
                &format!("{}/postgres", pg_base()),
                "-qAtc",
                &format!("DROP ROLE IF EXISTS {}", self.name),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

async fn admin_sql(sql: &str) {
    admin_sql_in("postgres", sql).await;
}

/// What the AUTH relay saw.
#[derive(Default)]
struct RelayLog {
    /// Decoded (user, password) of every AUTH.
    logins: Vec<(String, String)>,
    /// Recipients of every accepted message.
    delivered: Vec<String>,
    /// Recipients already refused once with 451.
    deferred: HashSet<String>,
}

/// A minimal SMTP relay that demands AUTH (PLAIN or LOGIN, any password, recorded),
/// answers 451 once to recipients containing `tempfail` and 550 always to those
/// containing `permfail`. (`postie-smtp-sink` offers no AUTH, and lettre refuses to
/// send with credentials to a server that offers none.)
struct AuthRelay {
    port: u16,
    log: Arc<Mutex<RelayLog>>,
    task: tokio::task::JoinHandle<()>,
}

impl AuthRelay {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(RelayLog::default()));
        let shared = log.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(relay_session(stream, shared.clone()));
            }
        });
        Self { port, log, task }
    }
}

impl Drop for AuthRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay_session(
    stream: tokio::net::TcpStream,
    log: Arc<Mutex<RelayLog>>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    write.write_all(b"220 auth-relay ready\r\n").await?;
    let (mut authed, mut rcpts) = (false, Vec::<String>::new());
    while let Some(line) = lines.next_line().await? {
        let upper = line.to_ascii_uppercase();
        let reply: String = if upper.starts_with("EHLO") {
            "250-auth-relay\r\n250-AUTH PLAIN LOGIN\r\n250 8BITMIME".into()
        } else if upper.starts_with("HELO") || upper.starts_with("NOOP") {
            "250 ok".into()
        } else if upper.starts_with("AUTH PLAIN") {
            let initial = line.split_whitespace().nth(2).map(str::to_string);
            let encoded = match initial {
                Some(encoded) => encoded,
                None => {
                    write.write_all(b"334 \r\n").await?;
                    lines.next_line().await?.unwrap_or_default()
                }
            };
            let decoded = base64_decode(&encoded);
            let mut parts = decoded
                .split(|b| *b == 0)
                .skip(1)
                .map(|p| String::from_utf8_lossy(p).into_owned());
            let login = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
            );
            log.lock().unwrap().logins.push(login);
            authed = true;
            "235 2.7.0 authenticated".into()
        } else if upper.starts_with("AUTH LOGIN") {
            write.write_all(b"334 VXNlcm5hbWU6\r\n").await?;
            let user = base64_decode(&lines.next_line().await?.unwrap_or_default());
            write.write_all(b"334 UGFzc3dvcmQ6\r\n").await?;
            let password = base64_decode(&lines.next_line().await?.unwrap_or_default());
            let login = (
                String::from_utf8_lossy(&user).into_owned(),
                String::from_utf8_lossy(&password).into_owned(),
            );
            log.lock().unwrap().logins.push(login);
            authed = true;
            "235 2.7.0 authenticated".into()
        } else if upper.starts_with("MAIL FROM") {
            rcpts.clear();
            if authed {
                "250 ok"
            } else {
                "530 5.7.0 authentication required"
            }
            .into()
        } else if upper.starts_with("RCPT TO") {
            let rcpt = line[8..].trim().trim_matches(['<', '>']).to_string();
            if rcpt.contains("permfail") {
                "550 5.1.1 no such user".into()
            } else if rcpt.contains("tempfail") && log.lock().unwrap().deferred.insert(rcpt.clone())
            {
                "451 4.3.0 try again later".into()
            } else {
                rcpts.push(rcpt);
                "250 ok".into()
            }
        } else if upper.starts_with("DATA") {
            if rcpts.is_empty() {
                "554 5.5.1 no valid recipients".into()
            } else {
                write.write_all(b"354 go ahead\r\n").await?;
                while let Some(data) = lines.next_line().await? {
                    if data == "." {
                        break;
                    }
                }
                log.lock().unwrap().delivered.append(&mut rcpts);
                "250 2.0.0 queued".into()
            }
        } else if upper.starts_with("RSET") {
            rcpts.clear();
            "250 ok".into()
        } else if upper.starts_with("QUIT") {
            write.write_all(b"221 bye\r\n").await?;
            return Ok(());
        } else {
            "502 5.5.2 not implemented".into()
        };
        write.write_all(format!("{reply}\r\n").as_bytes()).await?;
    }
    Ok(())
}

/// An SMTP AUTH argument's bytes (standard base64); nothing if it is not base64.
fn base64_decode(text: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .unwrap_or_default()
}

/// `postie ARGS` with exactly `env`: (exit code, stdout + stderr).
fn run_postie(args: &[&str], env: &[(String, String)]) -> (Option<i32>, String) {
    let run = support::run_postie(args, env);
    (run.code, format!("{}{}", run.stdout, run.stderr))
}

/// Replaces (or adds) `key` in an environment list.
fn with(env: &[(String, String)], key: &str, value: &str) -> Vec<(String, String)> {
    let mut env: Vec<_> = env.iter().filter(|(k, _)| k != key).cloned().collect();
    env.push((key.to_string(), value.to_string()));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_or_credentialed_url_reaches_the_output() {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let rmq_user = format!("postie-sec-{id}");
    let rmq_password = format!("Rmq-Pw-{id}-x7");
    let pg_role = format!("postie_sec_{id}");
    let pg_password = format!("Pg-Pw-{id}-q3");
    let smtp_user = format!("mailer-{id}");
    let smtp_password = format!("Smtp-Pw-{id}-z9");
    let wrong_password = format!("Wrong-Pw-{id}-k1");

    // Dropped last to first: the process, the test's world (its database too), the
    // broker user, then the role that owned the database.
    let role = DbRole::create(&pg_role, &pg_password).await;
    // Empty: postie migrates it as the role, which then owns every table.
    let env = TestEnv::unmigrated("secrets").await;
    admin_sql(&format!(
        "ALTER DATABASE {} OWNER TO {}",
        env.db_name, role.name
    ))
    .await;
    admin_sql_in(
        &env.db_name,
        &format!("GRANT ALL ON SCHEMA public TO {}", role.name),
    )
    .await;
    let broker = url::Url::parse(&amqp_url()).unwrap();
    let vhost = match broker.path().trim_start_matches('/') {
        "" | "%2f" | "%2F" => "/".to_string(),
        other => other.replace("%2f", "/").replace("%2F", "/"),
    };
    let _broker_user = BrokerUser::create(&rmq_user, &rmq_password, &env.prefix, &vhost);
    let relay = AuthRelay::start().await;

    let broker_at = |user: &str, password: &str| {
        let mut url = broker.clone();
        url.set_username(user).unwrap();
        url.set_password(Some(password)).unwrap();
        url.to_string()
    };
    let pg = url::Url::parse(&pg_base()).unwrap();
    let pg_at = |host: &str, port: u16| {
        format!(
            "postgres://{pg_role}:{pg_password}@{host}:{port}/{}",
            env.db_name
        )
    };
    let amqp_url = broker_at(&rmq_user, &rmq_password);
    let database_url = pg_at(pg.host_str().unwrap(), pg.port().unwrap_or(5432));
    let smtp_url = format!(
        "smtp://{smtp_user}:{smtp_password}@127.0.0.1:{}",
        relay.port
    );
    let noisy = [
        ("RUST_LOG", "debug,lapin=debug"),
        ("POSTIE__AMQP__URL", amqp_url.as_str()),
        ("POSTIE__DATABASE__URL", database_url.as_str()),
        ("POSTIE__TRANSPORT__URL", smtp_url.as_str()),
    ];
    let mut process = env.spawn_process(&noisy);
    let mut cli_env = env.env_vars();
    for (k, v) in noisy {
        cli_env = with(&cli_env, k, v);
    }

    env.publish(&job("sec-ok", "ok@example.com")).await;
    env.publish(&job("sec-tempfail", "tempfail@example.com"))
        .await;
    env.publish(&job("sec-permfail", "permfail@example.com"))
        .await;
    env.publish_raw(
        b"{ this is not json",
        postie::testing::broker::job_properties(),
    )
    .await;
    let envr = &env;
    eventually(
        "the first send",
        Duration::from_secs(60),
        move || async move {
            envr.inbox_row("sec-ok")
                .await
                .filter(|r| r.status == "sent")
                .map(|_| ())
        },
    )
    .await;
    env.publish(&job("sec-ok", "ok@example.com")).await; // a duplicate

    let (code, published) = run_postie(
        &[
            "publish",
            "--key",
            "sec-cli",
            "--to",
            "cli@example.com",
            "--from",
            "Shop <noreply@shop.example>",
            "--subject",
            "from the CLI",
            "--text",
            "hello",
        ],
        &cli_env,
    );
    assert_eq!(code, Some(0), "{published}");

    let log = relay.log.clone();
    eventually(
        "sent, retried and dead-lettered",
        Duration::from_secs(90),
        move || {
            let log = log.clone();
            async move {
                let mut delivered = log.lock().unwrap().delivered.clone();
                delivered.sort();
                let dead = envr.depth(envr.topology.dead_queue()).await;
                let dup = envr
                    .inbox_row("sec-ok")
                    .await
                    .is_some_and(|r| r.duplicates == 1);
                (delivered == ["cli@example.com", "ok@example.com", "tempfail@example.com"]
                    && dead == 2
                    && dup)
                    .then_some(())
            }
        },
    )
    .await;
    // The credentials in the URL work: the relay demanded them and got them, decoded.
    let logins = relay.log.lock().unwrap().logins.clone();
    assert!(!logins.is_empty());
    assert!(
        logins
            .iter()
            .all(|l| *l == (smtp_user.clone(), smtp_password.clone())),
        "{logins:?}"
    );

    let (code, status) = run_postie(&["status"], &cli_env);
    assert_eq!(code, Some(0), "{status}");
    assert!(status.contains("inbox:"), "{status}");

    // Error paths print URLs: a wrong broker password, and a database that is not there.
    let wrong_broker = with(
        &cli_env,
        "POSTIE__AMQP__URL",
        &broker_at(&rmq_user, &wrong_password),
    );
    let (code, refused_broker) = run_postie(
        &[
            "publish",
            "--key",
            "sec-no",
            "--to",
            "x@example.com",
            "--from",
            "s@example.com",
            "--subject",
            "s",
            "--text",
            "t",
        ],
        &wrong_broker,
    );
    assert_ne!(code, Some(0), "{refused_broker}");
    assert!(
        refused_broker.contains("cannot connect to RabbitMQ at"),
        "{refused_broker}"
    );
    let closed_port = support::free_port();
    let no_database = with(
        &cli_env,
        "POSTIE__DATABASE__URL",
        &pg_at("127.0.0.1", closed_port),
    );
    let (code, refused_database) = run_postie(&["status"], &no_database);
    assert_ne!(code, Some(0), "{refused_database}");
    assert!(
        refused_database.contains("cannot connect to PostgreSQL at"),
        "{refused_database}"
    );
    let bad_smtp = with(
        &cli_env,
        "POSTIE__TRANSPORT__URL",
        &format!("smtp://{smtp_user}:{smtp_password}@relay.example.com?tls=sometimes"),
    );
    let (code, bad_smtp) = run_postie(&["serve"], &bad_smtp);
    assert_ne!(code, Some(0), "{bad_smtp}");
    assert!(bad_smtp.contains("tls=sometimes"), "{bad_smtp}");

    let status_code = process.terminate(Duration::from_secs(60));
    assert!(
        status_code.is_some_and(|s| s.success()),
        "serve did not stop cleanly: {status_code:?}"
    );
    let served = process.log();
    // The run was as noisy as intended, so the checks below are not vacuous.
    assert!(served.contains("postie serving"), "{served}");
    assert!(served.contains("lapin"), "no lapin debug output");
    assert!(served.contains("DEBUG"), "no debug output");

    let secrets = [&rmq_password, &pg_password, &smtp_password, &wrong_password];
    let userinfos = [
        format!("{rmq_user}:{rmq_password}@"),
        format!("{rmq_user}:{wrong_password}@"),
        format!("{pg_role}:{pg_password}@"),
        format!("{smtp_user}:{smtp_password}@"),
    ];
    for (what, text) in [
        ("serve", &served),
        ("publish", &published),
        ("status", &status),
        ("publish with a wrong broker password", &refused_broker),
        ("status without a database", &refused_database),
        ("serve with a bad transport.url", &bad_smtp),
    ] {
        for secret in secrets {
            if let Some(at) = text.find(secret.as_str()) {
                let line = text[..at].rsplit('\n').next().unwrap_or("");
                panic!("{what} printed a password, in the line starting {line:?}");
            }
        }
        for userinfo in &userinfos {
            assert!(
                !text.contains(userinfo.as_str()),
                "{what} printed credentials {userinfo:?}"
            );
        }
    }
    drop(process);
}

/// A setting to give a postie process, and what it must never print.
struct Form {
    /// What the form is, for failure messages.
    what: &'static str,
    /// The environment variables (setting → value).
    vars: Vec<(&'static str, String)>,
}

/// Runs `migrate`, `topology`, `status` and (when it must fail at start-up) `serve`
/// with `env`: (command, exit code, stdout + stderr) for each.
fn run_commands(env: &[(String, String)], serve: bool) -> Vec<(String, Option<i32>, String)> {
    let mut commands = vec!["migrate", "topology", "status"];
    if serve {
        commands.push("serve");
    }
    commands
        .into_iter()
        .map(|command| {
            let (code, output) = run_postie(&[command], env);
            (command.to_string(), code, output)
        })
        .collect()
}

/// Panics with the line if `text` holds `marker` (every password of the test holds it).
fn assert_no_marker(what: &str, text: &str, marker: &str) {
    if let Some(at) = text.find(marker) {
        let line = text[..at].rsplit('\n').next().unwrap_or("");
        panic!("{what} printed a password, in the line starting {line:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ge_every_address_form_is_redacted_by_every_command() {
    // Every password below holds `marker`, and nothing else does: no output may.
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let marker = format!("Mk{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let env = TestEnv::new("ge-secrets").await;
    let rmq_user = format!("postie-ge-{id}");
    let broker = url::Url::parse(&amqp_url()).unwrap();
    let vhost = match broker.path().trim_start_matches('/') {
        "" | "%2f" | "%2F" => "/".to_string(),
        other => other.replace("%2f", "/").replace("%2F", "/"),
    };
    let live_password = format!("Live-{marker}");
    let _broker_user = BrokerUser::create(&rmq_user, &live_password, &env.prefix, &vhost);
    let pg = url::Url::parse(&pg_base()).unwrap();
    let (pg_host, pg_port) = (
        pg.host_str().unwrap().to_string(),
        pg.port().unwrap_or(5432),
    );
    let pg_user = match pg.username() {
        "" => "postgres".to_string(),
        user => user.to_string(),
    };
    let db = env.db_name.clone();
    let (closed, closed2) = (support::free_port(), support::free_port());
    let live_broker = {
        let mut url = broker.clone();
        url.set_username(&rmq_user).unwrap();
        url.set_password(Some(&live_password)).unwrap();
        url.to_string()
    };
    let noisy = [("RUST_LOG", "debug,lapin=debug".to_string())];

    // Forms a running postie accepts (the server trusts local connections, so any
    // password passes): serve sends a job with each, and every command succeeds.
    let running = [
        Form {
            what: "several PostgreSQL hosts, a list of AMQP addresses, otel.endpoint with credentials",
            vars: vec![
                (
                    "POSTIE__DATABASE__URL",
                    format!("postgres://{pg_user}:PgMulti-{marker}@{pg_host}:{pg_port},127.0.0.1:{closed}/{db}"),
                ),
                (
                    "POSTIE__AMQP__URL",
                    format!("amqp://ge-dead:Dead-{marker}@127.0.0.1:{closed2}/%2f, {live_broker}"),
                ),
                (
                    "POSTIE__OTEL__ENDPOINT",
                    format!("http://otel:Otel-{marker}@127.0.0.1:{closed}/v1/traces?api_key=Key-{marker}"),
                ),
            ],
        },
        Form {
            what: "a libpq key=value string with a quoted password",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("host={pg_host} port={pg_port} user={pg_user} password='Kv pw {marker}' dbname={db}"),
            )],
        },
        Form {
            what: "a percent-encoded password in the query",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("postgres://{pg_user}@{pg_host}:{pg_port}/{db}?password=Q%2F{marker}%40x"),
            )],
        },
        Form {
            what: "a percent-encoded password in the user info",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("postgres://{pg_user}:Enc%2F{marker}%3A%40@{pg_host}:{pg_port}/{db}"),
            )],
        },
    ];
    // Forms that stop start-up (bad ports, unreachable hosts, malformed strings).
    let failing = [
        Form {
            what: "an SMTP URL with a port out of range",
            vars: vec![(
                "POSTIE__TRANSPORT__URL",
                format!("smtp://u:Smtp-{marker}@127.0.0.1:99999"),
            )],
        },
        Form {
            what: "an SMTP URL with a raw slash in the password",
            vars: vec![(
                "POSTIE__TRANSPORT__URL",
                format!("smtp://u:Sl/{marker}@127.0.0.1:2525"),
            )],
        },
        Form {
            what: "an AMQP URL with a port out of range",
            vars: vec![(
                "POSTIE__AMQP__URL",
                format!("amqp://u:Amqp-{marker}@127.0.0.1:99999/%2f"),
            )],
        },
        Form {
            what: "an AMQP list whose every address refuses",
            vars: vec![(
                "POSTIE__AMQP__URL",
                format!(
                    "amqp://{rmq_user}:Wrong-{marker}@127.0.0.1:5672/%2f,amqp://x:Gone-{marker}@127.0.0.1:{closed}/%2f"
                ),
            )],
        },
        Form {
            what: "several PostgreSQL hosts, none answering",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("postgres://u:PgDown-{marker}@127.0.0.1:{closed},127.0.0.1:{closed2}/x"),
            )],
        },
        Form {
            what: "a PostgreSQL URL with a port out of range",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("postgres://u:PgPort-{marker}@127.0.0.1:99999/x"),
            )],
        },
        Form {
            what: "a key=value string with an unquoted password holding a space",
            vars: vec![(
                "POSTIE__DATABASE__URL",
                format!("host=127.0.0.1 password=Half-{marker} Way-{marker} dbname=x"),
            )],
        },
        Form {
            what: "otel.endpoint with a port out of range",
            vars: vec![(
                "POSTIE__OTEL__ENDPOINT",
                format!("http://o:Otel-{marker}@127.0.0.1:99999/v1/traces"),
            )],
        },
    ];

    for (n, form) in running.iter().enumerate() {
        let mut cli_env = env.env_vars();
        for (k, v) in noisy.iter().chain(&form.vars) {
            cli_env = with(&cli_env, k, v);
        }
        for (command, code, output) in run_commands(&cli_env, false) {
            assert_eq!(code, Some(0), "{} · {command}: {output}", form.what);
            assert_no_marker(&format!("{} · {command}", form.what), &output, &marker);
        }
        let extra: Vec<(&str, &str)> = noisy
            .iter()
            .chain(&form.vars)
            .map(|(k, v)| (*k, v.as_str()))
            .collect();
        let mut process = env.spawn_process(&extra);
        let key = format!("ge-sec-{n}");
        env.publish(&job(&key, &format!("{key}@example.com"))).await;
        env.wait_for_status(&key, "sent", Duration::from_secs(60))
            .await;
        let status = process.terminate(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "{}: {status:?}",
            form.what
        );
        let served = process.log();
        assert!(served.contains("postie serving"), "{}: {served}", form.what);
        assert!(served.contains("DEBUG"), "{}: no debug output", form.what);
        assert_no_marker(&format!("{} · serve", form.what), &served, &marker);
    }
    env.wait_for_emails(
        "one email per running form",
        running.len(),
        Duration::from_secs(30),
    )
    .await;

    for form in &failing {
        let mut cli_env = env.env_vars();
        for (k, v) in noisy.iter().chain(&form.vars) {
            cli_env = with(&cli_env, k, v);
        }
        let runs = run_commands(&cli_env, true);
        // Each form stops serve and at least one other command, with a line naming
        // the setting: the check below reads real refusals, not silence.
        let refused = runs.iter().filter(|(_, code, _)| *code != Some(0)).count();
        assert!(refused >= 2, "{}: {refused} refusals", form.what);
        let (_, serve_code, serve_output) = runs.last().unwrap();
        assert_ne!(
            *serve_code,
            Some(0),
            "{} · serve: {serve_output}",
            form.what
        );
        let setting = form.vars[0]
            .0
            .trim_start_matches("POSTIE__")
            .replace("__", ".");
        let setting = setting.to_ascii_lowercase();
        let named = runs.iter().any(|(_, _, output)| {
            output.contains(&setting) || output.contains("cannot connect to")
        });
        assert!(named, "{}: no line names {setting}: {runs:?}", form.what);
        for (command, _, output) in &runs {
            assert_no_marker(&format!("{} · {command}", form.what), output, &marker);
        }
    }
}
