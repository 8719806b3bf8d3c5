//! Every HTTP listener (metrics and health, the feedback webhooks, the console) under
//! slow and idle clients (issue 45, item 3): a client that never finishes its headers,
//! sends them a byte at a time, or never sends its body is dropped within the
//! deadline, and a real client is still answered; at most `http.max_connections`
//! connections are served at once, the next one waits for a slot.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use postie::testing::console::{self, Credentials};
use support::{eventually, free_port, TestEnv};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Generous: the deadlines under test are 1 s (headers) and 2 s (a request).
const GIVE_UP: Duration = Duration::from_secs(30);

/// The settings these tests run with (short deadlines, a small cap).
const LIMITS: [(&str, &str); 3] = [
    ("POSTIE__HTTP__MAX_CONNECTIONS", "4"),
    ("POSTIE__HTTP__HEADER_TIMEOUT", "1s"),
    ("POSTIE__HTTP__REQUEST_TIMEOUT", "2s"),
];

/// The three listeners of one postie: `(name, address, a real request's first line
/// and headers, the status it must get, a path whose handler reads a body)`.
struct Listeners {
    all: Vec<(&'static str, SocketAddr, String, u16, &'static str)>,
    _stop: CancellationToken,
    _serving: support::Serving,
}

async fn listeners(env: &TestEnv) -> Listeners {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let feedback: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut settings = env.settings();
    settings.http.listen = Some(metrics);
    settings.feedback.listen = Some(feedback);
    // No SES topics to name here: the listener's bounds are under test, not SNS.
    settings.feedback.sns.enabled = false;
    let serving = env.serve(settings);
    let stop = CancellationToken::new();
    let console = console::start(
        env.settings(),
        "127.0.0.1:0".parse().unwrap(),
        Credentials::default(),
        stop.clone(),
    )
    .await
    .unwrap();
    let request = |line: &str, addr: SocketAddr| {
        format!("{line} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    };
    let all = vec![
        (
            "metrics",
            metrics,
            request("GET /healthz", metrics),
            200,
            "/metrics",
        ),
        // No provider of that name: 404, an answer all the same.
        (
            "feedback",
            feedback,
            request("POST /feedback/none", feedback),
            404,
            "/feedback/ses",
        ),
        (
            "console",
            console,
            request("GET /login", console),
            200,
            "/login",
        ),
    ];
    for (name, addr, request, status, _) in &all {
        eventually(&format!("the {name} listener"), GIVE_UP, || async {
            let (answer, _) = ask(*addr, request).await.ok()?;
            (answer == *status).then_some(())
        })
        .await;
    }
    Listeners {
        all,
        _stop: stop,
        _serving: serving,
    }
}

/// Sends `request` on a new connection; its status and how long the answer took.
async fn ask(addr: SocketAddr, request: &str) -> std::io::Result<(u16, Duration)> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(GIVE_UP, stream.read_to_end(&mut answer))
        .await
        .map_err(|_| std::io::Error::other("no answer"))??;
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an answer: {text:?}")))?;
    Ok((status, started.elapsed()))
}

/// A slow client: connects, sends `first`, then one byte of `trickle` every 200 ms.
/// Its answer once the server closes the connection: how long that took and what
/// it said (empty: nothing), or None if it was still open after `GIVE_UP`.
async fn slow_client(
    addr: SocketAddr,
    first: Vec<u8>,
    trickle: Vec<u8>,
) -> Option<(Duration, String)> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let (mut read, mut write) = stream.split();
    let writing = async {
        if write.write_all(&first).await.is_err() {
            return;
        }
        for byte in &trickle {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if write.write_all(&[*byte]).await.is_err() {
                return;
            }
        }
        std::future::pending::<()>().await
    };
    let reading = async {
        let mut said = Vec::new();
        let _ = read.read_to_end(&mut said).await;
        String::from_utf8_lossy(&said).into_owned()
    };
    let closed = async {
        tokio::select! {
            said = reading => said,
            _ = writing => String::new(),
        }
    };
    let said = tokio::time::timeout(GIVE_UP, closed).await.ok()?;
    Some((started.elapsed(), said))
}

/// Idle connections, headers sent a byte every 200 ms, a body never sent: every
/// listener drops each within the deadline, and answers a real client meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_clients_are_dropped_and_a_real_client_is_answered() {
    let env = TestEnv::with_settings("listeners-slow", &LIMITS).await;
    let listeners = listeners(&env).await;
    let mut slow = Vec::new();
    for (name, addr, _, _, reads_body) in &listeners.all {
        let addr = *addr;
        let header = format!("GET / HTTP/1.1\r\nHost: {addr}\r\n").into_bytes();
        let body = format!(
            "POST {reads_body} HTTP/1.1\r\nHost: {addr}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\n"
        )
        .into_bytes();
        let clients = [
            ("idle", Vec::new(), Vec::new()),
            ("idle", Vec::new(), Vec::new()),
            ("idle", Vec::new(), Vec::new()),
            ("headers a byte at a time", header, vec![b'x'; 1000]),
            ("a body never sent", body.clone(), Vec::new()),
            ("a body a byte at a time", body, vec![b'x'; 1000]),
        ];
        for (what, first, trickle) in clients {
            slow.push((*name, what, tokio::spawn(slow_client(addr, first, trickle))));
        }
    }
    // Six slow clients on each listener, whose cap is 4: a real client is answered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (name, addr, request, status, _) in &listeners.all {
        let (answer, took) = ask(*addr, request)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(answer, *status, "{name}");
        println!("{name}: a real client answered in {took:?} beside 6 slow ones");
    }
    let mut kept = Vec::new();
    for (name, what, client) in slow {
        match client.await.unwrap() {
            Some((took, said)) => {
                println!(
                    "{name}: {what}: dropped after {took:?} ({:?})",
                    said.lines().next()
                );
                // Its deadline (1 s for headers, 2 s for a request) and a wait for a slot.
                if took > Duration::from_secs(15) {
                    kept.push(format!("{name}: {what}: dropped only after {took:?}"));
                }
            }
            None => kept.push(format!("{name}: {what}: still open after {GIVE_UP:?}")),
        }
    }
    assert!(kept.is_empty(), "{kept:#?}");
}

/// With `http.max_connections = 4` and 4 connections open, a fifth is served only
/// once one of them has gone (here: dropped by the header deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_waits_for_a_slot() {
    let env = TestEnv::with_settings("listeners-cap", &LIMITS).await;
    let listeners = listeners(&env).await;
    for (name, addr, request, status, _) in &listeners.all {
        let idle: Vec<_> = (0..4)
            .map(|_| tokio::spawn(slow_client(*addr, Vec::new(), Vec::new())))
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (answer, took) = ask(*addr, request)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(answer, *status, "{name}");
        println!("{name}: the fifth connection answered after {took:?}");
        assert!(
            took >= Duration::from_millis(500),
            "{name}: answered in {took:?} while 4 connections held every slot"
        );
        for client in idle {
            let ended = client.await.unwrap();
            assert!(
                ended.is_some(),
                "{name}: an idle connection was never dropped"
            );
        }
    }
}
