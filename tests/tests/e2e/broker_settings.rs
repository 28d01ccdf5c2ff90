//! The broker settings fleet ships (`ops/rabbitmq/advanced.config`, mounted by
//! docker-compose.yml, installed by ops/services.sh, given to ops/cluster.sh's nodes) take
//! effect on a real node: the dead-letter worker re-sends what its target did not confirm after
//! 5 s, not RabbitMQ's 180 s — the wait that stranded delayed tasks and retries after the node
//! leading `<ns>.delayed` died (issue 37 item 1).

use std::path::Path;

use fleet_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_advanced_config_shortens_the_dead_letter_resend() -> anyhow::Result<()> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/rabbitmq/advanced.config");
    let advanced = std::fs::read_to_string(&file)?;
    let rabbit = PrivateRabbit::start("", &advanced).await?;
    let got = rabbit
        .ctl(&[
            "eval",
            "application:get_env(rabbit, dead_letter_worker_publisher_confirm_timeout).",
        ])
        .await?;
    println!(
        "dead_letter_worker_publisher_confirm_timeout on a node with the shipped config: {}",
        got.trim()
    );
    assert_eq!(got.trim(), "{ok,5000}");
    drop(rabbit);
    Ok(())
}
