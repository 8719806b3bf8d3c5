//! Claims in batches (`src/inbox/machine/claim.rs`) against a real PostgreSQL: claims
//! asked at once share a statement and a transaction, and each caller hears its own
//! key's answer, as from a claim of its own.
//!
//! - 64 claims at once, each of 32 keys asked by two owners: every key claimed by
//!   exactly one of them (the other hears `busy`), every row `sending` under its
//!   claimer, and fewer transactions than keys (the rows' `xmin`): batches ran;
//! - a batch PostgreSQL refuses for one row (a key with a NUL byte, which `text`
//!   cannot hold): only that row's caller hears the refusal, the rest are claimed.

mod support;

use std::time::Duration;

use postie::testing::inbox::{Claim, Inbox};
use support::Db;

const LEASE: Duration = Duration::from_secs(30);

/// An inbox on a PostgreSQL-only environment: claims need no broker.
async fn inbox(env: &Db) -> Inbox {
    let settings = env.settings();
    let plan = settings.plan().unwrap();
    let inbox = Inbox::new(&plan, &settings).unwrap();
    inbox.migrate().await.unwrap();
    inbox
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_asked_at_once_share_a_statement_and_each_hears_its_own_answer() {
    let env = Db::new("claims-batch").await;
    let inbox = inbox(&env).await;
    let keys: Vec<String> = (0..32).map(|i| format!("batch-{i:02}")).collect();
    let asks = keys.iter().flat_map(|key| {
        ["a", "b"].map(|owner| {
            let inbox = inbox.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let claim = inbox.claim(&key, owner, LEASE, 0).await.unwrap();
                (key, owner, claim)
            })
        })
    });
    let answers = futures_util::future::join_all(asks.collect::<Vec<_>>()).await;
    let db = env.client().await;
    for key in &keys {
        let mine: Vec<_> = answers
            .iter()
            .map(|a| a.as_ref().unwrap())
            .filter(|(k, _, _)| k == key)
            .collect();
        let claimed: Vec<&str> = mine
            .iter()
            .filter(|(_, _, c)| {
                matches!(
                    c,
                    Claim::Claimed {
                        fence: 1,
                        takeover: false
                    }
                )
            })
            .map(|(_, owner, _)| *owner)
            .collect();
        let busy = mine
            .iter()
            .filter(|(_, _, c)| matches!(c, Claim::Busy { .. }))
            .count();
        assert_eq!((claimed.len(), busy), (1, 1), "{key}: {mine:?}");
        let row = db
            .query_one(
                "SELECT status, owner FROM postie_inbox WHERE key = $1",
                &[key],
            )
            .await
            .unwrap();
        let (status, owner): (String, String) = (row.get(0), row.get(1));
        assert_eq!((status.as_str(), owner.as_str()), ("sending", claimed[0]));
    }
    let transactions: i64 = db
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM postie_inbox WHERE key LIKE 'batch-%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    println!("FIGURES 64 claims at once of 32 keys: {transactions} transactions");
    assert!(
        transactions < keys.len() as i64,
        "{transactions} transactions for {} keys: no claims shared a batch",
        keys.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_postgresql_refuses_fails_alone_and_the_rest_of_its_batch_is_claimed() {
    let env = Db::new("claims-refused").await;
    let inbox = inbox(&env).await;
    let keys: Vec<String> = (0..16)
        .map(|i| match i {
            7 => "refused-\0-nul".to_string(),
            _ => format!("fine-{i:02}"),
        })
        .collect();
    let asks = keys.iter().map(|key| {
        let inbox = inbox.clone();
        let key = key.clone();
        tokio::spawn(async move { (inbox.claim(&key, "a", LEASE, 0).await, key) })
    });
    for answer in futures_util::future::join_all(asks.collect::<Vec<_>>()).await {
        let (claim, key) = answer.unwrap();
        if key.contains('\0') {
            let error = claim.expect_err("a NUL byte in a text key");
            assert!(!error.is_outage(), "{key:?}: {error}");
        } else {
            assert!(
                matches!(claim, Ok(Claim::Claimed { fence: 1, .. })),
                "{key}: {claim:?}"
            );
        }
    }
    let claimed: i64 = env
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM postie_inbox WHERE key LIKE 'fine-%' AND status = 'sending'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(claimed, 15);
}
