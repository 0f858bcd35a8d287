//! Quick start on embedded defaults: accepts runs idempotently on a SQLite
//! file (some retried, one reusing a key with another body), works them with
//! a worker, and prints what happened.
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry::worker::{Worker, WorkerConfig};
use ferry::{Claimed, Ferry, NewRun};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("ferry-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite://{}", dir.join("ferry.db").display());
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;

    let (mut accepted, mut replays, mut conflicts) = (0, 0, 0);
    for i in 0..20 {
        let run = NewRun::new(
            "acme",
            "charge",
            format!("order-{i}"),
            json!({"amount": 100 + i, "currency": "EUR"}),
        );
        // Every fourth request is a client retry of the same POST.
        let tries = if i % 4 == 0 { 2 } else { 1 };
        for _ in 0..tries {
            if ferry.create_run_idempotent(run.clone()).await?.replay {
                replays += 1;
            } else {
                accepted += 1;
            }
        }
    }
    let reused = NewRun::new("acme", "charge", "order-0", json!({"amount": 999, "currency": "EUR"}));
    match ferry.create_run_idempotent(reused).await {
        Err(e) if e.code() == "idempotency_conflict" => conflicts += 1,
        other => return Err(format!("expected a conflict, got {other:?}").into()),
    }

    let done = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let d = done.clone();
    let worker = Worker::new(
        ferry.clone(),
        WorkerConfig {
            poll_interval: Duration::from_millis(50),
            ..WorkerConfig::default()
        },
        move |job: Claimed, _ctx| {
            let (d, tx) = (d.clone(), tx.clone());
            async move {
                if d.fetch_add(1, Ordering::SeqCst) + 1 == 20 {
                    let _ = tx.try_send(());
                }
                Ok(json!({"charged": job.request["amount"]}))
            }
        },
    );
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    rx.recv().await;
    let _ = stop.send(());
    running.await??;

    println!("database        {url}");
    println!("runs accepted   {accepted}");
    println!("replays         {replays} (retried POSTs answered with the original run)");
    println!("conflicts       {conflicts} (key reused with another body: idempotency_conflict)");
    println!("jobs completed  {}", stats.completed.load(Ordering::SeqCst));
    if stats.completed.load(Ordering::SeqCst) != 20 {
        return Err("not every run completed".into());
    }
    Ok(())
}
