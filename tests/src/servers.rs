//! Private servers for tests that kill, flush or reconfigure a server, or need TLS: a test PKI
//! made at test time (rcgen), a RabbitMQ node (plain or TLS-only listener) and a
//! `redis-server` (plain or TLS-only port), each on free loopback ports, in a temporary
//! directory, stopped by process group on drop. The shared servers are never touched.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};

/// The open-file limit private RabbitMQ nodes start with unless `RABBITMQ_NOFILE` says: the
/// one ops/services.sh gives the shared broker (docs/scaling.md).
pub const RABBITMQ_NOFILE: u64 = 65536;

/// `RABBITMQ_NOFILE` from the environment, else [`RABBITMQ_NOFILE`].
pub fn rabbitmq_nofile() -> u64 {
    std::env::var("RABBITMQ_NOFILE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(RABBITMQ_NOFILE)
}

/// `sh -c` script: `$1` is the wanted open-file limit, the rest the command to exec with it —
/// `ops/nofile-exec.sh` itself, the script `ops/services.sh` starts the shared node with.
const NOFILE_THEN_EXEC: &str = include_str!("../../ops/nofile-exec.sh");

/// A free TCP port on 127.0.0.1 (bound, then released) for a private server to listen on,
/// chosen at random *below* the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
/// A port the kernel hands out (`bind` to port 0) is one any outgoing connection may take as
/// its local port in the seconds before the server binds it — the suite makes thousands —
/// and a node that then fails with `eaddrinuse` fails its test (CI, round 3 session 15: a
/// private RabbitMQ's listener). Ports below the range are never taken that way; each is
/// handed out once per process. Falls back to a kernel-chosen port when none is free.
pub fn free_port() -> Result<u16> {
    use std::sync::{Mutex, OnceLock};
    static GIVEN: OnceLock<Mutex<std::collections::HashSet<u16>>> = OnceLock::new();
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (from, to) = (10_000u16, low.saturating_sub(1));
    if to > from {
        let given = GIVEN.get_or_init(Default::default);
        for _ in 0..200 {
            let port = from + (rand::random::<u16>() % (to - from));
            let fresh = given.lock().map(|mut g| g.insert(port)).unwrap_or(false);
            if fresh && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A temporary directory, world-readable (RabbitMQ may run as user `rabbitmq`), removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(format!("fleet-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&p)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777))?;
        Ok(TempDir(p))
    }

    /// Writes `name` (mode 0644) and returns its path as a string.
    pub fn write(&self, name: &str, text: &str) -> Result<String> {
        let p = self.0.join(name);
        std::fs::write(&p, text)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644))?;
        Ok(p.to_string_lossy().into_owned())
    }

    pub fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test CA with a server certificate (names `localhost`, `127.0.0.1`) and a client
/// certificate, as PEM files; plus a second, unrelated CA for "wrong CA" cases.
pub struct Pki {
    pub dir: TempDir,
    pub ca: String,
    pub other_ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
}

impl Pki {
    pub fn new() -> Result<Self> {
        Self::for_server_names(&["localhost", "127.0.0.1"])
    }

    /// Like [`Pki::new`], with a server certificate valid for `names` only (the first is its
    /// common name): `&["other.example"]` makes a certificate for another host.
    pub fn for_server_names(names: &[&str]) -> Result<Self> {
        let dir = TempDir::new("pki")?;
        let (ca, ca_key) = make_ca("fleet test CA")?;
        let (other, _) = make_ca("some other CA")?;
        let server_key = KeyPair::generate()?;
        let mut sp =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        sp.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("localhost"),
        );
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = sp.signed_by(&server_key, &ca, &ca_key)?;
        let client_key = KeyPair::generate()?;
        let mut cp = CertificateParams::new(Vec::<String>::new())?;
        cp.distinguished_name
            .push(DnType::CommonName, "fleet-client");
        cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = cp.signed_by(&client_key, &ca, &ca_key)?;
        Ok(Pki {
            ca: dir.write("ca.pem", &ca.pem())?,
            other_ca: dir.write("other-ca.pem", &other.pem())?,
            server_cert: dir.write("server.pem", &server.pem())?,
            server_key: dir.write("server.key", &server_key.serialize_pem())?,
            client_cert: dir.write("client.pem", &client.pem())?,
            client_key: dir.write("client.key", &client_key.serialize_pem())?,
            dir,
        })
    }

    /// A TLS acceptor presenting this PKI's server certificate (no client certificates asked),
    /// for a test's own TLS servers.
    pub fn server_acceptor(&self) -> Result<tokio_rustls::TlsAcceptor> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let certs =
            CertificateDer::pem_file_iter(&self.server_cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(&self.server_key)?;
        let cfg = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)))
    }

    /// Settings `<prefix>_ca_file` (+ the client pair when `client`), e.g. prefix `amqp_tls`.
    pub fn settings(&self, prefix: &str, client: bool) -> Vec<(String, String)> {
        let mut v = vec![(format!("{prefix}_ca_file"), self.ca.clone())];
        if client {
            v.push((format!("{prefix}_cert_file"), self.client_cert.clone()));
            v.push((format!("{prefix}_key_file"), self.client_key.clone()));
        }
        v
    }
}

fn make_ca(name: &str) -> Result<(rcgen::Certificate, KeyPair)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    let cert = p.self_signed(&key)?;
    Ok((cert, key))
}

/// Kills a child's whole process group (the child was started as its group leader).
/// Processes this test binary started, as `kill` targets (`-<pgid>` for a private server's
/// process group, `<pid>` for a fleet process), for [`kill_registered_groups`].
static STARTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Remembers a started process (`group`: it leads its own process group) until the binary ends.
pub(crate) fn register(pid: u32, group: bool) {
    if let Ok(mut s) = STARTED.lock() {
        s.push(if group {
            format!("-{pid}")
        } else {
            pid.to_string()
        });
    }
}

/// SIGKILLs every process (group) [`register`]ed that may still run: the watchdog's exit runs
/// no `Drop`. One already gone is skipped: only a process whose parent is this one is a
/// target (the e2e binary runs for many minutes, and a reaped child's pid may be another
/// process's by then).
pub(crate) fn kill_registered_groups() {
    let targets = STARTED.lock().map(|s| s.clone()).unwrap_or_default();
    for t in targets {
        if !is_our_child(t.trim_start_matches('-')) {
            continue;
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &t])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether process `pid` runs and is a child of this process (`/proc/<pid>/stat`'s ppid).
fn is_our_child(pid: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses; the fields after the
    // last `)` do not.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|ppid| ppid.parse::<u32>().ok())
        == Some(std::process::id())
}

fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", "--", &format!("-{}", child.id())])
        .status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    // The direct child at least, even if `kill` could not run: the wait below must end.
    let _ = child.kill();
    let _ = child.wait();
}

/// A RabbitMQ node of this test alone: its own node name, AMQP and distribution ports, data
/// and log directories and config files (in a temporary directory removed on drop), no
/// plugins; started as its own process group and stopped on drop by that group's id (SIGTERM,
/// then SIGKILL). Either a plain listener ([`PrivateRabbit::start`]) or a TLS-only one
/// ([`PrivateRabbit::start_tls`]).
pub struct PrivateRabbit {
    pub port: u16,
    /// The node's name (`fleet-t<8 hex>@localhost`), for [`PrivateRabbit::ctl`].
    pub node: String,
    tls: bool,
    child: Child,
    dir: TempDir,
}

impl PrivateRabbit {
    /// Starts a node with a plain listener, `conf` (more rabbitmq.conf lines) and `advanced`
    /// (an Erlang term list for advanced.config, e.g.
    /// `[{rabbit, [{channel_tick_interval, 1000}]}].`) and waits (up to 120 s) until it
    /// accepts AMQP connections.
    pub async fn start(conf: &str, advanced: &str) -> Result<Self> {
        let port = free_port()?;
        let conf = format!("listeners.tcp.default = 127.0.0.1:{port}\n{conf}\n");
        let mut r = Self::spawn(port, false, &conf, advanced)?;
        let url = r.url();
        r.wait_up(|| {
            let url = url.clone();
            async move {
                fleet::broker::amqp::connect(&url, "fleet-tests-probe")
                    .await
                    .is_ok()
            }
        })
        .await?;
        Ok(r)
    }

    /// Starts a node with a TLS-only listener (`amqps://guest:guest@localhost:<port>/%2f`)
    /// and waits (up to 120 s) until its TLS port accepts connections. With
    /// `require_client_cert` the node verifies peers and refuses a client without a
    /// certificate (`fail_if_no_peer_cert`).
    pub async fn start_tls(pki: &Pki, require_client_cert: bool) -> Result<Self> {
        let port = free_port()?;
        let conf = format!(
            "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\nssl_options.cacertfile = {}\nssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\nssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = {require_client_cert}\n",
            pki.ca, pki.server_cert, pki.server_key
        );
        let mut r = Self::spawn(port, true, &conf, "[].\n")?;
        r.wait_up(|| async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await?;
        Ok(r)
    }

    fn spawn(port: u16, tls: bool, conf: &str, advanced: &str) -> Result<Self> {
        let dir = TempDir::new("rabbit")?;
        let conf =
            format!("{conf}loopback_users.guest = true\nlog.console = true\nlog.file = false\n");
        let conf_path = dir.write("rabbitmq.conf", &conf)?;
        let advanced_path = dir.write("advanced.config", advanced)?;
        let plugins = dir.write("enabled_plugins", "[].\n")?;
        // The inner script runs the node as the calling user; the packaged wrapper would switch
        // to user `rabbitmq` (needing the world-readable files above).
        let bin = [
            "/usr/lib/rabbitmq/bin/rabbitmq-server",
            "/usr/sbin/rabbitmq-server",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("rabbitmq-server");
        let node = format!(
            "fleet-t{}@localhost",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let log = std::fs::File::create(dir.path("node.log"))?;
        // Started through `sh` to set its open-file limit (RABBITMQ_NOFILE, as
        // ops/services.sh): fleet's queue counts need more than the usual 1024.
        let child = Command::new("sh")
            .arg("-c")
            .arg(NOFILE_THEN_EXEC)
            .arg("sh")
            .arg(rabbitmq_nofile().to_string())
            .arg(bin)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env(
                "RABBITMQ_NODE_PORT",
                if tls { free_port()? } else { port }.to_string(),
            )
            .env("RABBITMQ_DIST_PORT", free_port()?.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.path("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.path("log"))
            .env("RABBITMQ_CONFIG_FILE", &conf_path)
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", &advanced_path)
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", &plugins)
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", dir.path("plugins-expand"))
            .env("RABBITMQ_PID_FILE", dir.path("pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("start rabbitmq-server (is it installed?)")?;
        register(child.id(), true);
        Ok(PrivateRabbit {
            port,
            node,
            tls,
            child,
            dir,
        })
    }

    /// Polls `up` until it says yes, failing (with the log's tail) when the node exits first
    /// or after 120 s.
    async fn wait_up<F, Fut>(&mut self, up: F) -> Result<()>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let start = std::time::Instant::now();
        loop {
            if up().await {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!(
                    "rabbitmq-server exited ({status}) before accepting connections: {}",
                    self.log_tail()
                );
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!("private rabbitmq not up within 120 s: {}", self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`, or for a TLS node
    /// `amqps://guest:guest@localhost:<port>/%2f` (the name `localhost` is in the certificate).
    pub fn url(&self) -> String {
        if self.tls {
            format!("amqps://guest:guest@localhost:{}/%2f", self.port)
        } else {
            format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
        }
    }

    /// The node's console log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path("node.log")).unwrap_or_default()
    }

    /// The last 30 lines of the node's console log.
    pub fn log_tail(&self) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl PrivateRabbit {
    /// Runs `rabbitmqctl -n <node> args...` against this node (the inner script, as the
    /// calling user: the packaged wrapper would switch to user `rabbitmq` and its cookie) and
    /// returns its standard output; fails with its output when it exits non-zero or takes
    /// over 60 s.
    pub async fn ctl(&self, args: &[&str]) -> Result<String> {
        let bin = ["/usr/lib/rabbitmq/bin/rabbitmqctl", "/usr/sbin/rabbitmqctl"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or("rabbitmqctl");
        let run = tokio::process::Command::new(bin)
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .context("rabbitmqctl took over 60 s")??;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        anyhow::ensure!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(text)
    }

    /// Sends `sig` (`STOP` freezes the node: connections stay open, nothing answers; `CONT`
    /// wakes it) to the node's whole process group.
    pub fn signal_group(&self, sig: &str) -> Result<()> {
        let st = Command::new("kill")
            .args([
                format!("-{sig}"),
                "--".into(),
                format!("-{}", self.child.id()),
            ])
            .status()?;
        anyhow::ensure!(
            st.success(),
            "kill -{sig} of process group {} failed: {st}",
            self.child.id()
        );
        Ok(())
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        // A node a test froze (SIGSTOP) would leave SIGTERM pending: wake it first.
        let _ = Command::new("kill")
            .args(["-CONT", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        kill_group(&mut self.child);
        // The Erlang VM may outlive the script by a moment: kill what is left of the group.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
    }
}

/// A `redis-server` of this test alone (no persistence), so the test may flush or stop it
/// without touching the shared server: with `tls` (PKI, client certificates required?) only
/// a TLS port (`--port 0 --tls-port P`), else a plain port; an optional `requirepass`.
/// Killed (its process group) on drop.
pub struct PrivateRedis {
    pub port: u16,
    tls: bool,
    child: Child,
}

impl PrivateRedis {
    pub async fn start(tls: Option<(&Pki, bool)>, password: Option<&str>) -> Result<Self> {
        Self::start_with_env(tls, password, &[]).await
    }

    /// As [`PrivateRedis::start`], with extra environment variables for `redis-server` (e.g.
    /// libfaketime's `LD_PRELOAD` and `FAKETIME…`, to shift its `TIME`).
    pub async fn start_with_env(
        tls: Option<(&Pki, bool)>,
        password: Option<&str>,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let port = free_port()?;
        let mut cmd = Command::new("redis-server");
        cmd.envs(env.iter().copied());
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        match tls {
            Some((pki, require_client_cert)) => {
                cmd.args(["--port", "0", "--tls-port", &port.to_string()])
                    .args([
                        "--tls-cert-file",
                        &pki.server_cert,
                        "--tls-key-file",
                        &pki.server_key,
                        "--tls-ca-cert-file",
                        &pki.ca,
                    ])
                    .args([
                        "--tls-auth-clients",
                        if require_client_cert { "yes" } else { "no" },
                    ]);
            }
            None => {
                cmd.args(["--port", &port.to_string()]);
            }
        }
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("start redis-server")?;
        register(child.id(), true);
        let mut r = PrivateRedis {
            port,
            tls: tls.is_some(),
            child,
        };
        let start = std::time::Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Ok(Some(status)) = r.child.try_wait() {
                bail!("redis-server exited ({status}): is it built with TLS?");
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!("redis-server port not up within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(r)
    }

    /// `redis://[default:password@]127.0.0.1:<port>`, or for a TLS server
    /// `rediss://[default:password@]localhost:<port>` (the name in the certificate).
    pub fn url(&self, password: Option<&str>) -> String {
        let (scheme, host) = if self.tls {
            ("rediss", "localhost")
        } else {
            ("redis", "127.0.0.1")
        };
        match password {
            Some(p) => format!("{scheme}://default:{p}@{host}:{}", self.port),
            None => format!("{scheme}://{host}:{}", self.port),
        }
    }

    /// FLUSHALL on this server only (a plain server without a password).
    pub async fn flushall(&self) -> Result<()> {
        let store = fleet::Store::new(&self.url(None), fleet::Names::new("private"))?;
        store
            .query::<()>(&deadpool_redis::redis::cmd("FLUSHALL"))
            .await?;
        Ok(())
    }

    /// Refuses (`denied`) or allows again every Lua script call on this server only
    /// (`ACL SETUSER default -eval -evalsha ...` / `+@all`): each of fleet's shared decisions
    /// then fails at once with NOPERM while plain reads such as `TIME` are answered — a Redis
    /// that fails one kind of call, deterministically.
    pub async fn deny_scripts(&self, denied: bool) -> Result<()> {
        let store = fleet::Store::new(&self.url(None), fleet::Names::new("private"))?;
        let mut cmd = deadpool_redis::redis::cmd("ACL");
        cmd.arg("SETUSER").arg("default");
        if denied {
            cmd.arg("-eval")
                .arg("-evalsha")
                .arg("-eval_ro")
                .arg("-evalsha_ro")
                .arg("-fcall")
                .arg("-fcall_ro");
        } else {
            cmd.arg("+@all");
        }
        store.query::<()>(&cmd).await?;
        Ok(())
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}

/// A Redis Cluster of this test alone: `masters` × `redis-server --cluster-enabled yes` on free
/// loopback ports (their cluster buses on free ports too, `--cluster-port`), no persistence, in
/// a temporary directory, joined by `redis-cli --cluster create … --cluster-replicas 0`, so the
/// 16,384 slots are split evenly between the masters. Stopped by pid (process group) on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    children: Vec<Child>,
    dir: TempDir,
}

impl RedisCluster {
    /// Starts the masters and creates the cluster; returns once every node reports
    /// `cluster_state:ok` with every slot assigned (bounded: 60 s).
    pub async fn start(masters: usize) -> Result<Self> {
        // Built first, so the servers started so far are stopped if a later step fails.
        let mut c = RedisCluster {
            ports: Vec::new(),
            children: Vec::new(),
            dir: TempDir::new("redis-cluster")?,
        };
        for _ in 0..masters {
            let dir = &c.dir;
            let (port, bus) = (free_port()?, free_port()?);
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--cluster-port",
                    &bus.to_string(),
                    "--bind",
                    "127.0.0.1",
                ])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "5000",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args([
                    "--cluster-config-file",
                    &dir.path(&format!("nodes-{port}.conf")),
                    "--dir",
                    &dir.path(""),
                    "--logfile",
                    &dir.path(&format!("redis-{port}.log")),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .context("start redis-server (is it installed?)")?;
            register(child.id(), true);
            c.children.push(child);
            c.ports.push(port);
        }
        let start = std::time::Instant::now();
        for &port in &c.ports {
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                if start.elapsed() > Duration::from_secs(20) {
                    bail!(
                        "redis-server on {port} not up within 20 s: {}",
                        c.log_tail(port)
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let create = tokio::task::spawn_blocking(move || {
            Command::new("timeout")
                .args(["60", "redis-cli", "--cluster", "create"])
                .args(&nodes)
                .args(["--cluster-replicas", "0", "--cluster-yes"])
                .stdin(Stdio::null())
                .output()
        })
        .await??;
        if !create.status.success() {
            bail!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&create.stdout),
                String::from_utf8_lossy(&create.stderr)
            );
        }
        loop {
            let mut ok = true;
            for &port in &c.ports {
                let info = c.cli(port, &["CLUSTER", "INFO"]).await?;
                ok &= info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && info.contains(&format!("cluster_known_nodes:{masters}"));
            }
            if ok {
                return Ok(c);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "the Redis Cluster is not ok within 60 s: {}",
                    c.cli(c.ports[0], &["CLUSTER", "INFO"]).await?
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,…` (every master as a seed node).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// `redis-cli -p <port> ARGS…` against one node (no redirection): its raw output.
    pub async fn cli(&self, port: u16, args: &[&str]) -> Result<String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let out = tokio::task::spawn_blocking(move || {
            Command::new("timeout")
                .args(["10", "redis-cli", "-p", &port.to_string()])
                .args(&args)
                .stdin(Stdio::null())
                .output()
        })
        .await??;
        if !out.status.success() {
            bail!(
                "redis-cli -p {port}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn log_tail(&self, port: u16) -> String {
        let text = std::fs::read_to_string(self.dir.path(&format!("redis-{port}.log")))
            .unwrap_or_default();
        text.lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            kill_group(c);
        }
    }
}

/// Private processes of a test (redis-server, Sentinels), killed and reaped on drop.
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `redis-cli -p <port> args…` on loopback: its standard output, empty when it cannot run.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
