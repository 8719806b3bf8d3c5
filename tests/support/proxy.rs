//! A TCP proxy the tests can cut or freeze: puts one dependency "down" for one test
//! without touching the server other tests share. Cut: every connection is closed
//! and new ones refused. Frozen: connections stay open but no byte crosses, and new
//! ones are accepted and never answered (a half-dead network path).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropped, it stops.
pub struct Proxy {
    addr: std::net::SocketAddr,
    up: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
    frozen: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards a fresh local port to `upstream`.
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let (cut, _) = watch::channel(0u64);
        let (frozen, _) = watch::channel(false);
        let upstream = upstream.to_string();
        let (up2, cut2, frozen2) = (up.clone(), cut.clone(), frozen.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if !up2.load(Ordering::SeqCst) {
                    drop(client); // refused: the dependency is "down"
                    continue;
                }
                let upstream = upstream.clone();
                let mut cut_rx = cut2.subscribe();
                let mut frozen_rx = frozen2.subscribe();
                tokio::spawn(async move {
                    // Frozen: hold the client, answer nothing, until cut or thawed.
                    let frozen_now = *frozen_rx.borrow();
                    if frozen_now {
                        tokio::select! {
                            _ = frozen_rx.wait_for(|f| !*f) => {}
                            _ = cut_rx.changed() => return,
                        }
                    }
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                        _ = cut_rx.changed() => return,
                        _ = frozen_rx.wait_for(|f| *f) => {}
                    }
                    // Frozen mid-stream: both sockets stay open, unread, until a cut.
                    let _ = cut_rx.changed().await;
                    drop((client, server));
                });
            }
        });
        Self {
            addr,
            up,
            cut,
            frozen,
            task,
        }
    }

    /// `host:port` of the proxy.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Drops every open connection and refuses new ones.
    pub fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Accepts connections again.
    pub fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// Stops every byte on open connections without closing them; new connections
    /// are accepted but never answered.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Ends a freeze: connections frozen mid-stream are closed (their peers gave up
    /// on them long ago), and new ones are forwarded again.
    pub fn thaw(&self) {
        self.cut.send_modify(|n| *n += 1);
        self.frozen.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|n| *n += 1);
    }
}
