//! Loopback ports for the services tests start.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// Ports this process has handed out: never handed out again, so two
/// services started at once by one test binary never share a port (or a
/// directory named after it) even while one of them is stopped.
static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A free loopback port below the kernel's ephemeral range (from 10000 up),
/// picked at random so that concurrent test processes rarely try the same
/// one, and never one a client socket's ephemeral port can take before the
/// service binds it.
pub(crate) fn free_port_below_ephemeral() -> u16 {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    assert!(
        low > 11_000,
        "the ephemeral port range starts at {low}: the test services need free ports below it"
    );
    let span = u128::from(low - 10_000);
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    for _ in 0..200 {
        let port = 10_000 + (uuid::Uuid::new_v4().as_u128() % span) as u16;
        if !taken.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            taken.insert(port);
            return port;
        }
    }
    panic!("no free loopback port between 10000 and {low}");
}
