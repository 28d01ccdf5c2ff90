//! Private servers for the security tests — a test PKI made at test time (rcgen), a RabbitMQ
//! node with a TLS-only listener and a `redis-server` with a TLS-only port — and a three-master
//! Redis Cluster, each on free loopback ports, in a temporary directory, stopped by pid
//! (process group) on drop. The shared servers are never touched.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> Result<u16> {
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
        let mut sp = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        sp.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("localhost"));
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = sp.signed_by(&server_key, &ca, &ca_key)?;
        let client_key = KeyPair::generate()?;
        let mut cp = CertificateParams::new(Vec::<String>::new())?;
        cp.distinguished_name.push(DnType::CommonName, "fleet-client");
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
fn kill_group(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", "--", &format!("-{}", child.id())]).status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
    let _ = child.wait();
}

/// A RabbitMQ node of this test alone with a TLS-only listener on `port`
/// (`amqps://guest:guest@localhost:<port>/%2f`). With `require_client_cert` the node verifies
/// peers and refuses a client without a certificate (`fail_if_no_peer_cert`).
pub struct TlsRabbit {
    pub port: u16,
    child: Child,
    dir: TempDir,
}

impl TlsRabbit {
    /// Starts the node and waits (up to 120 s) until its TLS port accepts connections.
    pub async fn start(pki: &Pki, require_client_cert: bool) -> Result<Self> {
        let dir = TempDir::new("rabbit")?;
        let port = free_port()?;
        let dist = free_port()?;
        let conf = format!(
            "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\nssl_options.cacertfile = {}\nssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\nssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = {require_client_cert}\n\
             loopback_users.guest = true\nlog.console = true\nlog.file = false\n",
            pki.ca, pki.server_cert, pki.server_key
        );
        let conf_path = dir.write("rabbitmq.conf", &conf)?;
        let plugins = dir.write("enabled_plugins", "[].\n")?;
        // The inner script runs the node as the calling user; the packaged wrapper would switch
        // to user `rabbitmq` (needing the world-readable files above).
        let bin = ["/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or("rabbitmq-server");
        let node = format!("fleet-tls-{}@localhost", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let log = std::fs::File::create(dir.path("node.log"))?;
        let child = Command::new(bin)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_PORT", free_port()?.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.path("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.path("log"))
            .env("RABBITMQ_CONFIG_FILE", &conf_path)
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", &plugins)
            .env("RABBITMQ_PID_FILE", dir.path("pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("start rabbitmq-server (is it installed?)")?;
        let mut r = TlsRabbit { port, child, dir };
        let start = std::time::Instant::now();
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                return Ok(r);
            }
            if let Ok(Some(status)) = r.child.try_wait() {
                bail!("rabbitmq-server exited ({status}) before listening: {}", r.log_tail());
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!("rabbitmq TLS listener not up within 120 s: {}", r.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `amqps://guest:guest@localhost:<port>/%2f` (the name `localhost` is in the certificate).
    pub fn url(&self) -> String {
        format!("amqps://guest:guest@localhost:{}/%2f", self.port)
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path("node.log")).unwrap_or_default();
        text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for TlsRabbit {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}

/// A `redis-server` of this test alone: with `tls` (PKI, client certificates required?) only a
/// TLS port (`--port 0 --tls-port P`), else a plain port; an optional `requirepass`.
pub struct TestRedis {
    pub port: u16,
    tls: bool,
    child: Child,
}

impl TestRedis {
    pub async fn start(tls: Option<(&Pki, bool)>, password: Option<&str>) -> Result<Self> {
        let port = free_port()?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        match tls {
            Some((pki, require_client_cert)) => {
                cmd.args(["--port", "0", "--tls-port", &port.to_string()])
                    .args(["--tls-cert-file", &pki.server_cert, "--tls-key-file", &pki.server_key, "--tls-ca-cert-file", &pki.ca])
                    .args(["--tls-auth-clients", if require_client_cert { "yes" } else { "no" }]);
            }
            None => {
                cmd.args(["--port", &port.to_string()]);
            }
        }
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).process_group(0).spawn().context("start redis-server")?;
        let mut r = TestRedis { port, tls: tls.is_some(), child };
        let start = std::time::Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
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

    /// `redis[s]://[default:password@]localhost:<port>`.
    pub fn url(&self, password: Option<&str>) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        match password {
            Some(p) => format!("{scheme}://default:{p}@localhost:{}", self.port),
            None => format!("{scheme}://localhost:{}", self.port),
        }
    }
}

impl Drop for TestRedis {
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
        let mut c = RedisCluster { ports: Vec::new(), children: Vec::new(), dir: TempDir::new("redis-cluster")? };
        for _ in 0..masters {
            let dir = &c.dir;
            let (port, bus) = (free_port()?, free_port()?);
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--cluster-port", &bus.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no"])
                .args(["--cluster-config-file", &dir.path(&format!("nodes-{port}.conf")), "--dir", &dir.path(""), "--logfile", &dir.path(&format!("redis-{port}.log"))])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .context("start redis-server (is it installed?)")?;
            c.children.push(child);
            c.ports.push(port);
        }
        let start = std::time::Instant::now();
        for &port in &c.ports {
            while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                if start.elapsed() > Duration::from_secs(20) {
                    bail!("redis-server on {port} not up within 20 s: {}", c.log_tail(port));
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
            bail!("redis-cli --cluster create: {}{}", String::from_utf8_lossy(&create.stdout), String::from_utf8_lossy(&create.stderr));
        }
        loop {
            let mut ok = true;
            for &port in &c.ports {
                let info = c.cli(port, &["CLUSTER", "INFO"]).await?;
                ok &= info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384") && info.contains(&format!("cluster_known_nodes:{masters}"));
            }
            if ok {
                return Ok(c);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("the Redis Cluster is not ok within 60 s: {}", c.cli(c.ports[0], &["CLUSTER", "INFO"]).await?);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,…` (every master as a seed node).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// `redis-cli -p <port> ARGS…` against one node (no redirection): its raw output.
    pub async fn cli(&self, port: u16, args: &[&str]) -> Result<String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let out = tokio::task::spawn_blocking(move || Command::new("timeout").args(["10", "redis-cli", "-p", &port.to_string()]).args(&args).stdin(Stdio::null()).output())
            .await??;
        if !out.status.success() {
            bail!("redis-cli -p {port}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn log_tail(&self, port: u16) -> String {
        let text = std::fs::read_to_string(self.dir.path(&format!("redis-{port}.log"))).unwrap_or_default();
        text.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            kill_group(c);
        }
    }
}
