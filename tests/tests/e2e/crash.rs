//! A worker process killed with SIGKILL in the middle of its tasks: the broker gives its
//! unacknowledged tasks to a peer, the health checker evicts it, and every accepted task ends
//! `succeeded`; only tasks that were in flight on the dead worker run twice.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use fleet_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_flight_loses_no_task() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(300).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut victim = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-victim",
            labels: "",
            capacity: 4,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let peer_cfg = ep.worker_settings();
    let peer = start_worker(&ns, "w-peer", "", 4, &peer_cfg, &[]).await?;
    let gname = "protocol=http";
    let g = wait_for("group capacity 8", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 8)
    })
    .await?;
    assert_eq!(g.workers, 2);

    let envs = jobs(40, "", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (40, 0));

    // Kill once the victim has finished some tasks and is in the middle of four more: all four
    // started 100-200 ms ago (of 300), so its previous answers are long acked.
    wait_for("the victim mid-flight", Duration::from_secs(30), || async {
        let done = ep
            .calls_of("w-victim")
            .iter()
            .filter(|c| c.answered.is_some())
            .count();
        let running = ep.running("w-victim");
        let mid = running
            .iter()
            .all(|c| (100..200).contains(&c.at.elapsed().as_millis()));
        (done >= 4 && running.len() == 4 && mid).then_some(())
    })
    .await?;
    let killed_at = Instant::now();
    victim.kill9()?;
    ep.mark_dead("w-victim");
    // In flight at the kill, as the broker saw it: started and not acked. A task answered
    // just before the kill may not have been acked yet, so answers within the last 100 ms
    // count as in flight too.
    let unanswered: HashSet<String> = ep
        .calls_of("w-victim")
        .into_iter()
        .filter(|c| c.at <= killed_at && c.answered.is_none_or(|a| a > killed_at))
        .map(|c| c.id)
        .collect();
    let in_flight: HashSet<String> = ep
        .calls_of("w-victim")
        .into_iter()
        .filter(|c| {
            c.at <= killed_at
                && c.answered
                    .is_none_or(|a| a + Duration::from_millis(100) > killed_at)
        })
        .map(|c| c.id)
        .collect();

    // Eviction: the dead worker leaves the registry and its capacity leaves the group.
    let gone = wait_gone(&ns.store, "w-victim", Duration::from_secs(15)).await?;
    println!(
        "crash: {} in flight at the kill ({} unanswered); evicted {} ms after the kill",
        in_flight.len(),
        unanswered.len(),
        (gone - killed_at).as_millis()
    );

    let queue = ns.names.group_queue(gname, fleet::Lane::Normal);
    wait_settled(&ns, &ep, &ids, &queue, Duration::from_secs(60)).await?;
    let per = ep.per_task();
    assert_eq!(per.len(), 40, "every task ran");
    let mut twice = HashSet::new();
    for id in &ids {
        let calls = &per[id];
        let answered = calls.iter().filter(|c| c.answered.is_some()).count();
        assert!(answered >= 1, "task {id} never completed: {calls:?}");
        match calls.len() {
            1 => {}
            2 => {
                assert_eq!(
                    calls[0].worker, "w-victim",
                    "task {id} ran twice, first on {}",
                    calls[0].worker
                );
                assert_eq!(
                    calls[1].worker, "w-peer",
                    "task {id}: the redelivery ran on {}",
                    calls[1].worker
                );
                assert!(
                    calls[0].at <= killed_at,
                    "task {id}: first run started after the kill"
                );
                assert!(calls[1].attempt >= calls[0].attempt);
                twice.insert(id.clone());
            }
            n => panic!("task {id} ran {n} times: {calls:?}"),
        }
    }
    assert!(
        twice.is_subset(&in_flight),
        "ran twice: {twice:?}; in flight at the kill: {in_flight:?}"
    );
    assert!(
        twice.len() <= 4,
        "at most the victim's capacity (its prefetch) may run twice"
    );
    // What was unanswered at the kill must have been redone by the peer.
    assert!(
        unanswered.is_subset(&twice),
        "unanswered at the kill {unanswered:?}, redone {twice:?}"
    );
    assert_eq!(
        unanswered.len(),
        4,
        "the victim was killed with all four slots busy"
    );
    // Statuses: `succeeded`, except possibly for a task the victim finished and acked in the
    // last moments before the kill (the ledger writes its outcome just after the ack).
    let sure: Vec<String> = ids
        .iter()
        .filter(|id| !(per[*id].len() == 1 && in_flight.contains(*id)))
        .cloned()
        .collect();
    wait_succeeded(&ns, &sure, Duration::from_secs(10)).await?;
    println!(
        "crash: {} of 40 tasks ran twice (in flight: {})",
        twice.len(),
        in_flight.len()
    );

    // Nothing dead, nothing left, no capacity or load leaked.
    assert!(ns.drain_dead().await?.is_empty(), "no task dead-lettered");
    let g = wait_for("group load back to 0", Duration::from_secs(10), || async {
        group(&ns.store, gname)
            .await
            .filter(|g| g.load == 0 && g.reserved == 0)
    })
    .await?;
    assert_eq!(
        (g.workers, g.capacity),
        (1, 4),
        "only the peer's capacity remains"
    );
    assert_eq!(ns.depth(&queue).await, 0);

    peer.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
