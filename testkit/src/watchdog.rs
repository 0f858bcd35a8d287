//! The `sh` watchdog that holds every server a test starts (the Kafka broker,
//! an owned PostgreSQL cluster), so none outlives its test binary.
//!
//! The server runs as the watchdog's child, its output appended to a log
//! file. The watchdog reads signal names from its standard input, a pipe
//! from the test process: a name signals the server, waits until it exited
//! and answers `exited`. When the test process ends in any way (a panic, an
//! abort, SIGKILL), the pipe closes and the watchdog SIGKILLs the server;
//! with `FERRY_WATCHDOG_OWNER` (a pid) in its environment it first waits,
//! while that process and the server run: a Kafka broker of the test run's
//! shared pool (`kafka.rs`) outlives the test process that started it, and
//! no more than the run (the pool's owner, `scripts/run-tests.py`).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The watchdog script: the server is `"$@"`, its log `$FERRY_WATCHDOG_LOG`.
const SCRIPT: &str = r#"
"$@" >>"$FERRY_WATCHDOG_LOG" 2>&1 </dev/null &
pid=$!
echo "$pid"
while read -r sig; do
  case "$sig" in
    TERM|KILL|INT|QUIT) kill -"$sig" "$pid" 2>/dev/null; wait "$pid"; echo exited; exit 0 ;;
  esac
done
if [ -n "$FERRY_WATCHDOG_OWNER" ]; then
  # A poll, not a synchronisation: the server is killed within a second of
  # its owner's end (each `sleep` also reaps the server once it exited).
  while kill -0 "$FERRY_WATCHDOG_OWNER" 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 1; done
fi
kill -KILL "$pid" 2>/dev/null
"#;

/// A signal the watchdog passes to its server.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Signal {
    /// SIGTERM: Kafka's controlled shutdown.
    Term,
    /// SIGKILL: a crash.
    Kill,
    /// SIGINT: PostgreSQL's fast shutdown (`pg_ctl stop -m fast`).
    Int,
    /// SIGQUIT: PostgreSQL's immediate shutdown (`pg_ctl stop -m immediate`).
    Quit,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Signal::Term => "TERM",
            Signal::Kill => "KILL",
            Signal::Int => "INT",
            Signal::Quit => "QUIT",
        }
    }
}

/// One server held by a watchdog.
pub(crate) struct Watchdog {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The server's pid (the watchdog's child).
    server_pid: u32,
}

impl Watchdog {
    /// A `sh` command that will run the server appended to it with
    /// [`Command::arg`], its output appended to `log`. The caller may add
    /// environment or a user before [`Watchdog::spawn`].
    pub(crate) fn command(log: &Path) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c").arg(SCRIPT).arg("sh").env("FERRY_WATCHDOG_LOG", log);
        c
    }

    /// Spawns `command` (from [`Watchdog::command`]) and returns once the
    /// server process exists; whether it is ready is the caller's check.
    pub(crate) fn spawn(mut command: Command) -> Watchdog {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("sh is required to supervise test servers");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("the watchdog reports the server pid");
        let server_pid = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the watchdog reported no server pid: {line:?}"));
        Watchdog {
            child,
            stdin,
            stdout,
            server_pid,
        }
    }

    /// Sends `signal` to the server and waits until it exited.
    pub(crate) fn stop(mut self, signal: Signal) {
        self.send(signal);
        self.reap();
    }

    /// Has the watchdog send `signal` to the server; [`Watchdog::reap`]
    /// once it exited.
    pub(crate) fn send(&mut self, signal: Signal) {
        let _ = writeln!(self.stdin, "{}", signal.name());
    }

    /// Sends `signal` to the server from this process, for a server that
    /// did not exit on the signal [`Watchdog::send`] sent (the watchdog
    /// waits for it and reads nothing more meanwhile).
    pub(crate) fn send_directly(&self, signal: Signal) {
        let _ = std::process::Command::new("kill")
            .arg(format!("-{}", signal.name()))
            .arg(self.server_pid.to_string())
            .status();
    }

    /// Waits until the server exited and the watchdog with it.
    pub(crate) fn reap(mut self) {
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        let _ = self.child.wait();
    }

    /// Whether the server process still runs (a zombie counts as exited).
    pub(crate) fn server_alive(&self) -> bool {
        pid_alive(self.server_pid)
    }

    /// The server's pid.
    pub(crate) fn server_pid(&self) -> u32 {
        self.server_pid
    }
}

/// Whether process `pid` runs (a zombie counts as exited).
pub(crate) fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Field 3 is the state; Z is a zombie (exited, not yet reaped).
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .map(|r| !r.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Sends `signal` to `pid`, a server this process did not start (a broker
/// taken from the run's shared pool), and waits until it exited (its
/// watchdog, not this process, reaps it).
pub(crate) fn stop_pid(pid: u32, signal: Signal) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{}", signal.name()))
        .arg(pid.to_string())
        .status();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pid_alive(pid) {
        if std::time::Instant::now() > deadline {
            // A controlled shutdown that hangs ends as a crash.
            let _ = std::process::Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .status();
        }
        // A poll of /proc, not a synchronisation: the loop ends on the exit.
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
