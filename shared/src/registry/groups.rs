//! Groups: their capacity, load and reservations as the API shows them, their completion
//! counters and room (backpressure), and their workers' ordinals (subsetting).

use std::collections::BTreeMap;

use deadpool_redis::redis;
use serde::Serialize;

use crate::error::Result;
use crate::redis::Store;
use crate::task::{Lane, PerLane};

/// A group as the API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct GroupView {
    /// The group name (its label set).
    pub group: String,
    /// Its labels, as a JSON object of strings.
    pub labels: serde_json::Value,
    /// Workers registered in it, in any state.
    pub workers: u32,
    /// Normal-lane slots of its active workers.
    pub capacity: u32,
    /// Critical-lane slots of its active workers.
    pub critical_capacity: u32,
    /// Normal-lane tasks running (unexpired run leases).
    pub load: u32,
    /// Normal-lane tasks dispatched and not started (unexpired reservations).
    pub reserved: u32,
    /// Critical-lane tasks running.
    pub critical_load: u32,
    /// Critical-lane tasks dispatched and not started.
    pub critical_reserved: u32,
}

impl GroupView {
    /// Each lane's capacity (`capacity`, `critical_capacity`).
    pub fn capacities(&self) -> PerLane<u32> {
        PerLane {
            normal: self.capacity,
            critical: self.critical_capacity,
        }
    }

    /// Each lane's tasks running or reserved (`load + reserved`, `critical_load +
    /// critical_reserved`).
    pub fn in_flight(&self) -> PerLane<u32> {
        PerLane {
            normal: self.load + self.reserved,
            critical: self.critical_load + self.critical_reserved,
        }
    }
}

impl Store {
    /// Completed attempts so far of each group, per lane (counters kept by the `finish`
    /// script), for measuring completion rates; in the order of `groups`.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn group_completions(&self, groups: &[String]) -> Result<Vec<PerLane<u64>>> {
        if groups.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for g in groups {
            p.cmd("HMGET")
                .arg(self.names.group(g))
                .arg("done:normal")
                .arg("done:critical");
        }
        let raw: Vec<(Option<u64>, Option<u64>)> = self.pipe(&p).await?;
        Ok(raw
            .into_iter()
            .map(|(n, c)| PerLane {
                normal: n.unwrap_or(0),
                critical: c.unwrap_or(0),
            })
            .collect())
    }

    /// Sets each group's room ahead of its workers per lane (tasks; see the `reserve` script).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn set_rooms(&self, rooms: &[(String, Lane, u64)]) -> Result<()> {
        if rooms.is_empty() {
            return Ok(());
        }
        // Only groups that exist: a reclaimed group's hash must not come back (`registry/rooms.lua`).
        let mut inv = self.scripts.rooms.prepare_invoke();
        for (g, lane, room) in rooms {
            inv.key(self.names.group(g)).arg(lane.as_str()).arg(*room);
        }
        self.invoke::<i64>(&inv).await.map(|_| ())
    }

    /// A group's worker ordinals (deterministic subsetting): ordinal → worker id. Taken by
    /// `register.lua` (lowest free), freed by deregistration and eviction.
    pub async fn group_ordinals(&self, group: &str) -> Result<BTreeMap<u32, String>> {
        let raw: BTreeMap<String, String> = self
            .query(redis::cmd("HGETALL").arg(self.names.group_ordinals(group)))
            .await?;
        Ok(raw
            .into_iter()
            .filter_map(|(o, id)| Some((o.parse().ok()?, id)))
            .collect())
    }

    /// Names of all groups ever registered in this namespace.
    pub async fn group_names(&self) -> Result<Vec<String>> {
        let mut g: Vec<String> = self
            .query(redis::cmd("SMEMBERS").arg(self.names.groups()))
            .await?;
        g.sort();
        Ok(g)
    }

    /// All groups with capacity, running (load) and reserved counts per lane. Expired leases
    /// are not counted.
    pub async fn groups(&self) -> Result<Vec<GroupView>> {
        let names = self.group_names().await?;
        if names.is_empty() {
            return Ok(vec![]);
        }
        let now = self.clock.now_ms();
        let mut p = redis::pipe();
        for g in &names {
            p.cmd("HGETALL").arg(self.names.group(g));
            p.cmd("SCARD").arg(self.names.group_workers(g));
            for lane in Lane::ALL {
                p.cmd("ZCOUNT")
                    .arg(self.names.running(g, lane))
                    .arg(now)
                    .arg("+inf");
                p.cmd("ZCOUNT")
                    .arg(self.names.reserved(g, lane))
                    .arg(now)
                    .arg("+inf");
            }
        }
        let raw: Vec<redis::Value> = self.pipe(&p).await?;
        let mut out = Vec::with_capacity(names.len());
        for (i, g) in names.into_iter().enumerate() {
            let base = i * 6;
            let h: BTreeMap<String, String> =
                redis::from_redis_value(raw[base].clone()).unwrap_or_default();
            let n = |j: usize| -> u32 {
                redis::from_redis_value::<u32>(raw[base + j].clone()).unwrap_or(0)
            };
            let cap = |k: &str| {
                h.get(k)
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or(0)
                    .max(0) as u32
            };
            out.push(GroupView {
                labels: h
                    .get("labels")
                    .and_then(|l| serde_json::from_str(l).ok())
                    .unwrap_or_default(),
                workers: n(1),
                capacity: cap("cap:normal"),
                critical_capacity: cap("cap:critical"),
                load: n(2),
                reserved: n(3),
                critical_load: n(4),
                critical_reserved: n(5),
                group: g,
            });
        }
        Ok(out)
    }
}
