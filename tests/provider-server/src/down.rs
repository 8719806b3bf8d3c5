//! The API's accept loop, and down mode: a provider that refuses connections.
//!
//! The loop owns the listener and each connection's task (in a `JoinSet`), so that
//! going down is immediate: the listener is dropped (a connect is then refused by the
//! kernel, `ECONNREFUSED`) and every connection task is aborted, which drops its
//! socket, whatever the connection was doing (idle keep-alive, a request in a `hang`
//! fault or a `delay_ms`). After the window (or when told), the loop binds the same
//! address again. Everything else lives in `AppState` and is untouched.
//!
//! axum's own `serve` cannot do this: its graceful shutdown waits for the connections
//! to finish, and a hung one never does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long the loop keeps trying to bind the address again before it gives up (and
/// the process exits): another socket may hold the port for a moment.
const REBIND_FOR: Duration = Duration::from_secs(10);

/// Go down for this long (zero: come back now); `done` is answered once it holds.
struct Command {
    down_for: Duration,
    done: oneshot::Sender<()>,
}

/// The control API's handle on the loop.
pub(crate) struct Switch {
    commands: mpsc::UnboundedSender<Command>,
    down: Arc<AtomicBool>,
}

impl Switch {
    /// Takes the API down for `down_for` (a new window replaces the current one), or
    /// brings it back now when zero. Returns once the listener is closed and every
    /// connection dropped (or the listener is open again); `false` when the loop is
    /// gone.
    pub(crate) async fn set(&self, down_for: Duration) -> bool {
        let (done, applied) = oneshot::channel();
        self.commands.send(Command { down_for, done }).is_ok() && applied.await.is_ok()
    }

    /// Whether the API listener is closed.
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
}

/// The accept loop, to be run.
pub(crate) struct Server {
    listener: TcpListener,
    addr: SocketAddr,
    router: Router,
    commands: mpsc::UnboundedReceiver<Command>,
    down: Arc<AtomicBool>,
}

/// The accept loop serving `router` on `listener`, and its switch.
pub(crate) fn server(listener: TcpListener, router: Router) -> anyhow::Result<(Switch, Server)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let down = Arc::new(AtomicBool::new(false));
    let switch = Switch {
        commands: tx,
        down: down.clone(),
    };
    let server = Server {
        addr: listener.local_addr()?,
        listener,
        router,
        commands: rx,
        down,
    };
    Ok((switch, server))
}

impl Server {
    /// Serves until the switch is dropped, or fails when the address cannot be bound
    /// again.
    pub(crate) async fn run(self) -> anyhow::Result<()> {
        let Self {
            mut listener,
            addr,
            router,
            mut commands,
            down,
        } = self;
        loop {
            // Up: serve until told to go down.
            let mut connections = JoinSet::new();
            let (mut until, done) = loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            connections.spawn(serve_connection(stream, router.clone()));
                        }
                        Err(e) => accept_failed(e).await,
                    },
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                    command = commands.recv() => match command {
                        None => return Ok(()),
                        Some(Command { down_for, done }) if down_for.is_zero() => {
                            let _ = done.send(());
                        }
                        Some(Command { down_for, done }) => break (Instant::now() + down_for, done),
                    },
                }
            };
            drop(listener);
            connections.shutdown().await;
            down.store(true, Ordering::SeqCst);
            let _ = done.send(());

            // Down: until the window ends or the switch says so.
            let done = loop {
                tokio::select! {
                    () = tokio::time::sleep_until(until) => break None,
                    command = commands.recv() => match command {
                        None => return Ok(()),
                        Some(Command { down_for, done }) if down_for.is_zero() => break Some(done),
                        Some(Command { down_for, done }) => {
                            until = Instant::now() + down_for;
                            let _ = done.send(());
                        }
                    },
                }
            };
            listener = rebind(addr).await?;
            down.store(false, Ordering::SeqCst);
            if let Some(done) = done {
                let _ = done.send(());
            }
        }
    }
}

/// One HTTP/1.1 connection, served until it ends (or its task is aborted).
async fn serve_connection(stream: TcpStream, router: Router) {
    let service = TowerToHyperService::new(router);
    // A connection's errors (the client went away, a malformed request) end only it.
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// As axum's `serve`: a connection that failed before it was accepted is skipped; any
/// other error (out of file descriptors…) is waited out.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        eprintln!("postie-provider-server: accepting an API connection: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Listens on `addr` again (SO_REUSEADDR, as tokio binds: the connections just closed
/// linger in TIME_WAIT), retrying for [`REBIND_FOR`].
async fn rebind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let deadline = Instant::now() + REBIND_FOR;
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) if Instant::now() < deadline => {
                eprintln!("postie-provider-server: binding {addr} again: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("binding the API on {addr} again")),
        }
    }
}
