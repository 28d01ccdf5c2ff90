//! The park loops of one session ([`ParkLoops`]): which (group, lane) has a running release
//! loop, so discovery starts each once, and a group's reclaim stops them and keeps them
//! stopped.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fleet::Lane;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The park loops of one session by (group, lane): discovery starts them, a group's reclaim
/// stops them (see [`crate::reclaim`]).
#[derive(Default)]
pub struct ParkLoops {
    inner: std::sync::Mutex<LoopsState>,
}

/// A running loop: its start number, its token and its task.
type RunningLoop = (u64, CancellationToken, Option<JoinHandle<()>>);

#[derive(Default)]
struct LoopsState {
    /// Per loop: its start number (tells a loop from the one that replaced it), its token
    /// and its task.
    running: HashMap<(String, Lane), RunningLoop>,
    starts: u64,
    /// Groups stopped for a reclaim, with when: a discovery pass that listed the groups
    /// before that may hold a stale list, and skips them.
    stopped: HashMap<String, Instant>,
}

/// How long a reclaimed group is remembered by [`ParkLoops`].
const STOPPED_MEMORY: Duration = Duration::from_secs(300);

impl ParkLoops {
    fn state(&self) -> std::sync::MutexGuard<'_, LoopsState> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reserves the start of a loop: its token, or `None` when it runs already or its group was
    /// stopped after `listed_at` (the list it comes from may be stale).
    pub(super) fn claim_start(
        &self,
        group: &str,
        lane: Lane,
        listed_at: Instant,
        parent: &CancellationToken,
    ) -> Option<(u64, CancellationToken)> {
        let mut st = self.state();
        let key = (group.to_string(), lane);
        if st.running.contains_key(&key) || st.stopped.get(group).is_some_and(|at| *at >= listed_at)
        {
            return None;
        }
        let token = parent.child_token();
        st.starts += 1;
        let n = st.starts;
        st.running.insert(key, (n, token.clone(), None));
        Some((n, token))
    }

    pub(super) fn started(&self, group: &str, lane: Lane, n: u64, handle: JoinHandle<()>) {
        if let Some((m, _, h)) = self.state().running.get_mut(&(group.to_string(), lane)) {
            if *m == n {
                *h = Some(handle);
            }
        }
    }

    /// Forgets a loop that ended by itself (unless another took its place).
    pub(super) fn ended(&self, group: &str, lane: Lane, n: u64) {
        let mut st = self.state();
        let key = (group.to_string(), lane);
        if st.running.get(&key).is_some_and(|(m, _, _)| *m == n) {
            st.running.remove(&key);
        }
    }

    /// Stops a group's loops (both lanes) and keeps discovery from starting them again until
    /// [`ParkLoops::resume`]; waits for them to end (closing their channels), at most `wait`.
    pub async fn stop_group(&self, group: &str, wait: Duration) {
        let handles: Vec<JoinHandle<()>> = {
            let mut st = self.state();
            let now = Instant::now();
            st.stopped
                .retain(|_, at| now.duration_since(*at) < STOPPED_MEMORY);
            st.stopped.insert(group.to_string(), now);
            Lane::ALL
                .iter()
                .filter_map(|l| st.running.remove(&(group.to_string(), *l)))
                .filter_map(|(_, t, h)| {
                    t.cancel();
                    h
                })
                .collect()
        };
        let _ = tokio::time::timeout(wait, futures::future::join_all(handles)).await;
    }

    /// Marks a stopped group's reclaim as ended now (a discovery pass that listed the groups
    /// before this skips it).
    pub fn reclaimed(&self, group: &str) {
        self.state()
            .stopped
            .insert(group.to_string(), Instant::now());
    }

    /// Lets discovery start a stopped group's loops again (its reclaim was undone).
    pub fn resume(&self, group: &str) {
        self.state().stopped.remove(group);
    }

    /// Groups and lanes with a loop.
    pub fn running(&self) -> Vec<(String, Lane)> {
        self.state().running.keys().cloned().collect()
    }
}
