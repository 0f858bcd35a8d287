//! `runs-service`: reads its configuration from the environment and serves.
//! `DATABASE_URL`, `LISTEN` (default 0.0.0.0:8080), `RUNS_TOKENS`
//! (`token=tenant,…`), `MAX_QUEUED_PER_TENANT` (default 1000).

use std::net::SocketAddr;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).try_init();
    let url = std::env::var("DATABASE_URL")?;
    let addr: SocketAddr = std::env::var("LISTEN")
        .unwrap_or_else(|_| "0.0.0.0:8080".into())
        .parse()?;
    let config = runs_service::Config {
        tokens: runs_service::Config::parse_tokens(&std::env::var("RUNS_TOKENS").unwrap_or_default()),
        max_queued_per_tenant: std::env::var("MAX_QUEUED_PER_TENANT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
        retry_after_secs: 2,
        with_worker: true,
    };
    let ferry = ferry::Ferry::builder(url).connect().await?;
    runs_service::serve(ferry, config, addr, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
