//! Failed sign-ins, throttled per client: a token that fails (in the sign-in form, as
//! a bearer token or as Basic auth's password) counts against its client's address
//! (an IPv6 client by its /64, which one host usually holds whole). The first
//! [`FREE`] failures cost nothing; each one after locks the client out for 2 s,
//! then 4, 8, … up to [`MAX_LOCK`]; while locked every token is refused unread, the
//! right one too (429 with `Retry-After`), so a guess learns nothing. A client is
//! forgotten [`FORGET`] after its last failure, or at once when its token works.
//!
//! Memory is bounded: at most `console.sign_in_clients` clients are remembered; when
//! the table is full and none can be forgotten, new clients share one count, so that
//! filling it from many addresses lets no one guess faster. Behind a proxy every
//! client has the proxy's address (forwarded headers are not trusted).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::page;

/// Failures before the first lock.
pub(super) const FREE: u32 = 5;
/// The first lock; each failure after doubles it.
const FIRST_LOCK: Duration = Duration::from_secs(2);
/// The longest lock.
pub(super) const MAX_LOCK: Duration = Duration::from_secs(300);
/// A client is forgotten this long after its last failure.
pub(super) const FORGET: Duration = Duration::from_secs(900);

/// Who a failure is counted against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Client {
    /// An IPv4 address (or an IPv4-mapped IPv6 one).
    V4([u8; 4]),
    /// An IPv6 address's /64.
    V6([u8; 8]),
    /// Everyone not in a full table, and requests without an address.
    Shared,
}

impl Client {
    /// The client an address stands for.
    pub(super) fn of(ip: Option<IpAddr>) -> Self {
        match ip.map(|ip| ip.to_canonical()) {
            Some(IpAddr::V4(v4)) => Self::V4(v4.octets()),
            Some(IpAddr::V6(v6)) => {
                let mut net = [0u8; 8];
                net.copy_from_slice(&v6.octets()[..8]);
                Self::V6(net)
            }
            None => Self::Shared,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
    locked_until: Instant,
}

/// The failed sign-ins of the clients remembered.
pub(super) struct SignIns {
    max: usize,
    table: Mutex<HashMap<Client, Failures>>,
}

impl SignIns {
    /// Remembering at most `max` clients (and the shared count).
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            table: Mutex::new(HashMap::new()),
        }
    }

    /// Ok if `client` may try a token at `now`, else how long it must wait.
    pub(super) fn check(&self, client: Client, now: Instant) -> Result<(), Duration> {
        let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let key = if table.contains_key(&client) {
            client
        } else {
            Client::Shared
        };
        match table.get(&key) {
            Some(f) if f.locked_until > now && (key == client || table.len() > self.max) => {
                Err(f.locked_until - now)
            }
            _ => Ok(()),
        }
    }

    /// Counts a failed token from `client` at `now`.
    pub(super) fn failed(&self, client: Client, now: Instant) {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let mut key = client;
        if !table.contains_key(&client) && table.len() >= self.max {
            table.retain(|_, f| now.duration_since(f.last) < FORGET || f.locked_until > now);
            if table.len() >= self.max {
                key = Client::Shared;
            }
        }
        let failures = table.entry(key).or_insert(Failures {
            count: 0,
            last: now,
            locked_until: now,
        });
        if now.duration_since(failures.last) >= FORGET {
            failures.count = 0;
        }
        failures.count += 1;
        failures.last = now;
        if failures.count >= FREE {
            let doublings = (failures.count - FREE).min(16);
            let lock = FIRST_LOCK.saturating_mul(1 << doublings).min(MAX_LOCK);
            failures.locked_until = now + lock;
        }
    }

    /// A token from `client` worked: its failures are forgotten.
    pub(super) fn succeeded(&self, client: Client) {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        table.remove(&client);
    }
}

/// Why a token was not taken.
#[derive(Debug)]
pub(super) enum SignInRefused {
    /// None was presented (401, the sign-in form).
    Missing,
    /// It is not one of the console's (401).
    Unknown,
    /// This client failed too often: it may try again after this long (429).
    Throttled(Duration),
}

impl IntoResponse for SignInRefused {
    fn into_response(self) -> Response {
        match self {
            // No Basic challenge: a browser shows the sign-in form instead of its own
            // dialog; `curl -u :TOKEN` still sends Basic auth unasked.
            Self::Missing => (StatusCode::UNAUTHORIZED, page::login(None)).into_response(),
            Self::Unknown => (
                StatusCode::UNAUTHORIZED,
                page::login(Some("That token is not one of the console's.")),
            )
                .into_response(),
            Self::Throttled(wait) => {
                let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                let why = format!(
                    "Too many failed sign-ins from your address: try again in {seconds} s."
                );
                (
                    StatusCode::TOO_MANY_REQUESTS,
                    [(header::RETRY_AFTER, seconds.to_string())],
                    page::login(Some(&why)),
                )
                    .into_response()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Client {
        Client::of(Some(IpAddr::from([192, 0, 2, last])))
    }

    #[test]
    fn a_client_is_locked_after_five_failures_for_longer_each_time() {
        let sign_ins = SignIns::new(100);
        let t0 = Instant::now();
        let (a, b) = (v4(1), v4(2));
        for _ in 0..FREE - 1 {
            sign_ins.failed(a, t0);
            assert!(sign_ins.check(a, t0).is_ok());
        }
        sign_ins.failed(a, t0);
        assert_eq!(sign_ins.check(a, t0), Err(Duration::from_secs(2)));
        assert!(sign_ins.check(b, t0).is_ok(), "another client");
        let t1 = t0 + Duration::from_secs(2);
        assert!(sign_ins.check(a, t1).is_ok());
        sign_ins.failed(a, t1);
        assert_eq!(sign_ins.check(a, t1), Err(Duration::from_secs(4)));
        // Many more: capped.
        let mut t = t1;
        for _ in 0..30 {
            t += MAX_LOCK;
            sign_ins.failed(a, t);
        }
        assert_eq!(sign_ins.check(a, t), Err(MAX_LOCK));
        // Forgotten after a quiet while, and at once by a success.
        let quiet = t + MAX_LOCK + FORGET;
        sign_ins.failed(a, quiet);
        assert!(sign_ins.check(a, quiet).is_ok(), "counted from one again");
        sign_ins.succeeded(a);
        assert!(sign_ins.table.lock().unwrap().get(&a).is_none());
    }

    #[test]
    fn ipv6_clients_are_counted_by_their_64_and_mapped_v4_as_v4() {
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let two: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        assert_eq!(Client::of(Some(one)), Client::of(Some(two)));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(Client::of(Some(mapped)), v4(1));
    }

    #[test]
    fn a_full_table_puts_new_clients_on_one_shared_count() {
        let sign_ins = SignIns::new(3);
        let t0 = Instant::now();
        for last in 1..=3 {
            sign_ins.failed(v4(last), t0);
        }
        // Clients 10 to 14 each fail once: five failures on the shared count.
        for last in 10..15 {
            assert!(sign_ins.check(v4(last), t0).is_ok());
            sign_ins.failed(v4(last), t0);
        }
        assert!(sign_ins.table.lock().unwrap().len() <= 4);
        assert!(
            sign_ins.check(v4(99), t0).is_err(),
            "the shared count is locked"
        );
        assert!(
            sign_ins.check(v4(1), t0).is_ok(),
            "a remembered client has its own"
        );
        // Once the remembered ones are forgotten, a new client has its own again.
        let later = t0 + FORGET + MAX_LOCK;
        sign_ins.failed(v4(50), later);
        assert!(sign_ins.table.lock().unwrap().contains_key(&v4(50)));
    }
}
