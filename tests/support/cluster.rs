//! A real RabbitMQ cluster of the machine's broker, for node-loss tests: `n` nodes
//! with their own node names (`postie-c<i>-<pid>-<k>@localhost`), AMQP and
//! distribution ports, data and log directories, config and enabled-plugins files
//! (no plugins) under one temporary directory, and the main node's Erlang cookie.
//! Nodes 2..n join node 1 (`stop_app; join_cluster; start_app`). Dropping the
//! cluster kills every node (SIGKILL: its data is thrown away) and deletes the
//! directory, also when a test fails. The machine's own node (rabbit@localhost,
//! 5672) is never touched.
//!
//! With POSTIE_TEST_RABBITMQ_ROOT set (`make test-rabbitmq-4`: the folder that
//! `scripts/rabbitmq-4.sh` debootstrapped), the nodes are that folder's broker, run
//! under `chroot`, with the cluster's directory inside the folder's `/tmp`.
//!
//! Nodes run as the current user (root here) straight from
//! `/usr/lib/rabbitmq/bin`, not through the `/usr/sbin` wrappers (which switch to
//! the `rabbitmq` user); the CLI is run the same way with `HOME` pointing at a copy
//! of the cookie. Each node's open-file limit is raised to the hard limit: quorum
//! queues take file handles on 3.10.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Where the installed broker's scripts are.
const BIN: &str = "/usr/lib/rabbitmq/bin";
/// The broker user the harness creates; its password starts with `SECRETPW` so a
/// test can look for it in logs.
pub const USER: &str = "postie";
/// How long one node may take to boot.
const BOOT: Duration = Duration::from_secs(120);

/// One node of the cluster.
pub struct Node {
    /// Erlang node name, `postie-c<i>-<pid>-<k>@localhost`.
    pub name: String,
    /// AMQP listener on 127.0.0.1.
    pub amqp_port: u16,
    /// Erlang distribution port.
    pub dist_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A running cluster; dropped, it is gone.
pub struct Cluster {
    /// The nodes, node 1 first.
    pub nodes: Vec<Node>,
    /// The password of [`USER`].
    pub password: String,
    /// How long start-up took (boot, join, user).
    pub started_in: Duration,
    base: PathBuf,
    home: PathBuf,
    /// The folder the broker is installed in (`/` for the machine's own).
    root: PathBuf,
}

/// The folder whose broker the cluster runs: POSTIE_TEST_RABBITMQ_ROOT, else `/`.
fn broker_root() -> PathBuf {
    std::env::var_os("POSTIE_TEST_RABBITMQ_ROOT")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/"), PathBuf::from)
}

impl Cluster {
    /// Starts `n` nodes, joins them, creates [`USER`]. Panics (after cleaning up)
    /// if the cluster does not form.
    pub fn start(n: usize) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let started = Instant::now();
        let k = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let root = broker_root();
        let base = root.join("tmp").join(format!("postie-cluster-{pid}-{k}"));
        let _ = std::fs::remove_dir_all(&base);
        let home = base.join("home");
        std::fs::create_dir_all(&home).unwrap();
        let cookie = ["var/lib/rabbitmq/.erlang.cookie", "root/.erlang.cookie"]
            .iter()
            .find_map(|p| std::fs::read(root.join(p)).ok())
            .expect("the main node's Erlang cookie is readable");
        let cookie_file = home.join(".erlang.cookie");
        std::fs::write(&cookie_file, cookie).unwrap();
        set_mode(&cookie_file, 0o400);
        let password = format!(
            "SECRETPW{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let nodes = (1..=n)
            .map(|i| Node {
                name: format!("postie-c{i}-{pid}-{k}@localhost"),
                amqp_port: super::free_port(),
                dist_port: free_dist_port(),
                dir: base.join(format!("n{i}")),
                child: None,
            })
            .collect();
        let mut cluster = Self {
            nodes,
            password,
            started_in: Duration::ZERO,
            base,
            home,
            root,
        };
        for i in 0..n {
            cluster.spawn(i);
        }
        for i in 0..n {
            cluster.await_node(i);
        }
        let first = cluster.nodes[0].name.clone();
        for i in 1..n {
            cluster.ctl_ok(i, &["stop_app"]);
            cluster.ctl_ok(i, &["join_cluster", &first]);
            cluster.ctl_ok(i, &["start_app"]);
        }
        for i in 0..n {
            cluster.await_node(i);
        }
        let password = cluster.password.clone();
        cluster.ctl_ok(0, &["add_user", USER, &password]);
        cluster.ctl_ok(0, &["set_user_tags", USER, "administrator"]);
        cluster.ctl_ok(0, &["set_permissions", "-p", "/", USER, ".*", ".*", ".*"]);
        cluster.started_in = started.elapsed();
        eprintln!(
            "cluster of {n} nodes ({}) up in {:.1}s",
            cluster
                .nodes
                .iter()
                .map(|n| format!("{}:{}", n.name, n.amqp_port))
                .collect::<Vec<_>>()
                .join(", "),
            cluster.started_in.as_secs_f64()
        );
        cluster
    }

    /// The AMQP URL of node `i` (0-based), with [`USER`]'s credentials.
    pub fn url(&self, i: usize) -> String {
        format!(
            "amqp://{USER}:{}@127.0.0.1:{}/%2f",
            self.password, self.nodes[i].amqp_port
        )
    }

    /// Every node's URL, comma-separated (what `amqp.url` is given).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The index of the node named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// `rabbitmqctl -n <node i> ARGS`, at most 120 s: stdout, or stderr as the error.
    pub fn ctl(&self, i: usize, args: &[&str]) -> Result<String, String> {
        self.cli("rabbitmqctl", i, args)
    }

    /// Like [`Cluster::ctl`], with another CLI tool (`rabbitmq-queues`, `rabbitmq-diagnostics`).
    pub fn cli(&self, tool: &str, i: usize, args: &[&str]) -> Result<String, String> {
        let mut cmd = self.command(&Path::new(BIN).join(tool));
        cmd.arg("-n").arg(&self.nodes[i].name).args(args);
        cmd.env("HOME", self.inside(&self.home))
            .env(
                "RABBITMQ_CONF_ENV_FILE",
                self.inside(&self.base.join("empty.conf")),
            )
            .stdin(Stdio::null());
        run(cmd, Duration::from_secs(120))
    }

    fn ctl_ok(&self, i: usize, args: &[&str]) -> String {
        self.ctl(i, args)
            .unwrap_or_else(|e| panic!("rabbitmqctl -n {} {args:?}: {e}", self.nodes[i].name))
    }

    /// The queues whose name starts with `prefix`, as seen from node `via`:
    /// (name, leader node, messages, messages_ready).
    pub fn queues(&self, via: usize, prefix: &str) -> Vec<QueueInfo> {
        let out = self
            .ctl(
                via,
                &[
                    "list_queues",
                    "-q",
                    "--no-table-headers",
                    "name",
                    "leader",
                    "messages",
                    "messages_ready",
                ],
            )
            .unwrap_or_default();
        out.lines()
            .filter_map(|line| {
                let mut f = line.split('\t');
                let name = f.next()?.to_string();
                let leader = f.next()?.to_string();
                let messages = f.next()?.trim().parse().ok()?;
                let messages_ready = f.next()?.trim().parse().ok()?;
                name.starts_with(prefix).then_some(QueueInfo {
                    name,
                    leader,
                    messages,
                    messages_ready,
                })
            })
            .collect()
    }

    /// The OS pid of node `i`'s Erlang VM (from its pid file).
    pub fn beam_pid(&self, i: usize) -> Option<u32> {
        let node = &self.nodes[i];
        let file = node.dir.join("mnesia").join(format!("{}.pid", node.name));
        std::fs::read_to_string(file).ok()?.trim().parse().ok()
    }

    /// SIGKILL of node `i`'s Erlang VM: no goodbye to peers or clients.
    pub fn kill9(&mut self, i: usize) {
        if let Some(pid) = self.beam_pid(i) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(
            self.nodes[i]
                .dir
                .join("mnesia")
                .join(format!("{}.pid", self.nodes[i].name)),
        );
    }

    /// Stops node `i` cleanly (`rabbitmqctl stop`), as an operator's restart does.
    pub fn stop(&mut self, i: usize) {
        let _ = self.ctl(i, &["stop"]);
        if let Some(mut child) = self.nodes[i].child.take() {
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again on its data directory and waits until it runs.
    pub fn restart(&mut self, i: usize) {
        self.spawn(i);
        self.await_node(i);
    }

    fn spawn(&mut self, i: usize) {
        let node = &self.nodes[i];
        let dir = &node.dir;
        for sub in ["mnesia", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.1 = 127.0.0.1:{}\nloopback_users = none\n",
                node.amqp_port
            ),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(self.base.join("empty.conf"), "").unwrap();
        let mut cmd = self.command(Path::new("sh"));
        // The open-file limit up to the hard limit before the VM starts.
        cmd.arg("-c")
            .arg(format!(
                "ulimit -n $(ulimit -Hn) 2>/dev/null; exec {BIN}/rabbitmq-server"
            ))
            .current_dir(dir)
            .env("HOME", self.inside(&self.home))
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_NODE_PORT", node.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", node.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", self.inside(&dir.join("mnesia")))
            .env("RABBITMQ_LOG_BASE", self.inside(&dir.join("log")))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.inside(&dir.join("enabled_plugins")),
            )
            .env(
                "RABBITMQ_CONFIG_FILE",
                self.inside(&dir.join("rabbitmq.conf")),
            )
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                self.inside(&dir.join("advanced.config")),
            )
            .env(
                "RABBITMQ_CONF_ENV_FILE",
                self.inside(&self.base.join("empty.conf")),
            )
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        {
            use std::os::unix::process::CommandExt;
            // Its own process group: a Ctrl-C of the test run reaches Drop, not the VM.
            cmd.process_group(0);
        }
        let child = cmd.spawn().expect("spawn rabbitmq-server");
        self.nodes[i].child = Some(child);
    }

    /// `program` run from the broker's folder: under `chroot` when that is not `/`.
    fn command(&self, program: &Path) -> Command {
        if self.root == Path::new("/") {
            Command::new(program)
        } else {
            let mut cmd = Command::new("chroot");
            cmd.arg(&self.root).arg(program);
            cmd
        }
    }

    /// `path` (under the broker's folder) as the broker sees it.
    fn inside(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(&self.root) {
            Ok(rest) => Path::new("/").join(rest),
            Err(_) => path.to_path_buf(),
        }
    }

    /// Waits until node `i` runs the broker application (or panics after [`BOOT`]).
    pub fn await_node(&self, i: usize) {
        let deadline = Instant::now() + BOOT;
        loop {
            match self.ctl(i, &["await_startup", "--timeout", "30"]) {
                Ok(_) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!(
                        "node {} did not start within {BOOT:?}: {e}",
                        self.nodes[i].name
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(500)),
            }
        }
    }

    /// Whether node `i`'s VM process is alive.
    pub fn is_running(&self, i: usize) -> bool {
        self.beam_pid(i)
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill9(i);
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// A queue as `list_queues` shows it.
#[derive(Debug, Clone)]
pub struct QueueInfo {
    /// Name.
    pub name: String,
    /// Leader node (quorum queues).
    pub leader: String,
    /// Messages, ready or not (for ladder queues: held, or expired and waiting for
    /// their dead-letter hop).
    pub messages: u64,
    /// Ready messages.
    pub messages_ready: u64,
}

/// A free port for a node's Erlang distribution listener.
fn free_dist_port() -> u16 {
    super::free_port()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Runs `cmd` with a deadline; stdout, or stderr (and stdout) as the error.
fn run(mut cmd: Command, limit: Duration) -> Result<String, String> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(limit) {
        Ok(out) => out.map_err(|e| e.to_string())?,
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            return Err(format!("no answer within {limit:?}"));
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{}{stdout}", String::from_utf8_lossy(&out.stderr)))
    }
}
