//! The model's scenarios as real statements against PostgreSQL: each step runs
//! through postie's own `Inbox` (or, for the statements it keeps crate-private, the
//! SQL text read from its source) and through the model's mirror of it, and the two
//! must answer alike and leave the row alike. A fresh database per test, migrated
//! with postie's migrations, dropped at the end.

use std::time::Duration;

use postie::config::DatabaseSettings;
use postie::testing::inbox::{Claim, Completion, Inbox, Scheduled};
use postie_model::inbox::{self as model, Answer, Row, Status};
use postie_model::sql::MIRRORED;
use secrecy::SecretString;

/// One model clock step in real time (leases are whole steps).
const STEP: Duration = Duration::from_millis(300);
/// `worker.lease` in steps, as in `Protocol::small`.
const LEASE: u8 = 2;
const KEY: &str = "order-34:reminder";

fn pg_base() -> String {
    std::env::var("POSTIE_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

async fn admin(db: &str) -> tokio_postgres::Client {
    let (client, conn) =
        tokio_postgres::connect(&format!("{}/{db}", pg_base()), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL at POSTIE_TEST_PG");
    tokio::spawn(conn);
    client
}

/// The test's database: created, migrated, dropped with the guard.
struct Db(String);

impl Drop for Db {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.0);
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async { admin("postgres").await.batch_execute(&sql).await })
        })
        .join();
    }
}

/// The real inbox and the model's row, stepped side by side.
struct Pair {
    inbox: Inbox,
    db: tokio_postgres::Client,
    row: Option<Row>,
    clock: u8,
    _guard: Db,
}

impl Pair {
    async fn new(name: &str) -> Self {
        let db_name = format!(
            "postie_t_model_{name}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        admin("postgres")
            .await
            .batch_execute(&format!("CREATE DATABASE {db_name}"))
            .await
            .unwrap();
        let guard = Db(db_name.clone());
        let settings = DatabaseSettings {
            url: SecretString::from(format!("{}/{db_name}", pg_base())),
            ..Default::default()
        };
        let inbox = Inbox::new(&settings.plan().unwrap(), &settings).unwrap();
        inbox.migrate().await.unwrap();
        Pair {
            inbox,
            db: admin(&db_name).await,
            row: None,
            clock: 0,
            _guard: guard,
        }
    }

    /// Time passes: `steps` of the model's clock.
    async fn tick(&mut self, steps: u8) {
        tokio::time::sleep(STEP * steps as u32).await;
        self.clock += steps;
    }

    /// `postie_claim` for worker `w` at revision `rev`, both ways.
    async fn claim(&mut self, w: u8, rev: u8) -> Answer {
        let real = self
            .inbox
            .claim(KEY, &format!("w{w}"), STEP * LEASE as u32, rev as i32)
            .await
            .unwrap();
        let modelled = model::postie_claim(&mut self.row, w, LEASE, rev, self.clock);
        let real = match real {
            Claim::Claimed { fence, takeover } => Answer::Claimed {
                fence: fence as u8,
                takeover,
            },
            Claim::AlreadySent => Answer::Done,
            Claim::Cancelled => Answer::Cancelled,
            Claim::Stale => Answer::Stale,
            Claim::Busy { .. } => Answer::Busy,
        };
        assert_eq!(
            real, modelled,
            "postie_claim(w{w}, revision {rev}) at step {}",
            self.clock
        );
        self.same_row().await;
        real
    }

    /// The fenced completion (`Inbox::complete`), both ways.
    async fn complete(&mut self, fence: u8, completion: model::Completion) -> bool {
        let real = match completion {
            model::Completion::Sent => Completion::Sent {
                message_id: "<m@model>",
                due_ms: 0,
                provider: "smtp",
                provider_message_id: None,
            },
            model::Completion::Retrying => Completion::Retrying { error: "451" },
            model::Completion::Dead => Completion::Dead { error: "550" },
        };
        let kept = self
            .inbox
            .complete(KEY, fence as i64, Some("reminder"), real)
            .await
            .unwrap();
        assert_eq!(
            kept,
            model::complete(&mut self.row, fence, completion),
            "COMPLETE {completion:?} fence {fence}"
        );
        self.same_row().await;
        kept
    }

    /// `postie_cancel` (`Inbox::cancel`), both ways.
    async fn cancel(&mut self, rev: u8) {
        self.inbox.cancel(KEY, Some(rev as i32)).await.unwrap();
        model::postie_cancel(&mut self.row, rev);
        self.same_row().await;
    }

    /// `Inbox::schedule_many` of one job, both ways.
    async fn schedule(&mut self, rev: u8, due: u8) {
        let job = Scheduled {
            key: KEY.into(),
            revision: rev as i32,
            due_ms: due as i64 * 1000,
            lane: None,
            body: Some(b"{}".to_vec()),
        };
        self.inbox.schedule_many(&[job]).await.unwrap();
        model::schedule(&mut self.row, rev, due);
        self.same_row().await;
    }

    /// `Inbox::renew` (crate-private: its SQL text, read from postie's source), both ways.
    async fn renew(&mut self, fence: u8) -> bool {
        let sql = statement("Inbox::renew (inbox::renew)");
        let lease_ms = (STEP * LEASE as u32).as_millis() as i64;
        let real = self
            .db
            .execute(&sql, &[&KEY, &(fence as i64), &lease_ms])
            .await
            .unwrap()
            == 1;
        assert_eq!(
            real,
            model::renew(&mut self.row, fence, LEASE, self.clock),
            "renew fence {fence}"
        );
        self.same_row().await;
        real
    }

    /// `Inbox::finish_cancelled` (crate-private: its SQL text), both ways.
    async fn finish_cancelled(&mut self, rev: u8) {
        let sql = statement("Inbox::finish_cancelled (inbox::finish_cancelled)");
        self.db
            .execute(&sql, &[&KEY, &(rev as i32), &true, &Some("reminder")])
            .await
            .unwrap();
        model::finish_cancelled(&mut self.row, rev, self.clock);
        self.same_row().await;
    }

    /// Whether the reconciler would re-publish the row now (`Inbox::overdue`, due
    /// and grace aside), both ways.
    async fn overdue(&self) -> bool {
        let sql = statement("Inbox::overdue (protocol::reconcilable)");
        // Due before 2096, no grace: only the row's status decides.
        let rows = self
            .db
            // The default lane, no other lane configured (issue 33's lane filter).
            .query(
                &sql,
                &[
                    &4_000_000_000_000i64,
                    &0i64,
                    &10i64,
                    &None::<&str>,
                    &Vec::<&str>::new(),
                ],
            )
            .await
            .unwrap();
        let real = rows.iter().any(|r| r.get::<_, &str>(0) == KEY);
        let modelled = self
            .row
            .is_some_and(|r| postie_model::protocol::reconcilable(&r, self.clock));
        assert_eq!(real, modelled, "overdue at step {}", self.clock);
        real
    }

    /// The row in PostgreSQL is the model's row (the columns the model keeps).
    async fn same_row(&self) {
        let got = self
            .db
            .query_opt(
                "SELECT status, owner IS NOT NULL, fence, revision, cancelled_through, body IS NOT NULL,
                        rescheduled
                   FROM postie_inbox WHERE key = $1",
                &[&KEY],
            )
            .await
            .unwrap()
            .map(|r| {
                let status: String = r.get(0);
                (status, r.get::<_, bool>(1), r.get::<_, i64>(2), r.get::<_, i32>(3), r.get::<_, Option<i32>>(4), r.get::<_, bool>(5), r.get::<_, bool>(6))
            });
        let want = self.row.map(|r| {
            let status = format!("{:?}", r.status).to_lowercase();
            (
                status,
                r.owner.is_some(),
                r.fence as i64,
                r.revision as i32,
                r.cancelled_through.map(i32::from),
                r.body,
                r.rescheduled,
            )
        });
        assert_eq!(
            got, want,
            "the row in PostgreSQL and in the model, at step {}",
            self.clock
        );
    }
}

/// A statement postie keeps crate-private, as its source spells it: the string
/// literal of the `const` the model mirrors (`src/inbox/machine/`), or the literal
/// around the mirrored text (a statement written where it is prepared).
fn statement(what: &str) -> String {
    let m = MIRRORED.iter().find(|m| m.what == what).expect("mirrored");
    let path = format!("{}/../../{}", env!("CARGO_MANIFEST_DIR"), m.file);
    let source = std::fs::read_to_string(path).unwrap();
    let text = m.text(&source).unwrap();
    if let Some(quote) = text.find('"') {
        let open = quote + 1;
        let close = open + text[open..].find('"').expect("its end");
        return text[open..close].to_string();
    }
    let at = source.find(text).unwrap();
    let open = source[..at].rfind('"').unwrap() + 1;
    let close = at + source[at..].find('"').unwrap();
    source[open..close].to_string()
}

fn claimed(answer: Answer) -> (u8, bool) {
    match answer {
        Answer::Claimed { fence, takeover } => (fence, takeover),
        other => panic!("expected a claim, got {other:?}"),
    }
}

#[tokio::test]
async fn normal_send_then_a_duplicate_delivery() {
    let mut p = Pair::new("normal").await;
    let (fence, takeover) = claimed(p.claim(0, 0).await);
    assert_eq!((fence, takeover), (1, false));
    assert!(p.complete(fence, model::Completion::Sent).await);
    assert_eq!(p.claim(1, 0).await, Answer::Done);
}

#[tokio::test]
async fn takeover_after_lease_expiry_refuses_the_stale_completion() {
    let mut p = Pair::new("takeover").await;
    let (old, _) = claimed(p.claim(0, 0).await);
    p.tick(1).await;
    assert_eq!(p.claim(1, 0).await, Answer::Busy, "a live lease");
    p.tick(LEASE).await;
    let (new, takeover) = claimed(p.claim(1, 0).await);
    assert!(takeover && new == old + 1);
    assert!(!p.renew(old).await, "the old claim's renewal finds it gone");
    assert!(
        !p.complete(old, model::Completion::Sent).await,
        "the stale fence records nothing"
    );
    assert!(p.complete(new, model::Completion::Sent).await);
}

#[tokio::test]
async fn duplicate_publish_is_busy_then_done() {
    let mut p = Pair::new("dup").await;
    p.schedule(0, 0).await;
    p.schedule(0, 0).await;
    let (fence, _) = claimed(p.claim(0, 0).await);
    assert_eq!(p.claim(1, 0).await, Answer::Busy);
    assert!(p.renew(fence).await);
    assert!(p.complete(fence, model::Completion::Sent).await);
    assert_eq!(p.claim(1, 0).await, Answer::Done);
}

#[tokio::test]
async fn cancel_before_the_claim_wins() {
    let mut p = Pair::new("cancel_before").await;
    p.cancel(0).await;
    p.schedule(0, 0).await;
    assert_eq!(p.claim(0, 0).await, Answer::Cancelled);
    p.schedule(1, 1).await;
    let (_, takeover) = claimed(p.claim(0, 1).await);
    assert!(!takeover, "a newer revision is past the cancel: claimed");
}

#[tokio::test]
async fn cancel_after_the_claim_keeps_sending_and_ends_a_failed_send() {
    let mut p = Pair::new("cancel_after").await;
    let (fence, _) = claimed(p.claim(0, 0).await);
    p.cancel(0).await;
    assert!(p.complete(fence, model::Completion::Retrying).await);
    assert_eq!(p.claim(1, 0).await, Answer::Cancelled);
    p.finish_cancelled(0).await;
    assert_eq!(p.row.unwrap().status, Status::Cancelled);
}

#[tokio::test]
async fn reschedule_to_a_newer_revision() {
    let mut p = Pair::new("reschedule").await;
    p.schedule(0, 2).await;
    p.schedule(1, 1).await;
    assert_eq!(p.claim(0, 0).await, Answer::Stale);
    let (fence, _) = claimed(p.claim(1, 1).await);
    // A newer revision arriving while the older is sent is remembered.
    assert_eq!(p.claim(0, 2).await, Answer::Busy);
    assert!(p.complete(fence, model::Completion::Retrying).await);
    assert_eq!(p.claim(1, 1).await, Answer::Stale);
    claimed(p.claim(0, 2).await);
}

#[tokio::test]
async fn crash_between_claim_and_complete() {
    let mut p = Pair::new("crash").await;
    p.schedule(0, 0).await;
    let (old, _) = claimed(p.claim(0, 0).await);
    // Worker 0 dies here; its delivery comes back.
    assert_eq!(p.claim(1, 0).await, Answer::Busy);
    p.tick(LEASE + 1).await;
    let (new, takeover) = claimed(p.claim(1, 0).await);
    assert!(takeover && new > old);
    assert!(p.complete(new, model::Completion::Dead).await);
    claimed(p.claim(0, 0).await);
}

/// Finding 1 of the model (issue 34), fixed by sql/0017: the relay's record of a
/// newer revision was dropped while the row was `sending` (`Inbox::schedule_many`
/// updated only `scheduled`, `cancelled` and `retrying` rows), so postie forgot it:
///
/// 1. revision 0 is recorded and claimed by worker 0 (`sending`);
/// 2. the producer reschedules: the relay recorded revision 1, which changed nothing;
/// 3. worker 0's send fails (4xx): `retrying`, still at revision 0;
/// 4. the retry of revision 0 claimed it again (step ②) and its superseded content
///    went out; revision 1 later found the key `sent`.
///
/// And if the broker lost revision 1 (what the reconciler is for, I9), no scheduled
/// row held it. Now the record marks the row `rescheduled` and the failed send leaves
/// it `scheduled` for revision 1, with its body.
/// Steps 1-3 of finding 1: revision 0 claimed, revision 1 recorded, the send failed.
async fn finding_1(name: &str) -> Pair {
    let mut p = Pair::new(name).await;
    p.schedule(0, 0).await;
    let (fence, _) = claimed(p.claim(0, 0).await);
    p.schedule(1, 1).await;
    assert!(p.complete(fence, model::Completion::Retrying).await);
    p
}

#[tokio::test]
async fn finding_1_a_newer_revision_recorded_while_sending_is_remembered() {
    let mut p = finding_1("finding1").await;
    assert_eq!(
        p.row.unwrap().revision,
        1,
        "the relay's record of revision 1 is remembered"
    );
    assert_eq!(
        p.row.unwrap().status,
        model::Status::Scheduled,
        "the failed send leaves the row scheduled for revision 1"
    );
    assert_eq!(
        p.claim(1, 0).await,
        Answer::Stale,
        "revision 0 is stale once revision 1 is recorded"
    );
}

/// Steps 1-3 of finding 2: worker 0 claims and dies; a cancel lands while the row is
/// `sending`; its lease runs out; the redelivery's claim answers `cancelled`, and the
/// worker finishes the cancel (`Inbox::finish_cancelled`).
async fn finding_2(name: &str) -> Pair {
    let mut p = Pair::new(name).await;
    p.schedule(0, 0).await;
    claimed(p.claim(0, 0).await);
    p.cancel(0).await;
    p.tick(LEASE + 1).await;
    assert_eq!(p.claim(1, 0).await, Answer::Cancelled);
    p.finish_cancelled(0).await;
    p
}

/// Finding 2 of the model (issue 34), fixed: a row left `sending` by a worker that
/// died (after its 250, or before it), then cancelled, stayed `sending` for good:
/// `postie_claim` answers `cancelled` (the cancel covers the revision) and
/// `Inbox::finish_cancelled` ended only `retrying` rows. No terminal status, no
/// delivery event, never pruned. Now `finish_cancelled` also ends a `sending` row
/// whose lease ran out, moving the fence.
#[tokio::test]
async fn finding_2_a_cancelled_row_left_sending_ends() {
    let p = finding_2("finding2").await;
    assert!(p.row.unwrap().status.terminal(), "{:?}", p.row);
    assert_eq!(
        p.row.unwrap().fence,
        3,
        "the dead worker's fence (2) is refused"
    );
}

/// Finding 3 of the model (issue 34), fixed: a row the relay rescheduled while it was
/// `sending`, whose sender then crashed, was left `sending` when the broker lost the
/// newer revision's copy: the older revision's redelivery is stale, and the
/// reconciler read `scheduled` rows only. Now it also re-publishes such a row once
/// its sender's lease has run out, and the newer revision takes it over.
#[tokio::test]
async fn finding_3_a_rescheduled_row_whose_sender_is_gone_is_reconciled() {
    let mut p = Pair::new("finding3").await;
    p.schedule(0, 0).await;
    claimed(p.claim(0, 0).await);
    p.schedule(1, 1).await;
    assert!(!p.overdue().await, "not while its sender's lease runs");
    p.tick(LEASE + 1).await;
    assert_eq!(
        p.claim(1, 0).await,
        Answer::Stale,
        "the older revision's redelivery"
    );
    assert!(p.overdue().await, "the reconciler re-publishes revision 1");
    let (_, takeover) = claimed(p.claim(1, 1).await);
    assert!(takeover, "revision 1 takes over the crashed sender's claim");
}
