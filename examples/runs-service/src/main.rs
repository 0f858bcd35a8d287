//! `runs-service`: reads its configuration from the environment and serves.
//! `DATABASE_URL`, `LISTEN` (default 0.0.0.0:8080), `RUNS_TOKENS`
//! (`token=tenant,…`), `MAX_QUEUED_PER_TENANT` (default 1000). A value it
//! cannot use stops it with the variable's name (`config`).

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).try_init();
    let var = |name: &str| std::env::var(name).ok();
    let url = var("DATABASE_URL").ok_or("DATABASE_URL is not set")?;
    let addr = runs_service::parse_listen(&var("LISTEN").unwrap_or_else(|| "0.0.0.0:8080".into()))?;
    let config = runs_service::Config::from_env(var)?;
    let ferry = ferry::Ferry::builder(url).connect().await?;
    runs_service::serve(ferry, config, addr, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
