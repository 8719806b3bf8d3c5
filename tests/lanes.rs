//! Lanes (issue 33): a password reset never waits behind a newsletter. Two lanes,
//! `transactional` (weight 9, the default) and `bulk` (weight 1), share a fleet limit
//! of 50/s against the SMTP test server in quota mode (60/s). A bulk backlog is
//! queued first; transactional jobs then arrive, as a trickle (20/s: their latency)
//! and as a burst (300 at once: the lanes' shares while both wait).
//!
//! Each scenario runs at two sizes. The fast tier's (the tests' own names) queues a
//! backlog that still outlasts the scenario: 2,000 bulk jobs (40 s at 50/s) behind
//! which transactional jobs overtake, 1,000 with a `kill -9` of one of three
//! instances, 1,000 jobs of tenant a ahead of tenant b's 100. The slow tier's
//! (`slow_<name>`) queues today's full sizes, the figures docs/lanes.md and
//! docs/benchmarks.md quote: 20,000, 2,000 and 10,000. Bounds that depend on the size
//! are scaled with it; each says how.
//!
//! Each test prints a `FIGURES` line (run with `--nocapture`): transactional latency
//! from publish to the sink (p50/p99/max), bulk's sends meanwhile and bulk's share
//! while both lanes are busy. Timing is asserted only with generous bounds (timing
//! goals belong in benchmarks; the measured figures are in docs/benchmarks.md). The
//! tests measure send timing: they must not run beside other heavy tests (declared in
//! `.config/nextest.toml`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use support::{free_port, job, message_id, sample, PostieProcess, TestEnv};

const RATE: &str = "50/s";
const QUOTA: u32 = 60;

/// The lanes of every test here.
const LANES: &[(&str, &str)] = &[
    ("POSTIE__TOPOLOGY__DEFAULT_LANE", "transactional"),
    ("POSTIE__TOPOLOGY__LANES__TRANSACTIONAL__WEIGHT", "9"),
    ("POSTIE__TOPOLOGY__LANES__BULK__WEIGHT", "1"),
];

/// How long a fast run's backlog may take to start flowing (100 emails at the sink).
const FLOWING: Duration = Duration::from_secs(120);
/// The same at full size: a 10,000-job single-tenant backlog is parked at 30/s through
/// the delay ladder before its copies come back, which took over 120 s on a busy
/// 2-core machine.
const FLOWING_FULL: Duration = Duration::from_secs(300);

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A bulk job (the lane named) and a transactional one (no lane: the default).
fn bulk(key: &str) -> serde_json::Value {
    let mut body = job(key, "list@example.com");
    body["lane"] = "bulk".into();
    body["tenant"] = "a".into();
    body
}

struct World {
    // Dropped first: the instances must be gone before the env deletes the topology.
    instances: Vec<(PostieProcess, u16)>,
    env: TestEnv,
}

async fn world(name: &str, bulk_jobs: usize, instances: usize) -> World {
    world_with(name, bulk_jobs, instances, &[]).await
}

async fn world_with(
    name: &str,
    bulk_jobs: usize,
    instances: usize,
    settings: &[(&str, &str)],
) -> World {
    let settings: Vec<(&str, &str)> = LANES.iter().chain(settings).copied().collect();
    let env = TestEnv::with_settings(name, &settings).await;
    env.sink.set_quota(Some(QUOTA)).await;
    assert!(
        env.queue_exists(&format!("{}.send.bulk", env.prefix)).await,
        "the bulk lane's queue is declared"
    );
    // Published as a newsletter sender should: into the bulk lane's own intake.
    let bodies: Vec<_> = (0..bulk_jobs)
        .map(|i| {
            (
                bulk(&format!("bulk-{i}")),
                postie::testing::broker::job_properties(),
            )
        })
        .collect();
    for chunk in bodies.chunks(2_000) {
        env.publish_many_routed("email.bulk", chunk).await;
    }
    let instances = (0..instances)
        .map(|_| {
            let port = free_port();
            let listen = format!("127.0.0.1:{port}");
            let extra = [
                ("POSTIE__HTTP__LISTEN", listen.as_str()),
                ("POSTIE__TRANSPORT__RATE_LIMIT", RATE),
            ];
            (env.spawn_process(&extra), port)
        })
        .collect();
    World { instances, env }
}

/// Sink arrival times per key prefix: `(key, received_at_ms)` of every email.
async fn received(env: &TestEnv, keys: &BTreeMap<String, String>) -> Vec<(String, i64)> {
    env.sink
        .messages(false)
        .await
        .into_iter()
        .filter_map(|m| Some((keys.get(&m.message_id)?.clone(), m.received_at_ms)))
        .collect()
}

/// Publishes `n` transactional jobs `tx-<from>…`, `per_second` apart (all at once
/// when None); each key's publish time (Unix ms).
async fn transactional(
    env: &TestEnv,
    from: usize,
    n: usize,
    per_second: Option<u32>,
    mut at_half: impl FnMut(),
) -> BTreeMap<String, i64> {
    let mut published = BTreeMap::new();
    let keys: Vec<String> = (from..from + n).map(|i| format!("tx-{i}")).collect();
    match per_second {
        None => {
            // Routed by the default lane's name, as a producer naming every lane may.
            let bodies: Vec<_> = (keys.iter())
                .map(|k| {
                    (
                        job(k, "user@example.com"),
                        postie::testing::broker::job_properties(),
                    )
                })
                .collect();
            let at = unix_ms();
            env.publish_many_routed("email.transactional", &bodies)
                .await;
            published.extend(keys.into_iter().map(|k| (k, at)));
        }
        Some(rate) => {
            let gap = Duration::from_secs_f64(1.0 / f64::from(rate));
            let start = Instant::now();
            for (i, key) in keys.into_iter().enumerate() {
                tokio::time::sleep_until((start + gap * i as u32).into()).await;
                if i == n / 2 {
                    at_half();
                }
                published.insert(key.clone(), unix_ms());
                env.publish(&job(&key, "user@example.com")).await;
            }
        }
    }
    published
}

/// Latencies (ms) of `published` keys, from the first arrival of each.
fn latencies(published: &BTreeMap<String, i64>, arrivals: &[(String, i64)]) -> Vec<i64> {
    let mut first: BTreeMap<&str, i64> = BTreeMap::new();
    for (key, at) in arrivals {
        let slot = first.entry(key.as_str()).or_insert(*at);
        *slot = (*slot).min(*at);
    }
    let mut out: Vec<i64> = published
        .iter()
        .filter_map(|(key, at)| Some(first.get(key.as_str())? - at))
        .collect();
    out.sort_unstable();
    out
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Waits until every key of `published` has reached the sink.
async fn wait_sent(w: &World, keys: &BTreeMap<String, String>, published: &BTreeMap<String, i64>) {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let arrived: BTreeSet<String> = received(&w.env, keys)
            .await
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        if published.keys().all(|k| arrived.contains(k)) {
            return;
        }
        if Instant::now() > deadline {
            let log = w.instances.last().map(|(p, _)| p.log()).unwrap_or_default();
            panic!(
                "{} of {} transactional jobs sent within 240 s; log:\n{log}",
                published.keys().filter(|k| arrived.contains(*k)).count(),
                published.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Message-ID → key for the keys of this test.
fn key_index(bulk: usize, tx: usize) -> BTreeMap<String, String> {
    (0..bulk)
        .map(|i| format!("bulk-{i}"))
        .chain((0..tx).map(|i| format!("tx-{i}")))
        .map(|k| (message_id(&k), k))
        .collect()
}

/// Bulk's sends among all sends between the first and last arrival of `published`.
fn bulk_share(published: &BTreeMap<String, i64>, arrivals: &[(String, i64)]) -> (usize, usize) {
    let tx: Vec<i64> = arrivals
        .iter()
        .filter(|(k, _)| published.contains_key(k))
        .map(|(_, at)| *at)
        .collect();
    let (from, to) = (*tx.iter().min().unwrap(), *tx.iter().max().unwrap());
    let within: Vec<&(String, i64)> = arrivals
        .iter()
        .filter(|(_, at)| (from..=to).contains(at))
        .collect();
    let bulk = within
        .iter()
        .filter(|(k, _)| k.starts_with("bulk-"))
        .count();
    (bulk, within.len())
}

/// Bulk kept going while transactional jobs flowed (work-conserving), and was not
/// starved while both lanes waited: about its weight's share (generous bounds; the
/// figure is printed).
fn assert_bulk_kept_its_share(bulk_meanwhile: usize, (bulk, all): (usize, usize)) {
    assert!(
        bulk_meanwhile > 0,
        "bulk stopped while transactional jobs flowed"
    );
    let share = bulk as f64 / all as f64;
    assert!(
        (0.03..=0.3).contains(&share),
        "bulk's share while both lanes wait: {bulk}/{all}"
    );
}

async fn wait_bulk_flowing(w: &World, keys: &BTreeMap<String, String>, within: Duration) {
    support::eventually("bulk jobs being sent", within, || async {
        (received(&w.env, keys).await.len() >= 100).then_some(())
    })
    .await;
}

/// Bulk's backlog outlasted the scenario: it was still being sent when the last
/// transactional job arrived (else the shares say nothing; a bigger backlog is needed).
fn assert_backlog_left(arrivals: &[(String, i64)], bulk: usize) {
    let bulk_sent = arrivals
        .iter()
        .filter(|(k, _)| k.starts_with("bulk-"))
        .count();
    assert!(
        bulk_sent < bulk,
        "the bulk backlog ran out: {bulk_sent} of {bulk} sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_jobs_overtake_a_bulk_backlog_and_lanes_share_by_weight() {
    overtaking(2_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_transactional_jobs_overtake_a_bulk_backlog_and_lanes_share_by_weight() {
    overtaking(20_000).await;
}

/// `bulk` bulk jobs queued, then 200 transactional at 20/s and 300 at once, on one
/// instance. Bulk gets what transactional leaves of 50/s for about 20 s: a few hundred
/// jobs (351 in a run on 2 cores), so 2,000 outlast the scenario (asserted).
async fn overtaking(bulk: usize) {
    let w = world("lanes-backlog", bulk, 1).await;
    let keys = key_index(bulk, 500);
    wait_bulk_flowing(&w, &keys, FLOWING).await;

    let bulk_intake = w.env.depth(&format!("{}.intake.bulk", w.env.prefix)).await;
    // A trickle of 200 at 20/s: each waits for no bulk backlog.
    let trickle = transactional(&w.env, 0, 200, Some(20), || {}).await;
    wait_sent(&w, &keys, &trickle).await;
    let arrivals = received(&w.env, &keys).await;
    let lat = latencies(&trickle, &arrivals);
    let (bulk_meanwhile, all_meanwhile) = bulk_share(&trickle, &arrivals);

    // A burst of 300: both lanes wait, and share 9 to 1.
    let burst = transactional(&w.env, 200, 300, None, || {}).await;
    wait_sent(&w, &keys, &burst).await;
    let arrivals = received(&w.env, &keys).await;
    let burst_lat = latencies(&burst, &arrivals);
    let (bulk_in_burst, all_in_burst) = bulk_share(&burst, &arrivals);
    let share = bulk_in_burst as f64 / all_in_burst as f64;
    assert_backlog_left(&arrivals, bulk);

    let (_, port) = &w.instances[0];
    let (_, metrics) = support::http_get(&format!("http://127.0.0.1:{port}/metrics")).await;
    let tx_sent = sample(
        &metrics,
        "postie_lane_emails_sent_total{lane=\"transactional\"}",
    );
    let bulk_sent = sample(&metrics, "postie_lane_emails_sent_total{lane=\"bulk\"}");
    let dead = w.env.depth(w.env.topology.dead_queue()).await;
    eprintln!(
        "FIGURES lanes, 1 instance, limit {RATE}, {bulk} bulk queued: transactional trickle 20/s latency p50 {} ms p99 {} ms max {} ms; bulk sends meanwhile {bulk_meanwhile} of {all_meanwhile}; burst of 300: latency p50 {} ms p99 {} ms max {} ms, bulk's share while both busy {bulk_in_burst}/{all_in_burst} = {:.3} (weight 0.100); metrics: transactional {tx_sent:?}, bulk {bulk_sent:?}; dead {dead}; bulk jobs still in their intake when the trickle began: {bulk_intake}",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().unwrap(),
        percentile(&burst_lat, 0.5),
        percentile(&burst_lat, 0.99),
        burst_lat.last().unwrap(),
        share,
    );

    // Every transactional job sent exactly once, none dead-lettered.
    let per_id = w.env.emails_per_id().await;
    for key in trickle.keys().chain(burst.keys()) {
        assert_eq!(per_id.get(&message_id(key)), Some(&1), "{key}");
    }
    assert!(per_id.values().all(|&n| n == 1), "an email was sent twice");
    assert_eq!(dead, 0, "dead letters");
    // Behind `bulk` jobs at 50/s (40 s of backlog at 2,000, 400 s at 20,000; not
    // drained when the burst ended, asserted above), a transactional job waits for
    // its lane only: seconds, not the backlog. Generous, and the same at both sizes:
    // the goal (p99 < 2 s) is a figure, printed above.
    assert!(percentile(&lat, 0.99) < 5_000, "trickle latencies {lat:?}");
    assert_bulk_kept_its_share(bulk_meanwhile, (bulk_in_burst, all_in_burst));
    // The lanes are visible in the metrics.
    assert_eq!(tx_sent, Some(500.0));
    assert!(bulk_sent.is_some_and(|n| n >= 100.0), "{bulk_sent:?}");
    // And in `postie status`, from the one count of sends: each lane's sends of the
    // last 60 s (the burst of 300 has just been sent).
    let status = w.env.postie(&["status"]).unwrap_or_else(|e| e);
    let lane_sent = |lane: &str| -> i64 {
        let line = status.lines().find(|l| l.trim_start().starts_with(lane));
        let words: Vec<&str> = line.map_or(vec![], |l| l.split_whitespace().collect());
        let at = words.iter().position(|w| *w == "sent");
        at.and_then(|i| words.get(i + 1)?.parse().ok())
            .unwrap_or_else(|| panic!("no sent count for lane {lane} in {status}"))
    };
    assert!(lane_sent("transactional") >= 300, "{status}");
    assert!(lane_sent("bulk") >= 1, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_of_one_of_three_instances_keeps_the_lanes_apart_and_loses_nothing() {
    lanes_kill(1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_kill_9_of_one_of_three_instances_keeps_the_lanes_apart_and_loses_nothing() {
    lanes_kill(2_000).await;
}

/// `bulk` bulk jobs queued, three instances, one killed halfway through 200
/// transactional jobs at 20/s, then 150 at once on the two left, then bulk drains.
/// Until the burst's end bulk gets what transactional leaves of 50/s for about 15 s:
/// about 400 jobs, so 1,000 outlast it (asserted).
async fn lanes_kill(bulk: usize) {
    let mut w = world("lanes-kill", bulk, 3).await;
    let keys = key_index(bulk, 350);
    wait_bulk_flowing(&w, &keys, FLOWING).await;

    // The trickle; at its half, one instance is killed with everything it holds.
    let mut victim = Some(w.instances.remove(0));
    let trickle = transactional(&w.env, 0, 200, Some(20), || {
        if let Some((mut process, _)) = victim.take() {
            process.kill9();
        }
    })
    .await;
    wait_sent(&w, &keys, &trickle).await;
    let arrivals = received(&w.env, &keys).await;
    let lat = latencies(&trickle, &arrivals);
    let (bulk_meanwhile, all_meanwhile) = bulk_share(&trickle, &arrivals);

    // A burst on the two that are left: the lanes still share 9 to 1.
    let burst = transactional(&w.env, 200, 150, None, || {}).await;
    wait_sent(&w, &keys, &burst).await;
    let arrivals = received(&w.env, &keys).await;
    let (bulk_in_burst, all_in_burst) = bulk_share(&burst, &arrivals);
    let share = bulk_in_burst as f64 / all_in_burst as f64;
    assert_backlog_left(&arrivals, bulk);

    // Then bulk drains: every bulk job sent too.
    let all: BTreeSet<String> = keys.keys().cloned().collect();
    let survivor = &w.instances[0].0;
    w.env
        .emails_or_log(
            survivor,
            "every job sent",
            all.len(),
            Duration::from_secs(240),
        )
        .await;
    let per_id = w.env.emails_per_id().await;
    let taken_over = w.env.taken_over_ids().await;
    let twice: Vec<&String> = per_id
        .iter()
        .filter(|(_, &n)| n > 1)
        .map(|(id, _)| id)
        .collect();
    let dead = w.env.depth(w.env.topology.dead_queue()).await;
    eprintln!(
        "FIGURES lanes, 3 instances, one killed mid-run, limit {RATE}, {bulk} bulk queued: transactional trickle 20/s latency p50 {} ms p99 {} ms max {} ms; bulk sends meanwhile {bulk_meanwhile} of {all_meanwhile}; then a burst of 150 on two instances: bulk's share while both busy {bulk_in_burst}/{all_in_burst} = {share:.3}; sent {} of {}, twice {} (taken over {}); dead {dead}",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().unwrap(),
        per_id.len(),
        all.len(),
        twice.len(),
        taken_over.len(),
    );
    assert_eq!(
        per_id.keys().cloned().collect::<BTreeSet<_>>(),
        all,
        "lost or unexpected emails"
    );
    // A second copy only in the known window: a claim taken over from the killed one.
    for id in twice {
        assert!(
            taken_over.contains(id),
            "{id} sent twice without a takeover"
        );
    }
    assert_eq!(dead, 0, "dead letters");
    // A job the killed instance had claimed waits out its lease (5 s here) at most.
    assert!(percentile(&lat, 0.99) < 20_000, "trickle latencies {lat:?}");
    assert_bulk_kept_its_share(bulk_meanwhile, (bulk_in_burst, all_in_burst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_backlog_leaves_the_rest_of_its_lane_to_the_others() {
    tenants("lanes-tenant", 1, false, 1_000, FLOWING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_tenants_backlog_leaves_the_rest_of_its_lane_to_the_others() {
    tenants("lanes-tenant", 1, false, 10_000, FLOWING_FULL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_of_one_of_three_instances_keeps_tenants_apart() {
    tenants("lanes-tenant-kill", 3, true, 1_000, FLOWING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_a_kill_9_of_one_of_three_instances_keeps_tenants_apart() {
    tenants("lanes-tenant-kill", 3, true, 10_000, FLOWING_FULL).await;
}

/// Tenant a's `a` jobs, then tenant b's 100 at 5/s in the same lane, on `instances`
/// instances, the first killed with `kill -9` halfway through b's when `kill`; a's
/// backlog flowing (100 sent) within `flowing`. At 30/s a's 1,000 jobs last 33 s,
/// longer than b's 20 s.
async fn tenants(name: &str, instances: usize, kill: bool, a: usize, flowing: Duration) {
    const B: usize = 100;
    // Each tenant at most 30/s in bulk: tenant a's backlog is spread at 30/s over
    // the next minutes, and at least 20/s of the lane's 50/s are left to the others.
    let cap = [("POSTIE__TOPOLOGY__LANES__BULK__TENANT_RATE_LIMIT", "30/s")];
    let mut w = world_with(name, a, instances, &cap).await;
    let mut keys = key_index(a, 0);
    keys.extend((0..B).map(|i| (message_id(&format!("b-{i}")), format!("b-{i}"))));
    wait_bulk_flowing(&w, &keys, flowing).await;

    // Tenant b's 100 jobs arrive later, 5/s, in the same lane.
    let mut published = BTreeMap::new();
    let mut status = String::new();
    let start = Instant::now();
    for i in 0..B {
        if kill && i == B / 2 {
            w.instances.remove(0).0.kill9();
        }
        // `postie status` while a's backlog is certainly ahead of its slot (5 s into
        // b's, a quarter of the way): at 1,000 jobs a's last slot may have passed by
        // the time b's last email is in.
        if i == B / 4 {
            status = w.env.postie(&["status"]).unwrap_or_else(|e| e);
        }
        tokio::time::sleep_until((start + Duration::from_millis(200) * i as u32).into()).await;
        let key = format!("b-{i}");
        let mut body = bulk(&key);
        body["tenant"] = "b".into();
        published.insert(key, unix_ms());
        let props = postie::testing::broker::job_properties();
        w.env
            .publish_many_routed("email.bulk", &[(body, props)])
            .await;
    }
    wait_sent(&w, &keys, &published).await;
    let arrivals = received(&w.env, &keys).await;
    let lat = latencies(&published, &arrivals);
    let b_times: Vec<i64> = arrivals
        .iter()
        .filter(|(k, _)| k.starts_with("b-"))
        .map(|(_, at)| *at)
        .collect();
    let (from, to) = (
        *b_times.iter().min().unwrap(),
        *b_times.iter().max().unwrap(),
    );
    let a_meanwhile = arrivals
        .iter()
        .filter(|(k, at)| k.starts_with("bulk-") && (from..=to).contains(at))
        .count();
    let seconds = (to - from) as f64 / 1000.0;
    // Summed over the instances still running.
    let mut totals: BTreeMap<&str, f64> = BTreeMap::new();
    for (_, port) in &w.instances {
        let (_, metrics) = support::http_get(&format!("http://127.0.0.1:{port}/metrics")).await;
        for m in [
            "tenant_deferred",
            "reconciled",
            "early_arrivals",
            "duplicates_suppressed",
            "lane_moves",
        ] {
            let n = sample(&metrics, &format!("postie_{m}_total")).unwrap_or(0.0);
            *totals.entry(m).or_default() += n;
        }
    }
    let deferred = totals["tenant_deferred"];
    let other: Vec<String> = (totals.iter())
        .filter(|(m, _)| **m != "tenant_deferred")
        .map(|(m, n)| format!("{m} {n}"))
        .collect();
    let dead = w.env.depth(w.env.topology.dead_queue()).await;
    eprintln!(
        "FIGURES tenants, {instances} instance(s){}, limit {RATE}, bulk lane tenant cap 30/s, tenant a {a} queued, tenant b {B} at 5/s: b's latency p50 {} ms p99 {} ms max {} ms; a sent {a_meanwhile} in b's {seconds:.1} s ({:.1}/s); deferred {deferred} ({}); dead {dead}",
        if kill { ", one killed halfway" } else { "" },
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().unwrap(),
        a_meanwhile as f64 / seconds.max(0.001),
        other.join(", "),
    );
    eprintln!("{status}");
    // Taken while a's backlog ran ahead of its slots: `postie status` names it first,
    // its lane and tenant read back from the rate engine's row name.
    let busiest = (status.lines())
        .skip_while(|l| !l.starts_with("busiest tenants"))
        .nth(1);
    assert!(
        busiest.is_some_and(|l| l.split_whitespace().take(2).eq(["bulk", "a"])),
        "tenant a of lane bulk not the busiest: {status}"
    );
    let per_id = w.env.emails_per_id().await;
    let taken_over = w.env.taken_over_ids().await;
    // A second copy only in the known window: a claim taken over from a killed one.
    for (id, n) in &per_id {
        assert!(*n == 1 || taken_over.contains(id), "{id} sent {n} times");
    }
    for key in published.keys() {
        assert!(per_id.contains_key(&message_id(key)), "{key} not sent");
    }
    assert_eq!(dead, 0, "dead letters");
    // Without tenant caps b waits behind a's backlog: 200 s at 50/s for 10,000, 20 s
    // for 1,000 (b's first jobs arrive 2 s into it, after a's 100th send: 18 s left,
    // about b's p99 without the cap). With them, a's excess is deferred out of the way
    // as the lane reaches it: b waits for that pass and then only for its own turn
    // (at 10,000: 20-32 s on an idle machine, the figure printed above; 60 s once on a
    // CI run with the file's other tests' nine instances busy beside it). The
    // assertion is the property, not the figure, and scales with a's backlog: under
    // half of it (100 s at 10,000, 10 s at 1,000).
    let behind_a_ms = (a as i64) * 1000 / 50;
    assert!(
        percentile(&lat, 0.99) < behind_a_ms / 2,
        "b's latencies {lat:?}"
    );
    assert!(deferred > 0.0, "nothing deferred under the tenant cap");
    assert!(a_meanwhile > 0, "tenant a stopped while b was sent");
    // Tenant a's sends stay near its cap (30/s) while b is sent: 50/s would mean no cap.
    assert!(
        (a_meanwhile as f64) < 45.0 * seconds.max(1.0),
        "tenant a sent {a_meanwhile} in {seconds:.1} s"
    );
    assert!(status.contains("busiest tenants"), "{status}");
    // Tenant a's slot, from the rate engine's row `tenant:bulk:a`, read back apart.
    let tenants = status.split("busiest tenants").nth(1).unwrap_or("");
    assert!(
        tenants
            .lines()
            .any(|l| l.split_whitespace().take(2).eq(["bulk", "a"])),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lanes_own_cap_holds_and_its_retries_stay_in_the_lane() {
    const BULK: usize = 100;
    let cap = [("POSTIE__TOPOLOGY__LANES__BULK__RATE_LIMIT", "10/s")];
    let w = world_with("lanes-cap", 0, 1, &cap).await;
    // One bulk job's first attempt is refused for now (451): its retry goes through
    // a retry queue, into <p>.send, and must come back to its lane.
    w.env
        .sink
        .set_faults(
            serde_json::json!([{"stage": "rcpt", "rcpt_contains": "retry-me",
            "action": {"reply": "451 4.3.0 try later"}, "times": 1}]),
        )
        .await;
    let mut jobs: Vec<_> = (0..BULK)
        .map(|i| {
            (
                bulk(&format!("bulk-{i}")),
                postie::testing::broker::job_properties(),
            )
        })
        .collect();
    let mut retried = bulk("bulk-retry");
    retried["to"] = serde_json::json!(["retry-me@example.com"]);
    jobs.push((retried, postie::testing::broker::job_properties()));
    w.env.publish_many_routed("email.bulk", &jobs).await;
    let published = transactional(&w.env, 0, 50, None, || {}).await;
    let survivor = &w.instances[0].0;
    w.env
        .emails_or_log(
            survivor,
            "every job sent",
            BULK + 51,
            Duration::from_secs(120),
        )
        .await;
    let messages = w.env.sink.messages(false).await;
    let of = |prefix: &str| -> Vec<support::sink::SinkMessage> {
        let ids: BTreeSet<String> = (messages.iter())
            .filter(|m| m.subject.contains(prefix))
            .map(|m| m.message_id.clone())
            .collect();
        (messages.iter())
            .filter(|m| ids.contains(&m.message_id))
            .cloned()
            .collect()
    };
    let (bulk_sent, tx_sent) = (of("About bulk-"), of("About tx-"));
    let span = |m: &[support::sink::SinkMessage]| {
        let t = m.iter().map(|m| m.received_at_ms);
        (t.clone().min().unwrap(), t.max().unwrap())
    };
    let ((bulk_first, bulk_last), (_, tx_last)) = (span(&bulk_sent), span(&tx_sent));
    let busiest = support::sink::busiest_window(&bulk_sent);
    let (_, port) = &w.instances[0];
    // The relay (here the sink) has the last email before postie records it and counts
    // it: read the counters once the count is complete.
    let url = &format!("http://127.0.0.1:{port}/metrics");
    let bulk_counted = "postie_lane_emails_sent_total{lane=\"bulk\"}";
    let metrics = support::eventually(
        "the bulk lane counting every email",
        Duration::from_secs(30),
        || async move {
            let (_, metrics) = support::http_get(url).await;
            (sample(&metrics, bulk_counted) >= Some((BULK + 1) as f64)).then_some(metrics)
        },
    )
    .await;
    let lane_bulk = sample(&metrics, bulk_counted);
    let moves = sample(&metrics, "postie_lane_moves_total");
    eprintln!(
        "FIGURES lane cap: bulk capped at 10/s under a fleet limit of {RATE}: {} bulk emails in {:.1} s, busiest 1000 ms {busiest}; 50 transactional done {:.1} s after the first bulk one; moved back to their lane {moves:?}",
        bulk_sent.len(),
        (bulk_last - bulk_first) as f64 / 1000.0,
        (tx_last - bulk_first) as f64 / 1000.0,
    );
    let per_id = w.env.emails_per_id().await;
    assert_eq!(per_id.len(), BULK + 51, "lost emails");
    assert!(per_id.values().all(|&n| n == 1), "an email was sent twice");
    assert_eq!(published.len(), 50);
    // The cap: 101 bulk emails at 10/s take at least 9 s, never 20 in a second.
    assert!(
        bulk_last - bulk_first >= 9_000,
        "101 bulk emails in {} ms: faster than 10/s",
        bulk_last - bulk_first
    );
    assert!(busiest <= 15, "busiest 1000 ms of bulk: {busiest}");
    // The other lane is not held by bulk's cap: transactional finished well before.
    assert!(
        tx_last < bulk_last - 3_000,
        "transactional waited for capped bulk"
    );
    // The retried job came back to bulk: sent and counted there.
    assert_eq!(lane_bulk, Some((BULK + 1) as f64));
    assert!(
        moves.is_some_and(|n| n >= 1.0),
        "the retry was not moved: {moves:?}"
    );
    assert_eq!(w.env.depth(w.env.topology.dead_queue()).await, 0);
}

/// One send-path run: `n` jobs queued on the send queues (half of them bulk when
/// `lanes`), one postie process with no rate limit; emails per second and postie's
/// CPU per email.
async fn send_path_run(n: usize, lanes: bool) -> (f64, f64) {
    let env = match lanes {
        true => TestEnv::with_settings("lanes-bench", LANES).await,
        false => TestEnv::new("lanes-bench").await,
    };
    let conn = support::bench::broker_connection("postie-bench-lanes").await;
    let channel = postie::testing::broker::confirm_channel(&conn)
        .await
        .unwrap();
    let body = |i: usize| {
        let key = format!("e2e-{i}");
        match lanes && i % 2 == 1 {
            true => bulk(&key),
            false => job(&key, "bench@example.com"),
        }
        .to_string()
        .into_bytes()
    };
    let work = env.topology.work_exchange();
    let (even, odd) = ((0..n).step_by(2), (1..n).step_by(2));
    support::bench::publish_bodies(&channel, work, "email", even.map(body)).await;
    let odd_key = if lanes { "email.bulk" } else { "email" };
    support::bench::publish_bodies(&channel, work, odd_key, odd.map(body)).await;
    let started = Instant::now();
    let postie = env.spawn_process(&[]);
    while (env.sink.stats().await.accepted as usize) < n {
        assert!(started.elapsed() < Duration::from_secs(600), "{n} emails");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = support::bench::cpu_seconds(postie.child.id());
    drop(postie);
    let _ = conn.close(200, "done".into()).await;
    (n as f64 / seconds, cpu * 1000.0 / n as f64)
}

/// `make bench-lanes`: the send path with lanes off and on, A B B A in one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: make bench-lanes"]
async fn bench_lanes_on_and_off() {
    let n = support::bench::env_usize("POSTIE_BENCH_N", 10_000);
    let mut off = Vec::new();
    let mut on = Vec::new();
    for lanes in [false, true, true, false] {
        let run = send_path_run(n, lanes).await;
        eprintln!(
            "lanes {}: {:.0} emails/s, postie {:.3} ms CPU per email",
            if lanes { "on" } else { "off" },
            run.0,
            run.1
        );
        if lanes { &mut on } else { &mut off }.push(run);
    }
    let mean = |runs: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        runs.iter().map(f).sum::<f64>() / runs.len() as f64
    };
    eprintln!(
        "FIGURES send path, {n} jobs, 1 process, no rate limit, {}: lanes off {:.0} emails/s ({:.3} ms CPU/email), lanes on (half bulk) {:.0} emails/s ({:.3} ms CPU/email)",
        support::bench::cpu_model(),
        mean(&off, |r| r.0),
        mean(&off, |r| r.1),
        mean(&on, |r| r.0),
        mean(&on, |r| r.1),
    );
}
