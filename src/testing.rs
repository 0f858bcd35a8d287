//! Helpers for tests of Ferry and of services built on it: a brand-new
//! PostgreSQL schema or SQLite file per test, so tests run in parallel against
//! real databases, and a real Kafka-protocol broker (Tansu) per test. PostgreSQL must be reachable; when it is not, the helper
//! fails with a message naming what is missing (tests never skip).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions as _;

use crate::error::{Error, Result};
use crate::store::Engine;

/// The test PostgreSQL: `DATABASE_URL`, or the local server.
pub fn postgres_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A URL to a new, empty database of `engine`: a fresh schema (selected by
/// `search_path`) in the test PostgreSQL, or a fresh SQLite file under the
/// temp dir. Schemas left by earlier runs of other processes are dropped.
pub async fn fresh_database_url(engine: Engine) -> Result<String> {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    match engine {
        Engine::Sqlite => {
            let dir = std::env::temp_dir().join("ferry-tests");
            std::fs::create_dir_all(&dir).map_err(|e| Error::Config(format!("temp dir: {e}")))?;
            let path = dir.join(format!("t{pid}_{n}_{}.db", uuid::Uuid::now_v7().simple()));
            Ok(format!("sqlite://{}", path.display()))
        }
        Engine::Postgres => {
            let base = postgres_url();
            let born = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let schema = format!("ferry_t_{born}_{pid}_{n}");
            let opts: PgConnectOptions = base.parse().map_err(|e| Error::Config(format!("DATABASE_URL: {e}")))?;
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(opts.disable_statement_logging())
                .await
                .map_err(|e| {
                    Error::Config(format!(
                        "PostgreSQL is required and unreachable at {base} ({e}); start it or set DATABASE_URL"
                    ))
                })?;
            if n == 0 {
                drop_stale_schemas(&admin, born).await;
            }
            sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&admin).await?;
            admin.close().await;
            let sep = if base.contains('?') { '&' } else { '?' };
            Ok(format!("{base}{sep}options=-csearch_path%3D{schema}"))
        }
    }
}

/// Drops `ferry_t_*` schemas created more than a day ago (earlier test
/// runs); concurrent test processes keep theirs.
async fn drop_stale_schemas(admin: &sqlx::PgPool, now: u64) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'ferry\\_t\\_%'")
            .fetch_all(admin)
            .await
            .unwrap_or_default();
    for s in names {
        let born: u64 = s.split('_').nth(2).and_then(|b| b.parse().ok()).unwrap_or(0);
        if born + 24 * 3600 < now {
            let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {s} CASCADE"))
                .execute(admin)
                .await;
        }
    }
}

/// The `tansu` binary: `FERRY_TANSU`, or `tansu` on the PATH.
pub fn tansu() -> String {
    std::env::var("FERRY_TANSU").unwrap_or_else(|_| "tansu".into())
}

/// A Tansu broker process on a free 127.0.0.1 port with its own sqlite://
/// storage (so data survives [`Broker::stop`] and [`Broker::restart`]).
/// Killed on drop.
pub struct Broker {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    storage: &'static str,
}

impl Broker {
    /// Starts one on sqlite:// storage (correct offsets, data kept across a
    /// restart); panics naming what is missing when `tansu` is not installed.
    pub fn start() -> Broker {
        Self::start_on("sqlite://tansu.db")
    }

    /// Starts one on memory:// storage: fastest, for benchmarks, but its
    /// watermarks are wrong and a restart loses everything.
    pub fn start_memory() -> Broker {
        Self::start_on("memory://tansu/")
    }

    fn start_on(storage: &'static str) -> Broker {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("ferry-tansu-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = Broker {
            child: None,
            port,
            dir,
            storage,
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new(tansu())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
            ])
            // Tansu resolves the sqlite path against its working directory.
            .arg(self.storage)
            .current_dir(&self.dir)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("the Kafka-protocol broker `tansu` is required ({e}); run scripts/install-broker")
            });
        self.child = Some(child);
        // Wait until it accepts connections (it answers in about 0.2 s).
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not start listening on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `bootstrap.servers` for it.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic (Tansu does not create topics on demand).
    pub fn create_topic(&self, name: &str, partitions: u32) {
        let status = Command::new(tansu())
            .args([
                "topic",
                "create",
                name,
                "--partitions",
                &partitions.to_string(),
                "--broker",
            ])
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .stdout(Stdio::null())
            .status()
            .expect("tansu topic create");
        assert!(status.success(), "creating topic {name} failed");
    }

    /// SIGTERM and wait: the broker is down until [`Broker::restart`].
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
