//! A real Kafka-protocol broker per test: Tansu 0.6.0 (installed by
//! `scripts/install-broker`) on a free 127.0.0.1 port with its own sqlite://
//! storage, so it keeps data across a stop and restart. A test that needs it
//! fails, naming what is missing, when the binary is not installed.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Broker {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

fn tansu() -> String {
    std::env::var("FERRY_TANSU").unwrap_or_else(|_| "tansu".into())
}

impl Broker {
    pub fn start() -> Broker {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("ferry-tansu-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = Broker {
            child: None,
            port,
            dir,
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new(tansu())
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url, "--storage-engine"])
            // Tansu resolves the sqlite path against its working directory.
            .arg("sqlite://tansu.db")
            .current_dir(&self.dir)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("the Kafka-protocol broker `tansu` is required ({e}); run scripts/install-broker"));
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

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

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
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }

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
