//! `postie-provider-server` as a process, over raw HTTP/1.1: each provider's send
//! endpoint with its credentials, faults and quota; its account endpoint (the probe's);
//! down mode.

mod common;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use common::{accepted_status, refused_status, Request, Server, PROVIDERS};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Each API accepts a well-formed, well-signed send, answers in its own shape and
/// records the email.
#[tokio::test]
async fn each_provider_accepts_and_records_a_send() {
    let server = Server::start();
    for provider in PROVIDERS {
        let reply = server
            .send(provider, &format!("{provider}@example.com"))
            .await;
        assert_eq!(
            reply.status,
            accepted_status(provider),
            "{provider}: {reply:?}"
        );
        let id = match provider {
            "ses" => reply.json()["MessageId"].as_str().unwrap().to_string(),
            "sendgrid" => reply.header("x-message-id").unwrap().to_string(),
            "postmark" => {
                let body = reply.json();
                assert_eq!(body["ErrorCode"], 0);
                assert_eq!(body["To"], "postmark@example.com");
                body["MessageID"].as_str().unwrap().to_string()
            }
            _ => {
                let body = reply.json();
                assert_eq!(body["message"], "Queued. Thank you.");
                let id = body["id"].as_str().unwrap().to_string();
                assert!(id.ends_with(&format!("@{}>", common::DOMAIN)), "{id}");
                id
            }
        };
        assert!(!id.is_empty(), "{provider}");
    }
    let messages = server.control("GET", "/messages?raw=true", None).await;
    let messages = messages.as_array().unwrap();
    assert_eq!(messages.len(), 4);
    for (n, (m, provider)) in messages.iter().zip(PROVIDERS).enumerate() {
        assert_eq!(m["seq"], n as u64 + 1);
        assert_eq!(m["provider"], provider);
        assert_eq!(
            m["message_id"],
            format!("<{provider}.{provider}.example.com@postie.test>")
        );
        assert_eq!(m["to"], json!([format!("{provider}@example.com")]));
        assert!(!m["raw"].as_str().unwrap().is_empty());
    }
    let stats = server.stats().await;
    assert_eq!(stats["requests"], 4);
    assert_eq!(stats["accepted"], 4);
    assert_eq!(stats["auth_failed"], 0);
}

/// Wrong credentials get each provider's refusal, and nothing is recorded.
#[tokio::test]
async fn wrong_credentials_are_refused() {
    let server = Server::start();
    for provider in PROVIDERS {
        let request = server.send_request(provider, "bob@example.com", false);
        let reply = server.api(&request).await;
        assert_eq!(
            reply.status,
            refused_status(provider),
            "{provider}: {reply:?}"
        );
        if provider == "ses" {
            assert_eq!(
                reply.header("x-amzn-errortype"),
                Some("SignatureDoesNotMatch")
            );
        }
    }
    let stats = server.stats().await;
    assert_eq!(stats["requests"], 4);
    assert_eq!(stats["auth_failed"], 4);
    assert_eq!(stats["accepted"], 0);
}

/// A request without a recipient is each provider's bad request.
#[tokio::test]
async fn a_send_without_recipient_is_a_bad_request() {
    let server = Server::start();
    for (provider, status) in PROVIDERS.into_iter().zip([400, 400, 422, 400]) {
        let reply = server.api(&server.send_request(provider, "", true)).await;
        assert_eq!(reply.status, status, "{provider}: {reply:?}");
    }
    assert_eq!(server.stats().await["rejected"], 4);
}

/// Each fault action, on each provider: the provider's status, and its counter.
#[tokio::test]
async fn fault_rules_answer_in_each_providers_shape() {
    let server = Server::start();
    // (action, the statuses of ses, sendgrid, postmark, mailgun, the counter)
    let cases = [
        (
            json!({"status": 503}),
            [503, 503, 503, 503],
            "server_errors",
        ),
        (json!({"throttle": true}), [429, 429, 429, 429], "throttled"),
        (json!({"suspended": true}), [400, 403, 422, 403], "rejected"),
        (json!({"reject": true}), [400, 400, 422, 400], "rejected"),
    ];
    for (action, statuses, counter) in cases {
        for (provider, status) in PROVIDERS.into_iter().zip(statuses) {
            server
                .set_faults(json!([{"provider": provider, "to_contains": "bad", "action": action, "times": 1}]))
                .await;
            let before = server.stats().await[counter].as_u64().unwrap();
            let reply = server.send(provider, "bad@example.com").await;
            assert_eq!(reply.status, status, "{provider} {action}: {reply:?}");
            assert_eq!(
                server.stats().await[counter],
                before + 1,
                "{provider} {action}"
            );
            // `times: 1` is spent: the same request is accepted now.
            let reply = server.send(provider, "bad@example.com").await;
            assert_eq!(
                reply.status,
                accepted_status(provider),
                "{provider} {action}"
            );
        }
    }
    let throttled = server.send_request("sendgrid", "x@example.com", true);
    server
        .set_faults(json!([{"action": {"throttle": true}}]))
        .await;
    let reply = server.api(&throttled).await;
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"));
    // A rule for another recipient or provider does not fire.
    server
        .set_faults(json!([{"provider": "ses", "to_contains": "bad", "action": {"status": 500}}]))
        .await;
    assert_eq!(server.send("ses", "good@example.com").await.status, 200);
    assert_eq!(server.send("postmark", "bad@example.com").await.status, 200);
    assert_eq!(server.send("ses", "bad@example.com").await.status, 500);
}

/// `delay_ms` holds the reply, then accepts; `hang` never answers.
#[tokio::test]
async fn delay_and_hang() {
    let server = Server::start();
    server
        .set_faults(json!([{"provider": "postmark", "action": {"delay_ms": 300}}]))
        .await;
    let started = Instant::now();
    assert_eq!(server.send("postmark", "a@example.com").await.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));

    server
        .set_faults(json!([{"provider": "mailgun", "action": {"hang": true}}]))
        .await;
    let request = server.send_request("mailgun", "a@example.com", true);
    let reply = common::exchange_within(&server.api, &request, Duration::from_millis(500)).await;
    assert!(reply.is_none(), "a hung request was answered: {reply:?}");
    let stats = server.stats().await;
    assert_eq!(stats["hung"], 1);
    assert_eq!(stats["accepted"], 1);
}

/// Quota mode answers the provider's 429 beyond `per_second`.
#[tokio::test]
async fn quota_throttles_beyond_the_rate() {
    let server = Server::start();
    server
        .control("PUT", "/quota", Some(json!({"per_second": 1})))
        .await;
    assert_eq!(server.send("ses", "a@example.com").await.status, 200);
    let reply = server.send("ses", "b@example.com").await;
    assert_eq!(reply.status, 429);
    assert_eq!(
        reply.header("x-amzn-errortype"),
        Some("TooManyRequestsException")
    );
    let stats = server.stats().await;
    assert_eq!(stats["accepted"], 1);
    assert_eq!(stats["throttled"], 1);
}

/// Each account endpoint (postie's circuit-breaker probe) answers 200 in its
/// provider's shape with the right credentials, and the provider's refusal with wrong
/// ones or none; probes count as `probes`, not as sends.
#[tokio::test]
async fn account_endpoints_check_credentials() {
    let server = Server::start();
    assert_eq!(server.send("ses", "a@example.com").await.status, 200);
    assert_eq!(server.send("postmark", "a@example.com").await.status, 200);
    for provider in PROVIDERS {
        let reply = server.probe(provider).await;
        assert_eq!(reply.status, 200, "{provider}: {reply:?}");
        let expected = match provider {
            "ses" => json!({
                "SendingEnabled": true,
                "ProductionAccessEnabled": true,
                "SendQuota": {"Max24HourSend": 50000.0, "MaxSendRate": 14.0, "SentLast24Hours": 1.0},
            }),
            "sendgrid" => json!({"scopes": ["mail.send"]}),
            "postmark" => json!({"ID": 1, "Name": "postie-test"}),
            _ => json!({"domain": {"name": common::DOMAIN, "state": "active"}}),
        };
        assert_eq!(reply.json(), expected, "{provider}");

        let wrong = server.api(&server.probe_request(provider, false)).await;
        assert_eq!(
            wrong.status,
            refused_status(provider),
            "{provider}: {wrong:?}"
        );
        let mut bare = server.probe_request(provider, true);
        bare.headers.retain(|(name, _)| {
            !matches!(name.as_str(), "authorization" | "x-postmark-server-token")
        });
        let none = server.api(&bare).await;
        assert_eq!(
            none.status,
            refused_status(provider),
            "{provider}: {none:?}"
        );
    }
    let wrong = server.api(&server.probe_request("ses", false)).await;
    assert_eq!(
        wrong.header("x-amzn-errortype"),
        Some("SignatureDoesNotMatch")
    );
    assert_eq!(
        wrong.json()["message"]
            .as_str()
            .map(|m| m.contains("signature")),
        Some(true)
    );

    let stats = server.stats().await;
    assert_eq!(stats["probes"], 13);
    assert_eq!(stats["requests"], 2);
    assert_eq!(stats["accepted"], 2);
    assert_eq!(stats["auth_failed"], 0);
}

/// A rule with `"probe": true` applies to the account endpoints and not to sends;
/// one without it, to sends and not to the account endpoints.
#[tokio::test]
async fn probe_faults_hit_probes_not_sends() {
    let server = Server::start();
    server
        .set_faults(json!([{"provider": "sendgrid", "probe": true, "action": {"status": 503}}]))
        .await;
    assert_eq!(
        server.control("GET", "/faults", None).await[0]["probe"],
        true
    );
    assert_eq!(server.probe("sendgrid").await.status, 503);
    assert_eq!(server.send("sendgrid", "a@example.com").await.status, 202);
    assert_eq!(server.probe("postmark").await.status, 200);

    server
        .set_faults(json!([{"action": {"status": 503}}]))
        .await;
    assert_eq!(
        server.control("GET", "/faults", None).await[0]["probe"],
        false
    );
    for provider in PROVIDERS {
        assert_eq!(server.probe(provider).await.status, 200, "{provider}");
    }
    assert_eq!(server.send("sendgrid", "b@example.com").await.status, 503);

    // A hung probe, once; then the probe is answered again.
    server
        .set_faults(json!([{"probe": true, "action": {"hang": true}, "times": 1}]))
        .await;
    let request = server.probe_request("ses", true);
    let reply = common::exchange_within(&server.api, &request, Duration::from_millis(500)).await;
    assert!(reply.is_none(), "a hung probe was answered: {reply:?}");
    assert_eq!(server.probe("ses").await.status, 200);
    assert_eq!(server.send("ses", "c@example.com").await.status, 200);

    // A throttle rule for probes answers the provider's 429.
    server
        .set_faults(json!([{"provider": "mailgun", "probe": true, "action": {"throttle": true}}]))
        .await;
    assert_eq!(server.probe("mailgun").await.status, 429);

    // Fault answers to probes bump no send counter.
    let stats = server.stats().await;
    assert_eq!(stats["probes"], 9);
    assert_eq!(stats["requests"], 3);
    assert_eq!(stats["server_errors"], 1);
    assert_eq!(stats["hung"], 0);
    assert_eq!(stats["throttled"], 0);
}

/// Whether a connect to `addr` is refused at the TCP level (`ECONNREFUSED`).
async fn refused(addr: &str) -> bool {
    match TcpStream::connect(addr).await {
        Ok(_) => false,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => true,
        Err(e) => panic!("connect {addr}: {e}"),
    }
}

/// Polls `GET /down` until it reads `down`.
async fn wait_down(server: &Server, down: bool, within: Duration) {
    let deadline = Instant::now() + within;
    while server.control("GET", "/down", None).await["down"] != down {
        assert!(
            Instant::now() < deadline,
            "still not down={down} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `PUT /down`: connects are refused while down, and after the window the same
/// address serves again, with the messages, counters, fault rules and quota kept.
#[tokio::test]
async fn down_refuses_connections_for_the_window_then_serves_again() {
    let server = Server::start();
    server
        .set_faults(json!([{"provider": "ses", "to_contains": "bad", "action": {"status": 503}}]))
        .await;
    server
        .control("PUT", "/quota", Some(json!({"per_second": 100})))
        .await;
    assert_eq!(server.send("postmark", "a@example.com").await.status, 200);
    assert_eq!(
        server.control("GET", "/down", None).await,
        json!({"down": false})
    );

    let started = Instant::now();
    let reply = server
        .control("PUT", "/down", Some(json!({"seconds": 1})))
        .await;
    assert_eq!(reply, json!({"down": true}));
    assert_eq!(
        server.control("GET", "/down", None).await,
        json!({"down": true})
    );
    assert!(
        refused(&server.api).await,
        "a connect while down was accepted"
    );
    assert!(refused(&server.api).await);

    wait_down(&server, false, Duration::from_secs(5)).await;
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "back after {:?}",
        started.elapsed()
    );
    assert!(!refused(&server.api).await);
    assert_eq!(server.send("postmark", "b@example.com").await.status, 200);
    assert_eq!(server.send("ses", "bad@example.com").await.status, 503);
    assert_eq!(server.probe("sendgrid").await.status, 200);

    let messages = server.control("GET", "/messages", None).await;
    assert_eq!(messages.as_array().unwrap().len(), 2);
    let stats = server.stats().await;
    assert_eq!(stats["requests"], 3);
    assert_eq!(stats["accepted"], 2);
    assert_eq!(stats["server_errors"], 1);
    assert_eq!(
        server.control("GET", "/quota", None).await["per_second"],
        100
    );
}

/// `DELETE /down` and `{"seconds": 0}` end the window at once; a new window replaces
/// the current one; a window that is not a number of seconds is refused.
#[tokio::test]
async fn come_back_ends_the_window_at_once() {
    let server = Server::start();
    server
        .control("PUT", "/down", Some(json!({"seconds": 600})))
        .await;
    assert!(refused(&server.api).await);
    let reply = server.control("DELETE", "/down", None).await;
    assert_eq!(reply, json!({"down": false}));
    assert_eq!(server.send("sendgrid", "a@example.com").await.status, 202);

    server
        .control("PUT", "/down", Some(json!({"seconds": 600})))
        .await;
    // Replaces the 600 s window with a shorter one.
    server
        .control("PUT", "/down", Some(json!({"seconds": 0.2})))
        .await;
    assert!(refused(&server.api).await);
    wait_down(&server, false, Duration::from_secs(5)).await;
    assert_eq!(server.send("sendgrid", "b@example.com").await.status, 202);

    server
        .control("PUT", "/down", Some(json!({"seconds": 600})))
        .await;
    let reply = server
        .control("PUT", "/down", Some(json!({"seconds": 0})))
        .await;
    assert_eq!(reply, json!({"down": false}));
    assert_eq!(server.send("sendgrid", "c@example.com").await.status, 202);
    // Coming back while up changes nothing.
    assert_eq!(
        server.control("DELETE", "/down", None).await,
        json!({"down": false})
    );

    for bad in [json!({"seconds": -1}), json!({}), json!({"seconds": "5"})] {
        let request = Request::new("PUT", "/down").json(&bad);
        let reply = common::exchange(&server.control, &request).await;
        assert_eq!(reply.status, 400, "{bad}");
    }
    assert_eq!(server.stats().await["accepted"], 3);
}

/// Reads from `stream` until the server closes it: `true` when it did within `wait`
/// without sending anything (EOF or a reset).
async fn closed_without_reply(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 1024];
    match tokio::time::timeout(wait, stream.read(&mut buf)).await {
        Ok(Ok(0)) => true,
        Ok(Ok(n)) => panic!(
            "the server answered: {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Ok(Err(e)) => matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe),
        Err(_) => false,
    }
}

/// Going down closes every open API connection: one whose request hangs (a `hang`
/// fault), and an idle one. The address serves again afterwards.
#[tokio::test]
async fn going_down_closes_open_connections() {
    let server = Server::start();
    server
        .set_faults(json!([{"provider": "postmark", "action": {"hang": true}}]))
        .await;
    let mut hung = TcpStream::connect(&server.api).await.unwrap();
    let request = server.send_request("postmark", "a@example.com", true);
    hung.write_all(&request.bytes(&server.api)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.stats().await["hung"] != 1 {
        assert!(
            Instant::now() < deadline,
            "the request never reached the hang"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut idle = TcpStream::connect(&server.api).await.unwrap();
    assert!(!closed_without_reply(&mut hung, Duration::from_millis(200)).await);

    server
        .control("PUT", "/down", Some(json!({"seconds": 600})))
        .await;
    assert!(
        closed_without_reply(&mut hung, Duration::from_secs(2)).await,
        "the hung connection is still open"
    );
    assert!(
        closed_without_reply(&mut idle, Duration::from_secs(2)).await,
        "the idle connection is still open"
    );
    assert!(refused(&server.api).await);

    server.control("DELETE", "/down", None).await;
    server.control("DELETE", "/faults", None).await;
    assert_eq!(server.send("postmark", "b@example.com").await.status, 200);
    let stats = server.stats().await;
    assert_eq!(stats["hung"], 1);
    assert_eq!(stats["accepted"], 1);
}
