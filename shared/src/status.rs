//! Task status records (`t:<id>` hashes with a TTL): queued, running, retrying, succeeded,
//! dead, expired — with attempts, worker, timestamps and a truncated result or error. They
//! are written by the same scripts that reserve, start and finish (no extra round trips).
//! Status is state that may be lost: the task itself always lives in the broker.

use std::collections::BTreeMap;

use deadpool_redis::redis;

use crate::error::Result;
use crate::store::Store;

/// States that end a task.
pub const TERMINAL: &[&str] = &["succeeded", "dead", "expired"];

impl Store {
    /// A task's status fields, `None` when unknown (never seen, or expired from Redis).
    pub async fn task_status(&self, id: &str) -> Result<Option<BTreeMap<String, String>>> {
        let m: BTreeMap<String, String> = self.query(redis::cmd("HGETALL").arg(self.names.task(id))).await?;
        Ok(if m.is_empty() { None } else { Some(m) })
    }

    /// Forgets a task: its dedupe mark and its status record, so the same id may be submitted
    /// again as new (a dead-letter replay starts again from attempt 1).
    pub async fn forget_task(&self, id: &str) -> Result<()> {
        self.query::<i64>(redis::cmd("DEL").arg(self.names.dedupe(id)).arg(self.names.task(id))).await.map(|_| ())
    }

    /// Sets status fields directly, for many tasks in one round trip (states decided outside
    /// the scripts: expired or refused at the scheduler, delayed submissions).
    pub async fn set_statuses(&self, records: &[(&str, Vec<(&str, String)>)], ttl_ms: i64) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (id, fields) in records {
            let key = self.names.task(id);
            p.cmd("HSET").arg(&key);
            for (k, v) in fields {
                p.arg(*k).arg(v);
            }
            p.ignore();
            p.cmd("PEXPIRE").arg(&key).arg(ttl_ms).ignore();
        }
        self.pipe::<()>(&p).await
    }
}
