//! Clock discipline with real clocks set wrong: two `postie serve` processes under
//! libfaketime (Debian's `faketime` package), one 5 s ahead and one 5 s behind, in
//! ladder mode with delayed jobs. Nothing may be sent before it is due (by the real
//! clock: the SMTP test server's and this test's), and neither process may spin
//! while the jobs wait.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{job, message_id, TestEnv};

/// Where Debian's `faketime` package puts the library.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The environment that makes a process's wall clock run `offset` ("+5s", "-5s");
/// its monotonic clock (tokio's timers) is left alone.
fn faked(offset: &'static str) -> [(&'static str, &'static str); 3] {
    [
        ("LD_PRELOAD", LIBFAKETIME),
        ("FAKETIME", offset),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ]
}

/// CPU time (user + system) a process has used, in clock ticks (1/100 s).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gd_clocks_5_s_ahead_and_behind_send_nothing_early_and_do_not_spin() {
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} missing: apt-get install faketime (scripts/test-setup.sh does)"
    );
    const JOBS: i64 = 30;
    let env = TestEnv::new("gd-clock").await;
    let ahead = env.spawn_process(&faked("+5s"));
    let behind = env.spawn_process(&faked("-5s"));
    let send_queue = env.topology.send_queue();
    support::eventually(
        "both instances consuming",
        Duration::from_secs(60),
        || async { (env.consumers(send_queue).await >= 2).then_some(()) },
    )
    .await;

    // Delays from 8 s to 22.5 s, each stamped with this test's (true) publish time.
    let mut due = BTreeMap::new();
    let mut jobs = Vec::new();
    for i in 0..JOBS {
        let key = format!("gd-clock-{i}");
        let delay_ms = 8_000 + i * 500;
        let published = now_ms();
        jobs.push((
            job(&key, "later@example.com"),
            support::delayed_properties(delay_ms, published),
        ));
        due.insert(message_id(&key), published + delay_ms);
    }
    env.publish_many_with(&jobs).await;
    let first_due = *due.values().min().unwrap();

    // While every job waits (from 1 s after the publish to just before the first is
    // due), both processes should be near idle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pids = [ahead.child.id(), behind.child.id()];
    let before: Vec<u64> = pids.iter().map(|&pid| cpu_ticks(pid)).collect();
    let started = Instant::now();
    let window = Duration::from_millis((first_due - now_ms() - 500).max(1_000) as u64);
    tokio::time::sleep(window).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu: Vec<f64> = pids
        .iter()
        .zip(&before)
        .map(|(&pid, b)| (cpu_ticks(pid) - b) as f64 / 100.0 / seconds)
        .collect();
    let sent_while_waiting = env.sink.count().await;

    env.emails_or_log(&ahead, "every job", JOBS as usize, Duration::from_secs(90))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let arrivals = env.arrivals().await;
    let mut margins = Vec::new();
    for (id, due_ms) in &due {
        let seen = arrivals.get(id).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(seen.len(), 1, "{id} sent {} times", seen.len());
        margins.push(seen[0] - due_ms);
    }
    let earliest = *margins.iter().min().unwrap();
    let latest = *margins.iter().max().unwrap();
    eprintln!(
        "FIGURES clock skew +5 s / -5 s: {JOBS} jobs sent once; arrival minus due from \
         {earliest} ms to {latest} ms; CPU while waiting {:.1} % / {:.1} % of a core \
         over {seconds:.1} s; sent while waiting {sent_while_waiting}",
        cpu[0] * 100.0,
        cpu[1] * 100.0
    );
    assert!(
        earliest >= 0,
        "sent {} ms early; margins {margins:?}",
        -earliest
    );
    assert_eq!(sent_while_waiting, 0, "sent before the first was due");
    for (name, share) in ["ahead", "behind"].iter().zip(&cpu) {
        assert!(
            *share < 0.10,
            "the instance {name} used {:.0} % of a core while jobs waited (a hot loop)",
            share * 100.0
        );
    }
    assert!(
        ahead.log().contains("s ahead of PostgreSQL's"),
        "no warning about the clock ahead:\n{}",
        ahead.log()
    );
    assert!(
        behind.log().contains("s behind PostgreSQL's"),
        "no warning about the clock behind:\n{}",
        behind.log()
    );
}
