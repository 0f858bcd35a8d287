//! A PostgreSQL cluster a test owns, so it can stop the database without
//! disturbing anyone else's tests on the shared one.
//!
//! [`PgCluster::start`] runs Debian's `initdb` (trust auth, superuser
//! `postgres`) into a fresh temporary directory and starts `postgres` on a
//! free 127.0.0.1 port with its unix socket in that directory. The port is
//! below the kernel's ephemeral range, so while the cluster is stopped no
//! client's own outgoing connection can take it (a connect to a closed local
//! port in that range can connect to itself) and the restart finds it free.
//! As root, whom PostgreSQL refuses, the cluster runs as the `postgres` user.
//!
//! [`PgCluster::stop`] is a fast shutdown (SIGINT, what `pg_ctl stop -m
//! fast` sends) that fails the test if it does not finish within a minute,
//! [`PgCluster::restart`] starts it again on the same port and data. The postmaster runs in the foreground under the testkit's watchdog
//! rather than daemonized by `pg_ctl`, so no cluster outlives its test binary
//! (an immediate shutdown when dropped, SIGKILL when the test process dies);
//! the directory is removed on drop. Readiness is the postmaster's own
//! `ready` status in `postmaster.pid`, the one `pg_ctl -w` waits for.
//!
//! When the server binaries are missing, starting fails with a message naming
//! them; a test never passes without its database.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::ports::free_port_below_ephemeral;
use crate::watchdog::{Signal, Watchdog};

/// How long a start may take before the harness gives up and quotes the log.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// How long a fast shutdown may take before the harness fails the test.
const STOP_WITHIN: Duration = Duration::from_secs(60);

/// One PostgreSQL cluster owned by a test: stopped and removed on drop.
pub struct PgCluster {
    port: u16,
    /// The temporary directory: `data/`, the socket, `postgres.log`.
    dir: PathBuf,
    bin: PathBuf,
    /// The `postgres` user's uid and gid when the test runs as root.
    run_as: Option<(u32, u32)>,
    proc: Option<Watchdog>,
}

impl PgCluster {
    /// Creates a cluster and starts it; returns once it accepts connections.
    /// Panics naming what is missing (the server binaries, the `postgres`
    /// user when running as root) or quoting the server's log.
    pub fn start() -> PgCluster {
        let bin = server_bin_dir();
        let run_as = if effective_uid() == Some(0) {
            Some(system_user("postgres").unwrap_or_else(|| {
                panic!("PostgreSQL refuses to run as root and there is no `postgres` user to run the test cluster as: install Debian's postgresql (scripts/setup-postgres) or run the tests as another user")
            }))
        } else {
            None
        };
        let port = free_port_below_ephemeral();
        let dir = std::env::temp_dir().join(format!("ferry-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cluster temp dir");
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown the cluster dir to postgres");
        }
        let mut c = PgCluster {
            port,
            dir,
            bin,
            run_as,
            proc: None,
        };
        c.init();
        c.spawn();
        c
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Fast shutdown (SIGINT: open transactions roll back, sessions are
    /// ended, a checkpoint is written) and waits until the postmaster
    /// exited: the database is down until [`PgCluster::restart`]. Panics
    /// quoting the log when the shutdown does not finish within a minute
    /// (a client PostgreSQL waits for, such as a replication client that
    /// never confirms the end of the WAL, holds it up).
    pub fn stop(&mut self) {
        let Some(w) = self.proc.as_mut() else { return };
        w.send(Signal::Int);
        let deadline = Instant::now() + STOP_WITHIN;
        while w.server_alive() {
            if Instant::now() > deadline {
                panic!(
                    "PostgreSQL's fast shutdown on port {} did not finish within {STOP_WITHIN:?} (it waits, among others, for every replication client to confirm the end of the WAL); its log:\n{}",
                    self.port,
                    self.log_tail(20)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(w) = self.proc.take() {
            w.reap();
        }
    }

    /// Immediate shutdown (SIGQUIT, what `pg_ctl stop -m immediate` sends:
    /// every process exits at once, no checkpoint, crash recovery at the
    /// next start) and waits until the postmaster exited.
    pub fn crash(&mut self) {
        let Some(mut w) = self.proc.take() else { return };
        w.send(Signal::Quit);
        w.reap();
    }

    /// Starts it again on the same port and data (stopping it first if it
    /// runs) and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// A synchronous streaming standby of this cluster, on a port and in a
    /// directory of its own: `pg_basebackup -R` (WAL streamed, a fast
    /// checkpoint) from this cluster, started, and named in this cluster's
    /// `synchronous_standby_names`, so a commit here returns once the
    /// standby has flushed it. Returns once the standby accepts
    /// connections. [`PgCluster::promote`] makes it a primary.
    pub async fn start_standby(&self) -> PgCluster {
        let port = free_port_below_ephemeral();
        let dir = std::env::temp_dir().join(format!("ferry-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("standby temp dir");
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown the standby dir to postgres");
        }
        let mut standby = PgCluster {
            port,
            dir,
            bin: self.bin.clone(),
            run_as: self.run_as,
            proc: None,
        };
        let out = standby
            .command("pg_basebackup")
            .arg("-D")
            .arg(standby.data())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"])
            .output()
            .unwrap_or_else(|e| panic!("running pg_basebackup: {e}"));
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The standby's name on the primary: its walreceiver's
        // application_name.
        let auto = standby.data().join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&auto).expect("postgresql.auto.conf");
        conf = conf.replace(
            "primary_conninfo = '",
            "primary_conninfo = 'application_name=ferry_standby ",
        );
        std::fs::write(&auto, conf).expect("write postgresql.auto.conf");
        tokio::task::block_in_place(|| standby.spawn());
        self.configure(&[("synchronous_standby_names", "ferry_standby")]).await;
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url())
            .await
            .expect("connect to the primary");
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let sync: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'ferry_standby' AND state = 'streaming'",
            )
            .fetch_optional(&mut c)
            .await
            .expect("pg_stat_replication");
            if sync.as_deref() == Some("sync") {
                return standby;
            }
            assert!(
                Instant::now() < deadline,
                "the standby on port {port} never became a synchronous standby; its log:\n{}",
                standby.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Promotes this standby (`pg_promote`, which waits until it is done):
    /// it accepts writes once this returns.
    pub async fn promote(&self) {
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url())
            .await
            .expect("connect to the standby");
        let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut c)
            .await
            .expect("pg_promote");
        assert!(promoted, "the standby was not promoted within 60 s");
    }

    /// Sets server settings with `ALTER SYSTEM` and reloads the
    /// configuration (settings a reload applies, such as
    /// `max_slot_wal_keep_size`, `wal_sender_timeout` or
    /// `logical_decoding_work_mem`); they survive [`PgCluster::restart`].
    pub async fn configure(&self, settings: &[(&str, &str)]) {
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url())
            .await
            .expect("connect to the test cluster");
        for (name, value) in settings {
            sqlx::raw_sql(&format!("ALTER SYSTEM SET {name} = '{value}'"))
                .execute(&mut c)
                .await
                .unwrap_or_else(|e| panic!("ALTER SYSTEM SET {name} = '{value}': {e}"));
        }
        sqlx::raw_sql("SELECT pg_reload_conf()")
            .execute(&mut c)
            .await
            .expect("pg_reload_conf");
    }

    /// Writes WAL (a filler table's rows, a segment switch, a checkpoint)
    /// until PostgreSQL invalidates replication slot `slot` (`wal_status =
    /// 'lost'`); needs a small `max_slot_wal_keep_size` (see
    /// [`PgCluster::configure`]). Panics if the slot is still not lost
    /// after 50 segments.
    pub async fn invalidate_slot(&self, slot: &str) {
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url())
            .await
            .expect("connect to the test cluster");
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS ferry_testkit_filler (n int)")
            .execute(&mut c)
            .await
            .expect("filler table");
        for _ in 0..50 {
            let status: Option<String> =
                sqlx::query_scalar("SELECT wal_status::text FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(slot)
                    .fetch_one(&mut c)
                    .await
                    .unwrap_or_else(|e| panic!("slot {slot}: {e}"));
            if status.as_deref() == Some("lost") {
                return;
            }
            sqlx::raw_sql(
                "INSERT INTO ferry_testkit_filler SELECT generate_series(1, 1000); SELECT pg_switch_wal(); CHECKPOINT",
            )
            .execute(&mut c)
            .await
            .expect("write WAL and checkpoint");
        }
        panic!("slot {slot} was not invalidated after 50 WAL segments: is max_slot_wal_keep_size small?");
    }

    /// The end of the server's log (for assertion messages).
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(self.bin.join(program));
        self.as_owner(&mut c);
        c
    }

    /// Runs `c` in the cluster's directory, as its owner when that is not us.
    fn as_owner(&self, c: &mut Command) {
        c.current_dir(&self.dir);
        if let Some((uid, gid)) = self.run_as {
            c.uid(uid).gid(gid).env("HOME", &self.dir);
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn init(&self) {
        let out = self
            .command("initdb")
            .arg("-D")
            .arg(self.data())
            .args([
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.bin.join("initdb").display()));
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The postmaster under the watchdog; returns once it is ready.
    fn spawn(&mut self) {
        let mut command = Watchdog::command(&self.dir.join("postgres.log"));
        command
            .arg(self.bin.join("postgres"))
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "max_connections=200",
                // The relay's WAL capture needs logical decoding.
                "-c",
                "wal_level=logical",
                "-c",
                "max_replication_slots=8",
                "-c",
                "max_wal_senders=8",
            ]);
        self.as_owner(&mut command);
        self.proc = Some(Watchdog::spawn(command));
        self.wait_ready();
    }

    /// Polls the postmaster's status line in `postmaster.pid` until it says
    /// `ready` (what `pg_ctl -w` waits for); panics with the log if the
    /// server exits or the deadline passes.
    fn wait_ready(&self) {
        let deadline = Instant::now() + READY_WITHIN;
        let pid_file = self.data().join("postmaster.pid");
        loop {
            let status = std::fs::read_to_string(&pid_file).unwrap_or_default();
            // Line 8 is the status (PostgreSQL 10+); the file is rewritten
            // in place, so a partial read just polls again.
            // A hot standby says `standby` once it accepts connections.
            if matches!(status.lines().nth(7).map(str::trim), Some("ready" | "standby")) {
                return;
            }
            if !self.proc.as_ref().is_some_and(Watchdog::server_alive) {
                panic!(
                    "PostgreSQL exited during startup on port {}; its log:\n{}",
                    self.port,
                    self.log_tail(40)
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "PostgreSQL was not ready on port {} within {READY_WITHIN:?}; its log:\n{}",
                    self.port,
                    self.log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PgCluster {
    /// An immediate shutdown, also of a server stuck in a fast shutdown
    /// [`PgCluster::stop`] gave up on; then the directory is removed.
    fn drop(&mut self) {
        if let Some(mut w) = self.proc.take() {
            w.send(Signal::Quit);
            w.send_directly(Signal::Quit);
            w.reap();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where `initdb` and `postgres` are: `FERRY_PG_BIN`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout), else `PATH`.
fn server_bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("FERRY_PG_BIN") {
        return PathBuf::from(dir);
    }
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .max_by_key(|(v, _)| *v)
        .map(|(_, bin)| bin);
    let on_path = || {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .find(|d| d.join("initdb").exists() && d.join("postgres").exists())
    };
    debian.or_else(on_path).unwrap_or_else(|| {
        panic!("PostgreSQL's server binaries (initdb, postgres) are required for a test cluster and are in neither /usr/lib/postgresql/<version>/bin nor PATH: install Debian's postgresql (scripts/setup-postgres) or set FERRY_PG_BIN")
    })
}

/// This process's effective uid, from `/proc/self/status`.
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// A user's uid and gid from `/etc/passwd`.
fn system_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string(Path::new("/etc/passwd")).ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 3 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_stops_and_restarts_on_its_port_and_data() {
        let mut pg = PgCluster::start();
        let url = pg.url();
        let count = || async {
            let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await?;
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM kept")
                .fetch_one(&mut c)
                .await
        };
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
        sqlx::query("CREATE TABLE kept AS SELECT 1 AS one")
            .execute(&mut c)
            .await
            .unwrap();
        tokio::task::block_in_place(|| pg.stop());
        assert!(
            sqlx::query("SELECT 1").execute(&mut c).await.is_err(),
            "the fast shutdown ended the open session"
        );
        assert!(count().await.is_err(), "nothing answers while stopped");
        tokio::task::block_in_place(|| pg.restart());
        assert_eq!(count().await.unwrap(), 1, "the data survived the restart");
        let dir = pg.dir.clone();
        drop(pg);
        assert!(!dir.exists(), "the cluster's directory is removed on drop");
    }

    #[test]
    fn the_postgres_user_is_read_from_passwd() {
        assert_eq!(system_user("root"), Some((0, 0)));
        assert_eq!(system_user("no-such-user-here"), None);
    }
}
