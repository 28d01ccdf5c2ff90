//! Issue 30 item 12: RabbitMQ needs open files for fleet's queues. A broker started with the
//! usual `ulimit -n 1024` (a 927-handle cache) wedged with ~335 queues: every new connection
//! hung in the handshake. The harness starts its private nodes as `ops/services.sh` starts the
//! shared one (`RABBITMQ_NOFILE`, default 65536, or the hard limit when lower); this test
//! checks the limit such a node reports (`rabbitmqctl status`: "File Descriptors … limit") and
//! that one namespace with one group declares exactly the queues docs/scaling.md counts.

use std::time::Duration;

use anyhow::{Context, Result};
use fleet_tests::*;

/// The smallest open-file limit ops/services.sh accepts (`RABBITMQ_NOFILE_MIN`), minus the
/// ~100 descriptors RabbitMQ keeps out of its handle cache.
const MIN_FD_LIMIT: u64 = 4096 - 100;

/// "File Descriptors\n\nTotal: 2, limit: 927" in `rabbitmqctl status` → 927.
fn fd_limit(status: &str) -> Option<u64> {
    let plain: String = status
        .split('\x1b')
        .enumerate()
        .map(|(i, part)| {
            if i == 0 {
                part
            } else {
                part.split_once('m').map(|(_, rest)| rest).unwrap_or("")
            }
        })
        .collect();
    let after = plain.split("File Descriptors").nth(1)?;
    let line = after.lines().find(|l| l.starts_with("Total:"))?;
    line.rsplit("limit:").next()?.trim().parse().ok()
}

/// A number docs/scaling.md states as `<!-- check:NAME -->**N**`.
fn documented(docs: &str, name: &str) -> Result<usize> {
    let marker = format!("<!-- check:{name} -->");
    let at = docs
        .find(&marker)
        .with_context(|| format!("docs/scaling.md has no {marker}"))?;
    let digits: String = docs[at + marker.len()..]
        .trim_start_matches('*')
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .with_context(|| format!("no number after {marker}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_has_room_for_the_queues_a_namespace_declares() -> Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let status = rabbit.ctl(&["status"]).await?;
    let limit = fd_limit(&status).with_context(|| format!("no descriptor limit in:\n{status}"))?;
    println!("private RabbitMQ node: file-descriptor limit {limit}");
    assert!(
        limit >= MIN_FD_LIMIT,
        "the node's file-descriptor limit is {limit}, below {MIN_FD_LIMIT}: fleet's queues would wedge it"
    );

    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let worker = start_worker(&ns, "w-count", "zone=q", 1, &[], &[]).await?;
    let group = "protocol=builtin,zone=q";
    let prefix = format!("{}.", ns.name);
    let queues = wait_for("the group's queues", Duration::from_secs(30), || async {
        let out = rabbit
            .ctl(&["list_queues", "--no-table-headers", "-q", "name"])
            .await
            .ok()?;
        let mine: Vec<String> = out
            .lines()
            .map(str::trim)
            .filter(|q| q.starts_with(&prefix))
            .map(str::to_string)
            .collect();
        let of_group = mine.iter().filter(|q| q.contains(group)).count();
        (of_group >= 4).then_some(mine)
    })
    .await?;
    let (per_worker, rest): (Vec<&String>, Vec<&String>) =
        queues.iter().partition(|q| q.contains(".lock.worker."));
    let (per_group, per_ns): (Vec<&String>, Vec<&String>) =
        rest.into_iter().partition(|q| q.contains(group));
    println!(
        "queues: {} per namespace {per_ns:?}, {} per group {per_group:?}, {} per worker",
        per_ns.len(),
        per_group.len(),
        per_worker.len()
    );
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scaling.md"),
    )?;
    assert_eq!(
        per_ns.len(),
        documented(&docs, "queues-per-namespace")?,
        "per namespace: {per_ns:?}"
    );
    assert_eq!(
        per_group.len(),
        documented(&docs, "queues-per-group")?,
        "per group: {per_group:?}"
    );
    assert_eq!(per_worker.len(), 1, "per worker: {per_worker:?}");
    assert_eq!(
        per_ns
            .iter()
            .filter(|q| q.starts_with(&format!("{prefix}hold.")))
            .count(),
        fleet::broker::delay::TIERS as usize,
        "one queue per delay tier"
    );

    worker.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[test]
fn the_status_parser_reads_the_limit() {
    let status = "Totals\n\n\x1b[1mFile Descriptors\x1b[0m\n\nTotal: 2, limit: 927\nSockets: 0, limit: 832\n";
    assert_eq!(fd_limit(status), Some(927));
}
