//! The suppression list (issue 30) end to end: a real RabbitMQ, a real PostgreSQL and
//! the SMTP test server answering RCPT TO as a receiving server would.
//!
//! - `550 5.1.1`: the address is suppressed; the next job to it ends `suppressed`
//!   (acked, never sent, never dead-lettered); a job to it and another address goes to
//!   the other only; a hard bounce of one of two recipients retries for the other;
//! - `550 5.7.1 … low reputation`, `552 5.2.2`, `452 4.2.2`: never suppress;
//! - a bare `550` twice within the window suppresses (the strikes);
//! - `ignore_suppression` sends to a suppressed address and says so in the log;
//! - `postie suppression add|list|remove` (a scope of one job type, an expiry), and an
//!   entry added while postie runs reaching it within seconds (its filter's refresh).

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{eventually, job, message_id, TestEnv};

const WAIT: Duration = Duration::from_secs(60);

/// Live suppression rows: (address, scope, reason, source, evidence).
async fn suppressions(env: &TestEnv) -> Vec<(String, String, String, String, String)> {
    match env
        .db()
        .await
        .query(
            "SELECT address, scope, reason, source, coalesce(evidence, '') FROM postie_suppression \
              ORDER BY address, scope",
            &[],
        )
        .await
    {
        Ok(rows) => rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// A job to several recipients.
fn job_to(key: &str, to: &[&str]) -> Value {
    let mut body = job(key, to[0]);
    body["to"] = json!(to);
    body
}

/// The sink's envelope recipients of `key`'s email, if it got one.
async fn delivered_to(env: &TestEnv, key: &str) -> Vec<Vec<String>> {
    let id = message_id(key);
    env.sink
        .messages(false)
        .await
        .into_iter()
        .filter(|m| m.message_id == id)
        .map(|m| m.rcpt_to)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_bounce_suppresses_the_address_for_the_jobs_after_it() {
    let env = TestEnv::new("supp-hard").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "gone", "action": {"reply": "550 5.1.1 <gone@example.com>: no such user"}},
            {"stage": "rcpt", "rcpt_contains": "left", "action": {"reply": "550 5.1.1 user unknown"}}
        ]))
        .await;
    let serving = env.serve(env.settings());

    // The bounce itself: dead-lettered as a permanent refusal, the address suppressed.
    env.publish(&job("sh-first", "gone@example.com")).await;
    env.wait_for_status("sh-first", "dead", WAIT).await;
    let rows = suppressions(&env).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (address, scope, reason, source, evidence) = &rows[0];
    assert_eq!(
        (
            address.as_str(),
            scope.as_str(),
            reason.as_str(),
            source.as_str()
        ),
        ("gone@example.com", "*", "hard_bounce", "smtp")
    );
    assert!(evidence.contains("5.1.1"), "{evidence}");

    // The next job to it: never sent, not dead, acked.
    env.publish(&job("sh-next", "Gone@Example.com")).await;
    env.wait_for_status("sh-next", "suppressed", WAIT).await;
    let row = env.inbox_row("sh-next").await.unwrap();
    assert_eq!(row.attempts, 0, "no SMTP attempt");

    // To it and another: the other only.
    env.publish(&job_to(
        "sh-both",
        &["gone@example.com", "kept@example.com"],
    ))
    .await;
    env.wait_for_status("sh-both", "sent", WAIT).await;
    assert_eq!(
        delivered_to(&env, "sh-both").await,
        [vec!["kept@example.com".to_string()]]
    );

    // A hard bounce of one of two recipients: retried for the other, who gets it once.
    env.publish(&job_to(
        "sh-split",
        &["left@example.com", "stays@example.com"],
    ))
    .await;
    env.wait_for_status("sh-split", "sent", WAIT).await;
    assert_eq!(
        delivered_to(&env, "sh-split").await,
        [vec!["stays@example.com".to_string()]]
    );
    assert_eq!(suppressions(&env).await.len(), 2);
    serving.stop().await;

    let dead = env.take_dead_letters().await;
    assert_eq!(dead.len(), 1, "only the first bounce is a dead letter");
    assert!(dead[0].reason().contains("5.1.1"), "{}", dead[0].reason());
    assert_eq!(
        env.depth(env.topology.send_queue()).await,
        0,
        "everything acked"
    );
    assert!(delivered_to(&env, "sh-next").await.is_empty());
    eprintln!(
        "FIGURES suppression hard bounce: 550 5.1.1 suppressed the address; the next job ended suppressed \
         with 0 attempts, a job to it and another reached the other only, a bounce of one of two \
         recipients was retried for the other; 1 dead letter (the bounce itself)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_full_mailbox_and_transient_refusals_never_suppress_and_bare_550s_strike() {
    let env = TestEnv::new("supp-never").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "policy", "action": {"reply": "550 5.7.1 Our system has detected that this message is likely unsolicited: low reputation"}},
            {"stage": "rcpt", "rcpt_contains": "full", "action": {"reply": "552 5.2.2 mailbox full"}},
            {"stage": "rcpt", "rcpt_contains": "later", "action": {"reply": "452 4.2.2 over quota"}, "times": 1},
            {"stage": "rcpt", "rcpt_contains": "bare", "action": {"reply": "550 no such user here"}}
        ]))
        .await;
    let serving = env.serve(env.settings());
    for (key, to) in [
        ("sn-policy", "policy@example.com"),
        ("sn-full", "full@example.com"),
        ("sn-later", "later@example.com"),
        ("sn-bare-1", "bare@example.com"),
    ] {
        env.publish(&job(key, to)).await;
    }
    for (key, want) in [
        ("sn-policy", "dead"),
        ("sn-full", "dead"),
        ("sn-later", "sent"),
        ("sn-bare-1", "dead"),
    ] {
        env.wait_for_status(key, want, WAIT).await;
    }
    assert!(
        suppressions(&env).await.is_empty(),
        "5.7.1, 5.2.2, 4.2.2 and one bare 550 suppress nothing"
    );
    // The second bare 550 within the window: suppressed; the third job never goes.
    env.publish(&job("sn-bare-2", "bare@example.com")).await;
    env.wait_for_status("sn-bare-2", "dead", WAIT).await;
    let envr = &env;
    eventually("the strikes suppress", WAIT, || async move {
        (suppressions(envr).await.len() == 1).then_some(())
    })
    .await;
    let rows = suppressions(&env).await;
    assert_eq!(
        (rows[0].0.as_str(), rows[0].2.as_str()),
        ("bare@example.com", "hard_bounce")
    );
    assert!(rows[0].4.contains("2 permanent failures"), "{}", rows[0].4);
    env.publish(&job("sn-bare-3", "bare@example.com")).await;
    env.wait_for_status("sn-bare-3", "suppressed", WAIT).await;
    serving.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_manage_the_list_and_a_job_may_override_it() {
    let env = TestEnv::new("supp-cli").await;
    env.postie(&["migrate"]).unwrap();
    let add = env
        .postie(&[
            "suppression",
            "add",
            "Ann@Example.com",
            "--reason",
            "complaint",
            "--note",
            "ARF report 42",
        ])
        .unwrap();
    assert!(add.contains("suppressed"), "{add}");
    let again = env
        .postie(&[
            "suppression",
            "add",
            "ann@example.com",
            "--reason",
            "complaint",
        ])
        .unwrap();
    assert!(again.contains("already"), "{again}");
    // A scope of one job type, and an entry that has already expired.
    env.postie(&[
        "suppression",
        "add",
        "bob@example.com",
        "--scope",
        "newsletter",
    ])
    .unwrap();
    env.postie(&["suppression", "add", "cat@example.com", "--expires", "1ms"])
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let list = env.postie(&["suppression", "list"]).unwrap();
    assert!(
        list.contains("ann@example.com\t*\tcomplaint\tcli"),
        "{list}"
    );
    assert!(
        list.contains("bob@example.com\tnewsletter\tmanual"),
        "{list}"
    );
    assert!(!list.contains("cat@example.com"), "expired: {list}");
    assert!(list.contains("2 suppressed"), "{list}");

    let mut postie = env.spawn_process(&[("RUST_LOG", "info")]);
    let mut to_bob = job("so-bob-order", "bob@example.com");
    to_bob["type"] = json!("order");
    let mut to_bob_news = job("so-bob-news", "bob@example.com");
    to_bob_news["type"] = json!("newsletter");
    let mut override_ann = job("so-ann-reset", "ann@example.com");
    override_ann["ignore_suppression"] = json!(true);
    for body in [
        job("so-ann", "ann@example.com"),
        to_bob,
        to_bob_news,
        override_ann,
        job("so-cat", "cat@example.com"),
    ] {
        env.publish(&body).await;
    }
    for (key, want) in [
        ("so-ann", "suppressed"),
        ("so-bob-order", "sent"),
        ("so-bob-news", "suppressed"),
        ("so-ann-reset", "sent"),
        ("so-cat", "sent"),
    ] {
        env.wait_for_status(key, want, WAIT).await;
    }
    // Added while postie runs: its filter reads new entries every second.
    env.postie(&["suppression", "add", "dan@example.com"])
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.publish(&job("so-dan", "dan@example.com")).await;
    env.wait_for_status("so-dan", "suppressed", WAIT).await;
    postie.terminate(Duration::from_secs(20));
    let log = postie.log();
    assert!(
        log.contains("ignore_suppression") && log.contains("ann@example.com: complaint"),
        "the override is logged:\n{log}"
    );
    let removed = env
        .postie(&["suppression", "remove", "ann@example.com"])
        .unwrap();
    assert!(removed.contains("1 entry removed"), "{removed}");
    let audit: i64 = env
        .db()
        .await
        .query_one(
            "SELECT count(*) FROM postie_suppression_audit WHERE address = 'ann@example.com'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        audit, 2,
        "one add (the repeat changed nothing) and one remove"
    );
    let status = env.postie(&["status"]).unwrap();
    assert!(status.contains("suppressed"), "{status}");
}

/// `postie suppression export` writes the list as CSV, which `import` reads back (a
/// second import adds nothing); a provider's export (`email`, `reason` in its words)
/// is understood; a file with one bad row is refused whole, naming its line.
#[tokio::test]
async fn the_list_goes_out_and_comes_back_as_csv() {
    let env = TestEnv::new("supp-csv").await;
    env.postie(&["migrate"]).unwrap();
    env.postie(&[
        "suppression",
        "add",
        "ann@example.com",
        "--reason",
        "complaint",
        "--note",
        "ARF, report 7",
    ])
    .unwrap();
    env.postie(&[
        "suppression",
        "add",
        "bob@example.com",
        "--scope",
        "newsletter",
        "--expires",
        "30d",
    ])
    .unwrap();
    let dir = std::env::temp_dir().join(format!("postie-supp-csv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exported = dir.join("list.csv");
    env.postie(&[
        "suppression",
        "export",
        "--file",
        exported.to_str().unwrap(),
    ])
    .unwrap();
    let text = std::fs::read_to_string(&exported).unwrap();
    assert!(
        text.starts_with("address,scope,reason,source,created_at,expires_at,evidence\n"),
        "{text}"
    );
    assert!(text.contains("ann@example.com,*,complaint,cli,"), "{text}");
    assert!(text.contains("\"ARF, report 7\""), "quoted: {text}");
    assert!(
        text.contains("bob@example.com,newsletter,manual,cli,"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 3, "{text}");

    // Emptied, then read back: the same rows, the expiry kept.
    env.postie(&["suppression", "remove", "ann@example.com"])
        .unwrap();
    env.postie(&["suppression", "remove", "bob@example.com"])
        .unwrap();
    assert!(suppressions(&env).await.is_empty());
    let path = exported.to_str().unwrap();
    let first = env.postie(&["suppression", "import", path]).unwrap();
    assert!(first.contains("2 rows read: 2 added"), "{first}");
    let again = env.postie(&["suppression", "import", path]).unwrap();
    assert!(again.contains("2 rows read: 0 added"), "{again}");
    let rows = suppressions(&env).await;
    assert_eq!(
        rows,
        vec![
            (
                "ann@example.com".into(),
                "*".into(),
                "complaint".into(),
                "import".into(),
                "ARF, report 7".into()
            ),
            (
                "bob@example.com".into(),
                "newsletter".into(),
                "manual".into(),
                "import".into(),
                String::new()
            ),
        ]
    );
    let expires: i64 = env
        .db()
        .await
        .query_one(
            "SELECT count(*) FROM postie_suppression WHERE address = 'bob@example.com' \
               AND expires_at > now() + interval '29 days'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(expires, 1, "the expiry came back");

    // A provider's export, its own column names and words.
    let provider = dir.join("provider.csv");
    std::fs::write(&provider, "Email,Reason,Created\nCat@Example.com,bounce,1700000000\ndan@example.com,spamreport,1700000001\n").unwrap();
    let out = env
        .postie(&[
            "suppression",
            "import",
            provider.to_str().unwrap(),
            "--source",
            "sendgrid-export",
        ])
        .unwrap();
    assert!(out.contains("2 added"), "{out}");
    let rows = suppressions(&env).await;
    assert!(
        rows.contains(&(
            "cat@example.com".into(),
            "*".into(),
            "hard_bounce".into(),
            "sendgrid-export".into(),
            String::new()
        )),
        "{rows:?}"
    );
    assert!(
        rows.contains(&(
            "dan@example.com".into(),
            "*".into(),
            "complaint".into(),
            "sendgrid-export".into(),
            String::new()
        )),
        "{rows:?}"
    );

    // One bad row: refused whole, nothing added.
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "email\neve@example.com\nnobody-at-all\n").unwrap();
    let refused = env
        .postie(&["suppression", "import", bad.to_str().unwrap()])
        .unwrap_err();
    assert!(
        refused.contains("line 3") && refused.contains("nobody-at-all"),
        "{refused}"
    );
    assert!(!suppressions(&env)
        .await
        .iter()
        .any(|r| r.0 == "eve@example.com"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Formula injection (issue 45, item 6): a cell that a spreadsheet would evaluate
/// (an address or a note beginning with `=`, `+`, `-`, `@`, a tab or a carriage
/// return, say from a bounce's text) goes out with a single quote in front, so that
/// the spreadsheet shows it as text, and comes back as it was.
#[tokio::test]
async fn a_cell_a_spreadsheet_would_evaluate_goes_out_neutralised_and_comes_back() {
    let env = TestEnv::new("supp-formula").await;
    env.postie(&["migrate"]).unwrap();
    let formula = "=HYPERLINK(\"http://evil.example/?x\",\"open\")";
    let entries = [
        ("=1+1@example.com", "-2+3"),
        ("+sum@example.com", formula),
        ("-cmd@example.com", "@SUM(1)"),
        ("'quoted@example.com", "\tcmd"),
    ];
    for (address, note) in entries {
        let note = format!("--note={note}");
        env.postie(&["suppression", "add", &note, "--", address])
            .unwrap_or_else(|e| panic!("adding {address}: {e}"));
    }
    let dir = std::env::temp_dir().join(format!("postie-supp-formula-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exported = dir.join("list.csv");
    let path = exported.to_str().unwrap();
    env.postie(&["suppression", "export", "--file", path])
        .unwrap();
    let text = std::fs::read_to_string(&exported).unwrap();
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    let mut cells = 0;
    for row in reader.records() {
        for cell in row.unwrap().iter() {
            cells += 1;
            assert!(
                !cell.starts_with(['=', '+', '-', '@', '\t', '\r']),
                "a cell a spreadsheet would evaluate: {cell:?} in\n{text}"
            );
        }
    }
    assert_eq!(cells, 7 * entries.len(), "{text}");
    assert!(text.contains("'=1+1@example.com"), "{text}");

    // Read back: the same addresses and notes.
    for (address, _) in entries {
        env.postie(&["suppression", "remove", "--", address])
            .unwrap();
    }
    let imported = env.postie(&["suppression", "import", path]).unwrap();
    assert!(imported.contains("4 rows read: 4 added"), "{imported}");
    let rows: Vec<(String, String)> = suppressions(&env)
        .await
        .into_iter()
        .map(|r| (r.0, r.4))
        .collect();
    for (address, note) in entries {
        assert!(
            rows.contains(&(address.to_string(), note.to_string())),
            "{address} {note:?} in {rows:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bounce rates per job type: a send-time hard bounce is recorded as feedback under
/// its job's type, sends are counted per type, `postie status` shows both over the
/// last hour and day (marking a rate over its threshold), and the maintenance instance
/// exports the rates and warns once a type's rate passes
/// `suppression.bounce_rate_warning`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounce_rates_per_type_show_in_status_metrics_and_a_warning() {
    let env = TestEnv::new("supp-rates").await;
    env.sink
        .set_faults(json!([
            {"stage": "rcpt", "rcpt_contains": "gone", "action": {"reply": "550 5.1.1 no such user"}}
        ]))
        .await;
    let typed = |key: &str, to: &str, kind: &str| {
        let mut body = job(key, to);
        body["type"] = json!(kind);
        body
    };
    let serving = env.serve(env.settings());
    for body in [
        typed("sr-o1", "a@example.com", "order"),
        typed("sr-o2", "b@example.com", "order"),
        typed("sr-o3", "gone@example.com", "order"),
        typed("sr-n1", "c@example.com", "news"),
        typed("sr-n2", "d@example.com", "news"),
    ] {
        env.publish(&body).await;
    }
    for (key, want) in [
        ("sr-o1", "sent"),
        ("sr-o2", "sent"),
        ("sr-o3", "dead"),
        ("sr-n1", "sent"),
        ("sr-n2", "sent"),
    ] {
        env.wait_for_status(key, want, WAIT).await;
    }
    // A stop adds the sends counted since the last flush.
    serving.stop().await;
    let feedback = env
        .db()
        .await
        .query(
            "SELECT source, kind, address, key, type FROM postie_feedback",
            &[],
        )
        .await
        .unwrap();
    let feedback: Vec<(String, String, String, String, String)> = feedback
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        feedback,
        [(
            "smtp".to_string(),
            "bounce".to_string(),
            "gone@example.com".to_string(),
            "sr-o3".to_string(),
            "order".to_string()
        )]
    );
    let vars = [
        ("POSTIE__SUPPRESSION__RATE_MIN_SENDS", "1"),
        ("POSTIE__SUPPRESSION__BOUNCE_RATE_WARNING", "0.2"),
    ];
    let mut args = env.env_vars();
    args.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let status = support::run_postie(&["status"], &args);
    let line = |kind: &str| {
        status
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(kind))
            .unwrap_or_else(|| panic!("no {kind} line:\n{}", status.stdout))
            .to_string()
    };
    let order = line("order");
    assert!(
        order.split_whitespace().take(3).eq(["order", "2", "2"]),
        "two sent in the hour and day: {order}"
    );
    assert!(
        order.contains("1 (50.00 %!)"),
        "one bounce per two sent, marked: {order}"
    );
    let news = line("news");
    assert!(news.contains("0 (0.00 %)"), "{news}");

    // The maintenance instance reads the rates when it starts leading.
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut extra = vars.to_vec();
    extra.push(("POSTIE__HTTP__LISTEN", listen.as_str()));
    let mut postie = env.spawn_process(&extra);
    let url = format!("http://127.0.0.1:{port}/metrics");
    let url = &url;
    let metrics = eventually("the rates exported", WAIT, move || async move {
        let text = reqwest::get(url).await.ok()?.text().await.ok()?;
        text.contains("postie_feedback_rate{").then_some(text)
    })
    .await;
    assert!(
        metrics.contains(r#"postie_feedback_rate{type="order",kind="bounce",window="1d"} 0.5"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"postie_feedback_rate{type="news",kind="bounce",window="1h"} 0"#),
        "{metrics}"
    );
    let warned = eventually("the warning", WAIT, || async {
        let log = postie.log();
        log.contains("over its warning threshold").then_some(log)
    })
    .await;
    postie.terminate(Duration::from_secs(20));
    let warnings: Vec<&str> = warned
        .lines()
        .filter(|l| l.contains("over its warning threshold"))
        .collect();
    assert!(
        warnings.iter().all(|l| l.contains("order")) && !warnings.is_empty(),
        "only order's bounce rate is over 20 %: {warnings:?}"
    );
}
