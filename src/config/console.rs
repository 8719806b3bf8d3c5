//! `console.*`: the operator console (`postie console`, or in `serve` when `listen`
//! is set): where it listens, what one page or action may touch, and its sessions
//! and sign-in throttle. Its tokens come from the environment, never from here.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::de::{duration, optional_addr};

/// The operator console.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleSettings {
    /// Where `postie serve` also serves the console; empty (the default) for no
    /// console in `serve`. `postie console` listens here too, else on 127.0.0.1:9092.
    /// Off loopback it needs credentials (`POSTIE_CONSOLE_TOKEN` or
    /// `POSTIE_CONSOLE_READ_TOKEN` in the environment).
    #[serde(deserialize_with = "optional_addr")]
    pub listen: Option<SocketAddr>,
    /// Everyone sees the pages and no one may act (cancel, replay, suppress).
    pub read_only: bool,
    /// At most this many dead letters are read for one page or count of the dead
    /// letters (each is held unacked while the page is made).
    pub dead_letter_scan: usize,
    /// Rows on one page of a list (1 to 10,000).
    pub page_size: i64,
    /// At most this many jobs are cancelled, or dead letters replayed, by one action.
    pub max_batch: usize,
    /// A sign-in's session lasts this long; then the token is asked for again.
    #[serde(deserialize_with = "duration")]
    pub session_ttl: Duration,
    /// Sessions kept at once (each sign-in is one, until it ends, signs out or
    /// expires); past this the oldest ends.
    pub max_sessions: usize,
    /// Clients whose failed sign-ins are remembered (by address, an IPv6 client by
    /// its /64); past this, new clients share one count.
    pub sign_in_clients: usize,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        Self {
            listen: None,
            read_only: false,
            dead_letter_scan: 10_000,
            page_size: 50,
            max_batch: 10_000,
            session_ttl: Duration::from_secs(8 * 3600),
            max_sessions: 1_000,
            sign_in_clients: 4_096,
        }
    }
}
