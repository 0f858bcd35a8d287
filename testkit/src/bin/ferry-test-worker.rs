//! A worker process for chaos tests: it claims from a queue and, in `hang`
//! mode, prints `claimed <run_id> <generation>` and then works forever, so the
//! test can SIGKILL it mid-job. In `run` mode it completes every job.
//!
//! Environment: `FERRY_URL`, `FERRY_QUEUE`, `FERRY_LEASE_MS`, `FERRY_MODE`.
#![allow(clippy::print_stdout)]

use std::io::Write;
use std::time::Duration;

use ferry::worker::{Worker, WorkerConfig};
use ferry::Ferry;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("FERRY_URL")?;
    let queue = std::env::var("FERRY_QUEUE").unwrap_or_else(|_| "default".into());
    let lease_ms: u64 = std::env::var("FERRY_LEASE_MS")
        .unwrap_or_else(|_| "30000".into())
        .parse()?;
    let hang = std::env::var("FERRY_MODE").as_deref() == Ok("hang");
    let ferry = Ferry::builder(url).connect().await?;
    let config = WorkerConfig {
        queues: vec![queue],
        concurrency: 1,
        batch: 1,
        lease: Duration::from_millis(lease_ms),
        owner: format!("child-{}", std::process::id()),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(ferry, config, move |job: ferry::Claimed, _ctx| async move {
        println!("claimed {} {}", job.lease.run_id, job.lease.generation);
        std::io::stdout().flush().ok();
        if hang {
            std::future::pending::<()>().await;
        }
        Ok(serde_json::json!({"worker": std::process::id()}))
    });
    worker.run(std::future::pending()).await?;
    Ok(())
}
