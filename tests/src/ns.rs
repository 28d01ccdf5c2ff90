//! The test namespace: every test gets its own random namespace on the real RabbitMQ and
//! Redis (URLs from `AMQP_ADDR` / `REDIS_URL`, loopback by default), publishes into it, reads
//! its queues and statuses, waits on its events, and deletes it at the end.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use fleet::broker::probe::Prober;
use fleet::settings::{CommonConfig, Settings};
use fleet::{broker::amqp, broker::topology, Envelope, Lane, Names, Store};
use lapin::options::BasicGetOptions;

use crate::wait_for;

/// The shared RabbitMQ: `AMQP_ADDR`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_url() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The shared Redis: `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A test's namespace and its handles on the servers.
pub struct Ns {
    pub name: String,
    pub names: Names,
    pub store: Store,
    pub conn: lapin::Connection,
    pub publisher: amqp::Publisher,
    /// Settings every component of this test starts from.
    pub base: Vec<(String, String)>,
    /// Passive declares of queues that may be missing ([`Ns::depth_of`]): on a connection of
    /// their own, as the scheduler's (a 404 costs a lapin connection a channel id for good,
    /// `fleet::broker::probe`; a test that waits for a queue to go asks hundreds of times).
    pub probe: std::sync::Arc<Prober>,
}

impl Ns {
    /// A fresh namespace with classic queues (cheap to create and delete).
    pub async fn new() -> Result<Self> {
        Self::with_queue_type("classic").await
    }

    pub async fn with_queue_type(qt: &str) -> Result<Self> {
        Self::on(&amqp_url(), &redis_url(), qt, &[]).await
    }

    /// A fresh namespace (classic queues) whose Redis is `url` — a private server the test
    /// may flush or stop — on the shared RabbitMQ.
    pub async fn on_redis(url: &str) -> Result<Self> {
        Self::on(&amqp_url(), url, "classic", &[]).await
    }

    /// A fresh namespace (classic queues) on another broker (`amqp`) and the shared Redis.
    pub async fn on_broker(amqp: &str) -> Result<Self> {
        Self::on(amqp, &redis_url(), "classic", &[]).await
    }

    /// A fresh namespace on the given servers; `extra` settings (TLS files, ...) join the base
    /// every component starts from and serve the test's own connections too.
    pub async fn on(
        amqp_url: &str,
        redis_url: &str,
        qt: &str,
        extra: &[(String, String)],
    ) -> Result<Self> {
        crate::wait::watchdog();
        let name = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        record_namespace(&name);
        let names = Names::new(&name);
        crate::wait::hold(&name);
        let mut base = vec![
            ("namespace".to_string(), name.clone()),
            ("amqp_url".to_string(), amqp_url.to_string()),
            ("redis_url".to_string(), redis_url.to_string()),
            ("queue_type".to_string(), qt.to_string()),
            ("http_addr".to_string(), "127.0.0.1:0".to_string()),
        ];
        base.extend_from_slice(extra);
        let s = Settings::from_pairs(base.iter().map(|(k, v)| (k.as_str(), v.clone())));
        let store = Store::with_tls(redis_url, names.clone(), &tls_config(&s, "redis_tls")?)?;
        let amqp_tls = tls_config(&s, "amqp_tls")?;
        let conn = amqp::connect_with(amqp_url, "fleet-tests", &amqp_tls)
            .await
            .context("connect to RabbitMQ")?;
        let publisher = amqp::confirm_channel(&conn).await?;
        // The topology is declared by the scheduler and workers a test starts (with the
        // test's own bounds), not here.
        Ok(Ns {
            name,
            names,
            store,
            conn,
            publisher,
            base,
            probe: std::sync::Arc::new(Prober::new(amqp_url, "fleet-tests", &amqp_tls)),
        })
    }

    /// Settings = this namespace's base + the given overrides.
    pub fn settings(&self, extra: &[(&str, &str)]) -> Settings {
        let mut s = Settings::from_pairs(self.base.iter().map(|(k, v)| (k.as_str(), v.clone())));
        for (k, v) in extra {
            s.set(k, *v);
        }
        s
    }

    pub fn common(&self, extra: &[(&str, &str)]) -> Result<CommonConfig> {
        Ok(CommonConfig::from_settings(
            &self.settings(extra),
            "127.0.0.1:0",
        )?)
    }

    /// Publishes envelopes to the submit exchange (routing key = lane) with confirms.
    /// Returns (accepted, refused).
    pub async fn submit(&self, envs: &[Envelope]) -> Result<(usize, usize)> {
        let each = self.submit_each(envs).await?;
        let ok = each.iter().filter(|accepted| **accepted).count();
        Ok((ok, each.len() - ok))
    }

    /// Publishes raw bytes to the submit exchange.
    pub async fn submit_raw(&self, lane: Lane, body: &[u8]) -> Result<()> {
        amqp::publish_confirmed(
            &self.publisher,
            &self.names.submit_exchange(),
            lane.as_str(),
            body,
            amqp::task_properties("raw", None),
        )
        .await?;
        Ok(())
    }

    /// Publishes `body` (task `id`) straight to `group`'s queue of `lane` through the tasks
    /// exchange, with a confirm: what the scheduler does, for tests that run no scheduler.
    pub async fn publish_to_group(
        &self,
        group: &str,
        lane: Lane,
        id: &str,
        body: &[u8],
    ) -> Result<()> {
        amqp::publish_confirmed(
            &self.publisher,
            &self.names.tasks_exchange(),
            &self.names.group_key(group, lane),
            body,
            amqp::task_properties(id, None),
        )
        .await?;
        Ok(())
    }

    /// Takes (and acks) messages from `queue` until `n` are in hand: (properties, body) each,
    /// in queue order; fails after `timeout` naming how many came.
    pub async fn take(
        &self,
        queue: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<(lapin::BasicProperties, Vec<u8>)>> {
        let ch = self.conn.create_channel().await?;
        let out = std::sync::Mutex::new(Vec::new());
        let r = wait_for(&format!("{n} messages in {queue}"), timeout, || async {
            while out.lock().map(|v| v.len() < n).unwrap_or(false) {
                let Ok(Some(m)) = ch
                    .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                    .await
                else {
                    break;
                };
                if let Ok(mut v) = out.lock() {
                    v.push((m.delivery.properties.clone(), m.delivery.data));
                }
            }
            out.lock().ok().filter(|v| v.len() >= n).map(|_| ())
        })
        .await;
        let out = out.into_inner().unwrap_or_else(|p| p.into_inner());
        let _ = ch.close(200, "taken".into()).await;
        r.with_context(|| format!("{} of {n} messages in {queue}", out.len()))?;
        Ok(out)
    }

    /// Takes every message in the dead-letter queue: (envelope bytes, reason header).
    pub async fn drain_dead(&self) -> Result<Vec<(Vec<u8>, Option<String>)>> {
        tokio::time::timeout(Duration::from_secs(60), async {
            let ch = self.conn.create_channel().await?;
            let mut out = Vec::new();
            while let Some(m) = ch
                .basic_get(
                    self.names.dead_queue().as_str().into(),
                    BasicGetOptions { no_ack: true },
                )
                .await?
            {
                let reason = amqp::header_str(&m.delivery.properties, fleet::task::headers::REASON);
                out.push((m.delivery.data, reason));
            }
            anyhow::Ok(out)
        })
        .await
        .context("draining the dead-letter queue took over 60 s")?
    }

    /// Depth of a queue (ready messages; 0 if missing or the broker did not answer).
    pub async fn depth(&self, queue: &str) -> u32 {
        self.depth_of(queue).await.unwrap_or(0)
    }

    /// Depth of a queue (ready messages) by passive declare, `None` when it does not exist
    /// (or the broker did not answer).
    pub async fn depth_of(&self, queue: &str) -> Option<u32> {
        self.probe
            .queue(queue)
            .await
            .ok()
            .flatten()
            .map(|q| q.ready)
    }

    /// Status fields of a task.
    pub async fn status(&self, id: &str) -> Result<Option<BTreeMap<String, String>>> {
        Ok(self.store.task_status(id).await?)
    }

    /// Normal-lane shard queues of the namespace's most sharded group: shard queues
    /// `<ns>.group.<g>.normal.<i>` are numbered from 0, so the first `i` of any group whose
    /// queue does not exist (passive declare) is its count; 1 when no group is sharded.
    async fn shard_count(&self, groups: &[String]) -> u32 {
        let mut most = 1;
        for g in groups {
            let mut n = 0;
            while n < 1024
                && self
                    .depth_of(&self.names.group_shard_queue(g, Lane::Normal, n, 2))
                    .await
                    .is_some()
            {
                n += 1;
            }
            most = most.max(n);
        }
        most
    }

    /// Deletes every queue, exchange and key of the namespace: every shard queue of every
    /// group (however many shards the test used) and the waiting-for-worker park queues too.
    pub async fn cleanup(self) -> Result<()> {
        crate::wait::release(&self.name);
        // Bounded, like every wait of the harness: a broker or Redis that stops answering
        // fails the test here instead of holding the suite.
        tokio::time::timeout(Duration::from_secs(60), async {
            let groups = self.store.group_names().await.unwrap_or_default();
            let shards = self.shard_count(&groups).await;
            // The broker's queue catalog names the groups Redis may have forgotten.
            topology::delete_namespace(&self.conn, &self.names, &groups, shards).await?;
            self.store.delete_namespace().await?;
            anyhow::Ok(())
        })
        .await
        .with_context(|| format!("cleaning up namespace {} took over 60 s", self.name))??;
        let _ =
            tokio::time::timeout(Duration::from_secs(5), self.conn.close(200, "bye".into())).await;
        Ok(())
    }
    /// Publishes each envelope and reports, per envelope, whether the broker accepted it.
    pub async fn submit_each(&self, envs: &[Envelope]) -> Result<Vec<bool>> {
        tokio::time::timeout(Duration::from_secs(60), async {
            let mut out = Vec::with_capacity(envs.len());
            for c in fleet::broker::publish_envelopes(
                &self.publisher,
                &self.names.submit_exchange(),
                envs,
            )
            .await
            {
                out.push(amqp::confirmed(c?).await.is_ok());
            }
            anyhow::Ok(out)
        })
        .await
        .context("publishing took over 60 s (no confirm from the broker)")?
    }
    /// Declares the submit exchange, the core queues and the ingress queues (as a scheduler
    /// would, with `extra` settings), so a test can publish while no scheduler runs.
    pub async fn declare_ingress(&self, extra: &[(&str, &str)]) -> Result<()> {
        let cfg = self.common(extra)?;
        let ch = self.conn.create_channel().await?;
        topology::declare_core(&ch, &cfg).await?;
        topology::declare_ingress(&ch, &cfg).await?;
        Ok(())
    }

    /// Waits until every group has nothing reserved and nothing running.
    pub async fn wait_groups_idle(&self, timeout: Duration) -> Result<()> {
        wait_for(
            "every group's reserved and load back to 0",
            timeout,
            || async {
                let gs = self.store.groups().await.ok()?;
                gs.iter()
                    .all(|g| g.reserved == 0 && g.load == 0)
                    .then_some(())
            },
        )
        .await
    }

    /// Waits until the work in this namespace has settled: both ingress queues and every
    /// registered group's queues hold no ready message, and every group has nothing reserved
    /// and nothing running. After it no further run can start (the barrier that replaces a
    /// quiet period before asserting that nothing ran twice).
    pub async fn wait_settled(&self, timeout: Duration) -> Result<()> {
        wait_for("queues empty and every group idle", timeout, || async {
            let gs = self.store.groups().await.ok()?;
            for lane in Lane::ALL {
                if self.depth(&self.names.ingress_queue(lane)).await > 0 {
                    return None;
                }
                for g in &gs {
                    if self.depth(&self.names.group_queue(&g.group, lane)).await > 0 {
                        return None;
                    }
                }
            }
            gs.iter()
                .all(|g| g.reserved == 0 && g.load == 0)
                .then_some(())
        })
        .await
    }

    /// Waits until `id`'s status has `state`; returns the status fields. The error names the
    /// last status read.
    pub async fn wait_state(
        &self,
        id: &str,
        state: &str,
        timeout: Duration,
    ) -> Result<BTreeMap<String, String>> {
        let r = wait_for(&format!("task {id} {state}"), timeout, || async {
            let st = self.status(id).await.ok()??;
            (st.get("state").map(String::as_str) == Some(state)).then_some(st)
        })
        .await;
        match r {
            Ok(s) => Ok(s),
            Err(e) => {
                let last = self.status(id).await.ok().flatten();
                Err(e.context(format!("last status of {id}: {last:?}")))
            }
        }
    }

    /// A task's `state` field, `None` without a status.
    pub async fn state_of(&self, id: &str) -> Option<String> {
        self.status(id)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.get("state").cloned())
    }
}

/// A namespace left without [`Ns::cleanup`] (its test failed early or panicked) no longer
/// counts against the test's deadline ([`crate::watchdog`]); its queues and keys stay.
impl Drop for Ns {
    fn drop(&mut self) {
        crate::wait::release(&self.name);
    }
}

/// An envelope of `kind` with a selector.
pub fn task(kind: &str, payload: serde_json::Value, labels: &str) -> Envelope {
    let mut e = Envelope::new(kind, payload);
    e.labels = fleet::Labels::parse(labels).unwrap_or_default();
    e
}

/// The TLS settings `<prefix>_ca_file`, `_cert_file`, `_key_file` of `s` (prefix `amqp_tls`,
/// `redis_tls`, `http_tls`) as the binaries build them, errors naming `FLEET_<PREFIX>_*_FILE`.
pub fn tls_config(s: &Settings, prefix: &str) -> Result<fleet::tls::TlsConfig> {
    let file = |what: &str| s.opt_string(&format!("{prefix}_{what}_file"));
    let (ca, cert, key) = (file("ca"), file("cert"), file("key"));
    let var_prefix = format!("FLEET_{}", prefix.to_ascii_uppercase());
    Ok(fleet::tls::TlsConfig::from_files(
        &var_prefix,
        ca.as_deref(),
        cert.as_deref(),
        key.as_deref(),
    )?)
}

/// Appends namespace `name` to the file `FLEET_TEST_NS_FILE` names, when set (ops/test.sh
/// sets it): after the tests, the script deletes what this run's namespaces left on the
/// shared broker — a test that fails skips its own clean-up — and nobody else's.
fn record_namespace(name: &str) {
    let Some(path) = std::env::var_os("FLEET_TEST_NS_FILE") else {
        return;
    };
    let line = format!("{name}\n");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = std::io::Write::write_all(&mut f, line.as_bytes());
    }
}
