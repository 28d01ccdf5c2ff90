//! Fleet binaries as child processes (so a test can SIGKILL, SIGSTOP or SIGTERM them, or
//! watch one refuse to start): `fleet-worker`, `fleet-scheduler` and `fleetctl`, each with
//! only the settings the test gives (the runner's own `FLEET_*` variables removed), built
//! beforehand by `cargo build --bins`. Every wait on a process has a timeout; nothing blocks a
//! runtime thread.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fleet::registry::WorkerView;
use fleet::Store;

use crate::{wait_for, worker, Ns};

/// Path of a workspace binary next to the test executable (built by `cargo build --bins`).
pub fn bin_path(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|p| p.parent())
        .context("no target dir")?;
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found: build the binaries first (cargo build --bins)",
            p.display()
        );
    }
    Ok(p)
}

/// A command for the workspace binary `name` with the test runner's own `FLEET_*` variables
/// removed (so only what the test sets reaches the process) and stdin closed.
pub fn fleet_command(name: &str) -> Result<Command> {
    let mut cmd = Command::new(bin_path(name)?);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLEET_") {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null());
    Ok(cmd)
}

/// Runs the binary `name` with exactly the variables `env` (besides the inherited non-`FLEET_*`
/// ones) and `args`; returns (exit code, -1 on a signal; stdout; stderr) once it exits, failing
/// after 60 s (the process is killed then).
pub async fn run_bin(
    name: &str,
    env: &[(&str, &str)],
    args: &[&str],
) -> Result<(i32, String, String)> {
    let mut cmd = tokio::process::Command::from(fleet_command(name)?);
    cmd.envs(env.iter().copied()).args(args).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .with_context(|| format!("{name} {args:?} did not exit within 60 s"))??;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Runs a binary with only the given `FLEET_*` settings and no arguments; returns (exit code,
/// stderr) once it exits, failing after 60 s. For start-up refusals.
pub async fn run_to_exit(name: &str, env: &[(&str, &str)]) -> Result<(i32, String)> {
    let (code, _, err) = run_bin(name, env, &[]).await?;
    Ok((code, err))
}

/// The `FLEET_*` variables that point `fleetctl` at `ns` (its namespace, broker and Redis)
/// and at the scheduler API `api`.
pub fn fleetctl_env(ns: &Ns, api: &str) -> Vec<(String, String)> {
    let mut env = vec![("FLEET_API_URL".to_string(), api.to_string())];
    for (k, v) in &ns.base {
        if matches!(k.as_str(), "namespace" | "amqp_url" | "redis_url") {
            env.push((format!("FLEET_{}", k.to_ascii_uppercase()), v.clone()));
        }
    }
    env
}

/// Runs `fleetctl args` against `ns` and the scheduler API `api` (see [`fleetctl_env`]):
/// (exit code, stdout, stderr), failing after 60 s.
pub async fn fleetctl(ns: &Ns, api: &str, args: &[&str]) -> Result<(i32, String, String)> {
    fleetctl_with(ns, api, &[], args).await
}

/// [`fleetctl`] with more variables (e.g. `FLEET_API_TOKEN`).
pub async fn fleetctl_with(
    ns: &Ns,
    api: &str,
    more: &[(&str, &str)],
    args: &[&str],
) -> Result<(i32, String, String)> {
    let env = fleetctl_env(ns, api);
    let mut all: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    all.extend_from_slice(more);
    run_bin("fleetctl", &all, args).await
}

/// A `fleet-worker` process with the `http` executor, logging to a file (removed on drop
/// unless the test is panicking). Killed on drop if still running.
pub struct WorkerProcess {
    pub id: String,
    pub child: Child,
    pub log: PathBuf,
}

/// What a worker process is started with.
pub struct ProcessSpec<'a> {
    pub id: &'a str,
    pub labels: &'a str,
    pub capacity: u32,
    pub endpoint: &'a str,
    /// More settings, keys as in the config file (`drain_grace_ms`, ...).
    pub extra: &'a [(&'a str, &'a str)],
}

impl WorkerProcess {
    /// Starts `fleet-worker` in `ns` (its Redis URL taken from the namespace's settings).
    pub fn spawn(ns: &Ns, spec: &ProcessSpec<'_>) -> Result<Self> {
        Self::spawn_with_env(ns, spec, &[])
    }

    /// [`WorkerProcess::spawn`], then waits (up to 20 s) until the worker is registered
    /// `active`.
    pub async fn start(ns: &Ns, spec: &ProcessSpec<'_>) -> Result<Self> {
        let mut w = Self::spawn(ns, spec)?;
        w.wait_state(&ns.store, "active", Duration::from_secs(20))
            .await?;
        Ok(w)
    }

    /// [`WorkerProcess::spawn`] with more environment variables for the process (e.g.
    /// `LD_PRELOAD` of libfaketime).
    pub fn spawn_with_env(ns: &Ns, spec: &ProcessSpec<'_>, env: &[(&str, &str)]) -> Result<Self> {
        let log = std::env::temp_dir().join(format!(
            "fleet-{}-{}-{}.log",
            ns.name,
            spec.id,
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        ));
        let out =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone()?;
        let base: HashMap<&str, &str> = ns
            .base
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // Nothing of the test runner's own FLEET_* environment leaks in.
        let mut cmd = fleet_command("fleet-worker")?;
        let capacity = spec.capacity.to_string();
        let mut settings: Vec<(&str, &str)> = vec![
            (
                "namespace",
                base.get("namespace").copied().unwrap_or_default(),
            ),
            (
                "amqp_url",
                base.get("amqp_url").copied().unwrap_or_default(),
            ),
            (
                "redis_url",
                base.get("redis_url").copied().unwrap_or_default(),
            ),
            (
                "queue_type",
                base.get("queue_type").copied().unwrap_or("classic"),
            ),
            ("http_addr", "127.0.0.1:0"),
            ("executor", "http"),
            ("http_url", spec.endpoint),
            ("worker_id", spec.id),
            ("labels", spec.labels),
            ("capacity", capacity.as_str()),
            ("heartbeat_interval_ms", "300"),
            ("heartbeat_timeout_ms", "1500"),
            ("drain_grace_ms", "15000"),
            ("retry_base_ms", "100"),
            ("retry_cap_ms", "1000"),
        ];
        settings.extend_from_slice(spec.extra);
        for (k, v) in settings {
            cmd.env(format!("FLEET_{}", k.to_ascii_uppercase()), v);
        }
        cmd.env("RUST_LOG", "info,lapin=warn");
        cmd.envs(env.iter().copied());
        let child = cmd
            .stdout(out)
            .stderr(err)
            .spawn()
            .context("spawn fleet-worker")?;
        crate::servers::register(child.id(), false);
        Ok(WorkerProcess {
            id: spec.id.to_string(),
            child,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `STOP`, `CONT`) with `kill(1)`.
    pub fn signal(&self, sig: &str) -> Result<()> {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()?;
        if !st.success() {
            bail!("kill -{sig} {} failed: {st}", self.pid());
        }
        Ok(())
    }

    /// SIGKILL, and reaps the process.
    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Waits for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let child = &mut self.child;
        let r = wait_for(&format!("{} to exit", self.id), timeout, || {
            std::future::ready(child.try_wait().ok().flatten())
        })
        .await;
        r.with_context(|| format!("log:\n{}", self.log_tail()))
    }

    /// The last lines of the process's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits until the worker is registered in `state`.
    pub async fn wait_state(
        &mut self,
        store: &Store,
        state: &str,
        timeout: Duration,
    ) -> Result<WorkerView> {
        let start = Instant::now();
        loop {
            if let Some(w) = worker(store, &self.id).await {
                if w.state == state {
                    return Ok(w);
                }
            }
            if let Some(st) = self.child.try_wait()? {
                bail!(
                    "{} exited ({st}) before reaching state {state}; log:\n{}",
                    self.id,
                    self.log_tail()
                );
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} not {state} within {timeout:?}; log:\n{}",
                    self.id,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Kills `child` if it still runs and reaps it; removes its log unless the test is failing
/// by panicking (the log is kept for the reader then).
fn end_process(child: &mut Child, log: &std::path::Path) {
    if let Ok(None) = child.try_wait() {
        let _ = child.kill();
        let _ = child.wait();
    }
    if !std::thread::panicking() {
        let _ = std::fs::remove_file(log);
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        end_process(&mut self.child, &self.log);
    }
}

/// A `fleet-scheduler` process (so a test can SIGKILL it), logging to a file (removed on drop
/// unless the test is panicking). Killed on drop if still running.
pub struct SchedulerProcess {
    pub child: Child,
    /// `http://127.0.0.1:<port>` of its API and `/metrics`.
    pub base: String,
    pub log: PathBuf,
}

impl SchedulerProcess {
    /// Starts `fleet-scheduler` with the namespace's settings plus `extra` (config-file keys)
    /// and waits (up to 30 s) until `/readyz` answers 200.
    pub async fn spawn(ns: &Ns, extra: &[(&str, &str)]) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = std::env::temp_dir().join(format!("fleet-{}-scheduler-{port}.log", ns.name));
        let out = std::fs::File::create(&log)?;
        let mut cmd = fleet_command("fleet-scheduler")?;
        let addr = format!("127.0.0.1:{port}");
        for (k, v) in ns
            .base
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([("http_addr", addr.as_str())])
            .chain(extra.iter().copied())
        {
            cmd.env(format!("FLEET_{}", k.to_ascii_uppercase()), v);
        }
        cmd.env("RUST_LOG", "info,lapin=warn");
        let child = cmd
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("spawn fleet-scheduler")?;
        crate::servers::register(child.id(), false);
        let p = SchedulerProcess {
            child,
            base: format!("http://{addr}"),
            log,
        };
        let ready = format!("{}/readyz", p.base);
        wait_for("scheduler process ready", Duration::from_secs(30), || {
            let u = ready.clone();
            async move {
                crate::metrics::http()
                    .get(&u)
                    .send()
                    .await
                    .ok()
                    .filter(|r| r.status().is_success())
                    .map(|_| ())
            }
        })
        .await
        .with_context(|| std::fs::read_to_string(&p.log).unwrap_or_default())?;
        Ok(p)
    }

    /// SIGKILL, and reaps the process.
    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM and waits (up to `timeout`) for the exit.
    pub async fn stop(&mut self, timeout: Duration) -> Result<()> {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let child = &mut self.child;
        wait_for("the scheduler process to exit", timeout, || {
            std::future::ready(child.try_wait().ok().flatten())
        })
        .await?;
        Ok(())
    }
}

impl Drop for SchedulerProcess {
    fn drop(&mut self) {
        end_process(&mut self.child, &self.log);
    }
}
