//! An outbox that cannot wedge (issue 45, item 5): `postie.enqueue` refuses a job
//! over `worker.max_body_bytes` and a due time that is not finite; a row the relay
//! can never publish (the broker refuses it by its size, it is over postie's own
//! limit, PostgreSQL cannot compute its delay) is moved to `postie.outbox_rejected`
//! with its reason, counted and shown by `postie status`, and the rows after it are
//! relayed; `postie outbox install` refuses a `postie` schema or `outbox_version` it
//! does not own or that is not a plain table. Real broker (the 16 MiB limit of 4.x, the
//! 128 MiB of 3.x, whichever the suite runs against), real PostgreSQL, the real sink.

mod outbox_support;
mod support;

use std::time::Duration;

use outbox_support::*;
use support::*;

const WAIT: Duration = Duration::from_secs(60);

/// The broker's `max_message_size`, read (not changed) with `rabbitmqctl eval`.
fn broker_max_message_size() -> usize {
    let out = rabbitmqctl_command(&["eval", "application:get_env(rabbit, max_message_size)."])
        .output()
        .expect("rabbitmqctl eval");
    let text = String::from_utf8_lossy(&out.stdout);
    // `{ok,16777216}`
    text.trim()
        .trim_start_matches("{ok,")
        .trim_end_matches('}')
        .parse()
        .unwrap_or_else(|_| panic!("the broker's max_message_size from {text:?}"))
}

/// `n` small jobs `{prefix}-{i}`.
fn small_jobs(prefix: &str, n: usize) -> Vec<(String, serde_json::Value)> {
    (0..n)
        .map(|i| {
            let key = format!("{prefix}-{i}");
            let body = job(&key, "next@example.com");
            (key, body)
        })
        .collect()
}

/// Enqueues each job, in this order, one transaction each.
async fn enqueue(client: &tokio_postgres::Client, jobs: &[(String, serde_json::Value)]) {
    for (_, body) in jobs {
        client
            .query_one("SELECT postie.enqueue($1::jsonb)", &[body])
            .await
            .expect("enqueued");
    }
}

/// Waits for each of `keys` to be sent once.
async fn wait_sent(env: &TestEnv, keys: &[String], what: &str) {
    eventually(what, WAIT, || async {
        let sent = env.emails_per_id().await;
        keys.iter()
            .all(|k| sent.get(&message_id(k)) == Some(&1))
            .then_some(())
    })
    .await;
}

/// The rows set aside: (id, reason).
async fn rejected(producer: &ProducerDb) -> Vec<(i64, String)> {
    let rows = producer
        .client()
        .await
        .query(
            "SELECT id, reason FROM postie.outbox_rejected ORDER BY id",
            &[],
        )
        .await
        .expect("postie.outbox_rejected");
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// `postie status`'s outbox line for the source `shop`.
fn status_line(env: &TestEnv, source: &str) -> String {
    let mut vars = env.env_vars();
    vars.push(("POSTIE__OUTBOX__SOURCES".into(), source.into()));
    let run = run_postie(&["status"], &vars);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    run.stdout
        .lines()
        .find(|l| l.trim_start().starts_with("shop"))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_refuses_a_job_over_max_body_bytes() {
    let env = TestEnv::new("outbox-size").await;
    let producer = ProducerDb::new(&env).await;
    let client = producer.client().await;
    // worker.max_body_bytes is 512 KiB by default: a 600 KiB job would be
    // dead-lettered, unread, by every postie.
    let mut big = job("ob-600k", "a@example.com");
    big["text"] = "x".repeat(600 * 1024).into();
    let refused = client
        .query_one("SELECT postie.enqueue($1::jsonb)", &[&big])
        .await;
    let error = refused.expect_err("a 600 KiB job refused by enqueue");
    let db = error.as_db_error().expect("a server error");
    println!(
        "FIGURES enqueue of a 600 KiB job: {} {}",
        db.code().code(),
        db.message()
    );
    assert_eq!(db.code().code(), "22023", "{db:?}");
    assert!(
        db.message().contains("bytes") && db.message().contains("524288"),
        "the reason names the size and the limit: {}",
        db.message()
    );
    let mut fits = job("ob-500k", "a@example.com");
    fits["text"] = "x".repeat(500 * 1024).into();
    client
        .query_one("SELECT postie.enqueue($1::jsonb)", &[&fits])
        .await
        .expect("a job within the limit is enqueued");
    assert_eq!(producer.waiting().await, 1);
}

/// The wedge: the oldest row is one the broker refuses (over its
/// `max_message_size`, with postie's own limit raised above it), and every pass took
/// the same rows again. Now it is set aside and the rows after it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_broker_refuses_is_set_aside_and_the_next_rows_go() {
    let limit = broker_max_message_size();
    let max_body = (2 * limit).to_string();
    let inflight = (4 * limit).to_string();
    let raised: [(&str, &str); 4] = [
        ("POSTIE__WORKER__MAX_BODY_BYTES", &max_body),
        ("POSTIE__WORKER__INFLIGHT_BYTES", &inflight),
        ("POSTIE__WORKER__CONCURRENCY", "1"),
        ("POSTIE__DELAY__RELAY_CONCURRENCY", "1"),
    ];
    let env = TestEnv::with_settings("outbox-broker", &raised).await;
    let producer = ProducerDb::empty(&env).await;
    // Installed with postie's raised limit: enqueue takes what the broker will not.
    let run = run_postie(
        &["outbox", "install", "--database", &producer.url()],
        &env.env_vars(),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let client = producer.client().await;
    client
        .query_one(
            "SELECT postie.enqueue(jsonb_build_object('key', 'ob-huge', 'to', jsonb_build_array('a@example.com'),
                                                      'subject', 'huge', 'text', repeat('x', $1)))",
            &[&((limit + 64 * 1024) as i32)],
        )
        .await
        .expect("the huge job enqueued");
    let next = small_jobs("ob-after-huge", 3);
    enqueue(&client, &next).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let source = format!("{}?name=shop", producer.url());
    let serving = env.serve(settings_with(
        &env,
        &source,
        &[("POSTIE__HTTP__LISTEN", listen.as_str())],
    ));
    let keys: Vec<String> = next.iter().map(|(k, _)| k.clone()).collect();
    let started = std::time::Instant::now();
    wait_sent(&env, &keys, "the rows after the one the broker refuses").await;
    // The refused row is set aside in its batch's transaction, which may commit just
    // after the rows published one by one beside it were sent.
    let aside = eventually("the refused row set aside", WAIT, || async {
        let aside = rejected(&producer).await;
        (!aside.is_empty()).then_some(aside)
    })
    .await;
    println!(
        "FIGURES a row of {} bytes, broker limit {limit}: the next rows sent after {:.1} s, set aside {aside:?}",
        limit + 64 * 1024,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(
        aside[0].1.contains("406") && aside[0].1.contains("max size"),
        "the broker's words: {}",
        aside[0].1
    );
    eventually("the outbox emptied", WAIT, || async {
        (producer.waiting().await == 0).then_some(())
    })
    .await;
    let (_, metrics) = http_get(&format!("http://{listen}/metrics")).await;
    assert_eq!(
        sample(&metrics, "postie_outbox_rejected_total{source=\"shop\"}"),
        Some(1.0),
        "{metrics}"
    );
    let line = status_line(&env, &source);
    assert!(line.contains("1 set aside"), "{line}");
    serving.stop().await;
}

/// A row over postie's own `worker.max_body_bytes` (enqueued under a higher limit):
/// set aside by its length, never published, and the rows after it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_max_body_bytes_is_set_aside_unpublished() {
    let env = TestEnv::new("outbox-own-limit").await;
    let producer = ProducerDb::empty(&env).await;
    let mut vars = env.env_vars();
    vars.push((
        "POSTIE__WORKER__MAX_BODY_BYTES".into(),
        (1024 * 1024).to_string(),
    ));
    let run = run_postie(&["outbox", "install", "--database", &producer.url()], &vars);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let client = producer.client().await;
    let mut big = job("ob-over-limit", "a@example.com");
    big["text"] = "x".repeat(600 * 1024).into();
    enqueue(&client, &[("ob-over-limit".into(), big)]).await;
    let next = small_jobs("ob-after-big", 3);
    enqueue(&client, &next).await;
    let source = format!("{}?name=shop", producer.url());
    let serving = env.serve(settings_with(&env, &source, &[]));
    let keys: Vec<String> = next.iter().map(|(k, _)| k.clone()).collect();
    wait_sent(&env, &keys, "the rows after the oversized one").await;
    let aside = rejected(&producer).await;
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(
        aside[0].1.contains("worker.max_body_bytes"),
        "{}",
        aside[0].1
    );
    assert!(
        env.take_dead_letters().await.is_empty(),
        "set aside, not published to be dead-lettered"
    );
    serving.stop().await;
}

/// `postie.enqueue(job, 'infinity')` was accepted, and `postie.take` then failed on
/// every pass ("cannot subtract infinite timestamps"): the source looked down for
/// good. Now enqueue refuses it, and such a row already there is set aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_time_that_is_not_finite_is_refused_and_an_old_one_set_aside() {
    let env = TestEnv::new("outbox-infinity").await;
    let producer = ProducerDb::new(&env).await;
    let client = producer.client().await;
    let forever = job("ob-forever", "a@example.com");
    // As an earlier postie's enqueue let it in.
    client
        .execute(
            "INSERT INTO postie.outbox (job, due_at) VALUES ($1, 'infinity')",
            &[&forever],
        )
        .await
        .unwrap();
    let next = small_jobs("ob-after-forever", 3);
    enqueue(&client, &next).await;
    let source = format!("{}?name=shop", producer.url());
    let serving = env.serve(settings_with(&env, &source, &[]));
    let keys: Vec<String> = next.iter().map(|(k, _)| k.clone()).collect();
    wait_sent(&env, &keys, "the rows after the one due at infinity").await;
    let aside = rejected(&producer).await;
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(aside[0].1.contains("not finite"), "{}", aside[0].1);
    let refused = client
        .query_one(
            "SELECT postie.enqueue($1::jsonb, 'infinity'::timestamptz)",
            &[&job("ob-forever-2", "a@example.com")],
        )
        .await
        .expect_err("enqueue refuses a due time that is not finite");
    assert_eq!(
        refused.code().map(|c| c.code()),
        Some("22023"),
        "{refused:?}"
    );
    serving.stop().await;
}

/// A role that may create a schema got there first: `postie` is its schema, and its
/// `outbox_version` has a trigger that makes it a superuser when the installer
/// records a script. Before the fix the install went through and ran the trigger as
/// the installer; now it refuses in one line and runs nothing there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_refuses_a_postie_schema_it_does_not_own() {
    let env = TestEnv::new("outbox-foreign").await;
    let producer = ProducerDb::empty(&env).await;
    let id = &env.db_name[env.db_name.len() - 10..];
    let evil = format!("ob_evil_{id}");
    let _roles = Roles::create(&producer, &[&evil]).await;
    let client = producer.client().await;
    client
        .batch_execute(&format!(
            "GRANT CREATE ON DATABASE {db} TO {evil};
             SET ROLE {evil};
             CREATE SCHEMA postie;
             CREATE TABLE postie.outbox_version (version integer PRIMARY KEY, name text NOT NULL,
                                                 applied_at timestamptz NOT NULL DEFAULT now());
             CREATE FUNCTION postie.take_over() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN EXECUTE 'ALTER ROLE {evil} SUPERUSER'; RETURN NEW; END $$;
             CREATE TRIGGER take_over BEFORE INSERT ON postie.outbox_version
                FOR EACH ROW EXECUTE FUNCTION postie.take_over();
             RESET ROLE;",
            db = producer.name
        ))
        .await
        .unwrap();
    let run = run_postie(
        &["outbox", "install", "--database", &producer.url()],
        &env.env_vars(),
    );
    let superuser: bool = client
        .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&evil])
        .await
        .unwrap()
        .get(0);
    println!(
        "FIGURES install into a schema owned by {evil}: exit {:?}, {evil} superuser afterwards: {superuser}; {}",
        run.code,
        run.stderr.trim()
    );
    assert!(
        !superuser,
        "the install ran {evil}'s trigger as the installer"
    );
    assert_ne!(run.code, Some(0), "{}", run.stdout);
    let last = run
        .stderr
        .trim()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert!(
        last.contains("schema postie") && last.contains(&evil),
        "one line naming the schema and its owner: {}",
        run.stderr
    );
}

/// The installer owns the schema, but `outbox_version` is a view, or a table of
/// another role: refused too, nothing applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_refuses_an_outbox_version_that_is_not_its_plain_table() {
    let env = TestEnv::new("outbox-version").await;
    let producer = ProducerDb::empty(&env).await;
    let id = &env.db_name[env.db_name.len() - 10..];
    let other = format!("ob_other_{id}");
    let _roles = Roles::create(&producer, &[&other]).await;
    let client = producer.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.versions_{id} (version integer PRIMARY KEY, name text NOT NULL,
                                                  applied_at timestamptz NOT NULL DEFAULT now());
             CREATE SCHEMA postie;
             CREATE VIEW postie.outbox_version AS SELECT * FROM public.versions_{id};"
        ))
        .await
        .unwrap();
    let run = run_postie(
        &["outbox", "install", "--database", &producer.url()],
        &env.env_vars(),
    );
    assert_ne!(run.code, Some(0), "a view: {}", run.stdout);
    assert!(run.stderr.contains("not a plain table"), "{}", run.stderr);
    client
        .batch_execute(&format!(
            "DROP VIEW postie.outbox_version;
             GRANT USAGE, CREATE ON SCHEMA postie TO {other};
             SET ROLE {other};
             CREATE TABLE postie.outbox_version (version integer PRIMARY KEY, name text NOT NULL,
                                                 applied_at timestamptz NOT NULL DEFAULT now());
             RESET ROLE;"
        ))
        .await
        .unwrap();
    let run = run_postie(
        &["outbox", "install", "--database", &producer.url()],
        &env.env_vars(),
    );
    assert_ne!(run.code, Some(0), "another role's table: {}", run.stdout);
    assert!(run.stderr.contains(&other), "{}", run.stderr);
    let outbox: Option<String> = client
        .query_one("SELECT to_regclass('postie.outbox')::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(outbox, None, "nothing applied");
}
