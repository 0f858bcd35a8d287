//! A real TCP fault proxy between a test's client and its services:
//! Shopify's toxiproxy (`toxiproxy-server`, built once by
//! `scripts/install-toxiproxy` from the Go module proxy into
//! `~/.cache/ferry/go-bin`, or `FERRY_TOXIPROXY`). Each [`Toxiproxy`] runs a
//! server of its own on a free loopback port under the testkit's watchdog
//! (so none outlives its test binary); each [`Proxy`] listens on a free port
//! and forwards to an upstream port, with faults ("toxics") added and
//! removed while connections are open: a black hole (packets dropped, no
//! reset: a half-open connection), latency, a reset of every connection.
//!
//! The server is driven over its HTTP API with a plain HTTP/1.1 request per
//! call (no client library); a refused call fails the test with the
//! server's answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::ports::free_port_below_ephemeral;
use crate::watchdog::{Signal, Watchdog};

/// One toxiproxy server: stopped and its directory removed on drop.
pub struct Toxiproxy {
    api_port: u16,
    dir: PathBuf,
    proc: Option<Watchdog>,
}

/// One proxy of a [`Toxiproxy`]: `127.0.0.1:<port>` forwards to its upstream.
pub struct Proxy {
    name: String,
    port: u16,
    api_port: u16,
}

/// Where `toxiproxy-server` is: `FERRY_TOXIPROXY`, else
/// `~/.cache/ferry/go-bin/toxiproxy-server`.
fn server_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("FERRY_TOXIPROXY") {
        return PathBuf::from(bin);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/ferry/go-bin/toxiproxy-server")
}

impl Toxiproxy {
    /// Starts a server and waits until its API answers. Panics naming
    /// `scripts/install-toxiproxy` when the binary is missing.
    pub fn start() -> Toxiproxy {
        let bin = server_bin();
        assert!(
            bin.exists(),
            "toxiproxy-server is required and is not at {}: run scripts/install-toxiproxy (or set FERRY_TOXIPROXY)",
            bin.display()
        );
        let api_port = free_port_below_ephemeral();
        let dir = std::env::temp_dir().join(format!("ferry-toxiproxy-{}-{api_port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("toxiproxy temp dir");
        let mut command = Watchdog::command(&dir.join("toxiproxy.log"));
        command
            .arg(&bin)
            .args(["-host", "127.0.0.1", "-port", &api_port.to_string()]);
        let t = Toxiproxy {
            api_port,
            dir,
            proc: Some(Watchdog::spawn(command)),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while call(api_port, "GET", "/version", None).is_err() {
            assert!(
                t.proc.as_ref().is_some_and(Watchdog::server_alive),
                "toxiproxy-server exited at start; its log:\n{}",
                t.log()
            );
            assert!(
                Instant::now() < deadline,
                "toxiproxy-server's API never answered; its log:\n{}",
                t.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        t
    }

    /// A proxy named `name` on a free loopback port, forwarding to
    /// `127.0.0.1:<upstream>` (which need not listen yet).
    pub fn proxy(&self, name: &str, upstream: u16) -> Proxy {
        let port = free_port_below_ephemeral();
        let body = serde_json::json!({
            "name": name,
            "listen": format!("127.0.0.1:{port}"),
            "upstream": format!("127.0.0.1:{upstream}"),
            "enabled": true,
        });
        expect(self.api_port, "POST", "/proxies", Some(&body));
        Proxy {
            name: name.to_owned(),
            port,
            api_port: self.api_port,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("toxiproxy.log")).unwrap_or_default()
    }
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        if let Some(w) = self.proc.take() {
            w.stop(Signal::Kill);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Proxy {
    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Points the proxy at `127.0.0.1:<upstream>` (for a service whose
    /// port is known only after the proxy's, such as a broker that
    /// advertises the proxy's port).
    pub fn set_upstream(&self, upstream: u16) {
        let body = serde_json::json!({ "upstream": format!("127.0.0.1:{upstream}") });
        expect(self.api_port, "POST", &format!("/proxies/{}", self.name), Some(&body));
    }

    /// Adds toxic `toxic` of `kind` (`timeout`, `latency`, `reset_peer`,
    /// ...) on both directions, with its `attributes`.
    pub fn add(&self, toxic: &str, kind: &str, attributes: serde_json::Value) {
        for stream in ["downstream", "upstream"] {
            let body = serde_json::json!({
                "name": format!("{toxic}_{stream}"),
                "type": kind,
                "stream": stream,
                "toxicity": 1.0,
                "attributes": attributes,
            });
            expect(
                self.api_port,
                "POST",
                &format!("/proxies/{}/toxics", self.name),
                Some(&body),
            );
        }
    }

    /// Removes toxic `toxic` (both directions).
    pub fn remove(&self, toxic: &str) {
        for stream in ["downstream", "upstream"] {
            expect(
                self.api_port,
                "DELETE",
                &format!("/proxies/{}/toxics/{toxic}_{stream}", self.name),
                None,
            );
        }
    }

    /// Packets dropped both ways, connections left open (new ones too): a
    /// half-open network, until [`Proxy::remove`]`("blackhole")`.
    pub fn blackhole(&self) {
        self.add("blackhole", "timeout", serde_json::json!({ "timeout": 0 }));
    }

    /// `ms` of latency each way (and `jitter` ms more or less), until
    /// [`Proxy::remove`]`("latency")`.
    pub fn latency(&self, ms: u64, jitter: u64) {
        self.add(
            "latency",
            "latency",
            serde_json::json!({ "latency": ms, "jitter": jitter }),
        );
    }

    /// Resets every open connection at once (TCP RST), then accepts new
    /// ones again.
    pub fn reset_connections(&self) {
        self.add("reset", "reset_peer", serde_json::json!({ "timeout": 0 }));
        self.remove("reset");
    }
}

/// One API call; the status code and body, or the connection's error.
fn call(port: u16, method: &str, path: &str, body: Option<&serde_json::Value>) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let body = body.map(ToString::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {answer:?}")))?;
    Ok((status, answer))
}

/// [`call`], failing the test unless the API answered 2xx.
fn expect(port: u16, method: &str, path: &str, body: Option<&serde_json::Value>) {
    match call(port, method, path, body) {
        Ok((status, _)) if (200..300).contains(&status) => {}
        Ok((_, answer)) => panic!("toxiproxy {method} {path}: {answer}"),
        Err(e) => panic!("toxiproxy {method} {path}: {e}"),
    }
}
