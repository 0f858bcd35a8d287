#!/usr/bin/env python3
"""Runs every test of the workspace, built once, test binaries in parallel.

What `cargo test --workspace` runs, the same tests and the same binaries,
but not one binary after another: cargo test waits for each binary before
the next, so the relay's integration suite alone (a hundred tests that
mostly wait on brokers, clusters and timeouts, two at a time) set the pace
of the whole command. Here:

  - `cargo test --workspace --no-run` builds every test binary once (the
    debug binaries the tests spawn, `ferry-relay` among them, come from the
    same build);
  - each binary lists its tests (`--list`); one with more than SHARD_SIZE
    tests is split into shards by name (`--exact` with the names), each a
    process of its own, so its slow tests run side by side;
  - up to JOBS processes (FERRY_TEST_JOBS, default 3) run at once, the
    longest expected first, each in its package's directory as cargo test
    runs it, with its own log;
  - the doc tests run as one more job (`cargo test --workspace --doc`).

The run shares its Kafka brokers between its test processes: a broker a
test dropped, reset (no topic, no group), is parked in the run's pool
(FERRY_TEST_BROKER_POOL, target/broker-pool/<pid>; ferry-testkit's `Kafka`) for
the next test of any process, instead of dying with its process; the
parked brokers die with this script.

A job still running after FERRY_TEST_JOB_TIMEOUT seconds (default 900) is
killed with the processes it started and fails: a hang fails the run fast,
naming its test, instead of holding CI until its limit.

A job's output is printed when it fails; every job's `test result` line is
summed, and the total number of tests run is printed at the end (it must
not drop from one change to the next). Exits non-zero when a test failed,
a binary could not run, or a binary ran fewer tests than it listed.
"""

import concurrent.futures
import itertools
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = int(os.environ.get("FERRY_TEST_JOBS", "3"))
# A binary with more tests than this is split into shards of about this many.
SHARD_SIZE = int(os.environ.get("FERRY_TEST_SHARD_SIZE", "12"))
# A job still running after this many seconds hangs: it is killed and fails
# (the slowest job takes about 200 s on 2 cores).
JOB_TIMEOUT = int(os.environ.get("FERRY_TEST_JOB_TIMEOUT", "900"))
RESULT = re.compile(r"test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored")


def build():
    """Builds the test binaries; [(name, package dir, executable)]."""
    out = subprocess.run(
        ["cargo", "test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    ).stdout
    binaries = []
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        package_dir = os.path.dirname(msg["manifest_path"])
        name = f"{os.path.relpath(package_dir, ROOT)}:{'/'.join(target['kind'])}:{target['name']}"
        binaries.append((name, package_dir, msg["executable"]))
    return binaries


def listed(exe, cwd):
    """The names of the tests `exe` holds."""
    out = subprocess.run([exe, "--list", "--format", "terse"], cwd=cwd, stdout=subprocess.PIPE, check=True, text=True)
    return [l[: -len(": test")] for l in out.stdout.splitlines() if l.endswith(": test")]


def jobs_of(binaries):
    """One job per binary, or per shard of a large one: (label, cwd, argv, tests)."""
    jobs = []
    for name, cwd, exe in binaries:
        tests = listed(exe, cwd)
        if not tests:
            continue
        shards = max(1, math.ceil(len(tests) / SHARD_SIZE))
        for i in range(shards):
            part = tests[i::shards]
            label = name if shards == 1 else f"{name} [{i + 1}/{shards}]"
            argv = [exe] if shards == 1 else [exe, "--exact", *part]
            jobs.append((label, cwd, argv, len(part)))
    # The slowest suites' shards first (the relay's tests wait on brokers,
    # clusters and timeouts for tens of seconds each), and in a suite the
    # shards holding a slow test first, then by size: a slow job started
    # last runs on alone while the cores idle.
    jobs.sort(key=lambda j: (first(j[0]), not slow(j[2]), -j[3]))
    # The jobs that mostly wait (a shard with a database outage keeps
    # PostgreSQL down 45 s; the consumer's shards and the service's HTTP
    # suite wait on their own) take turns with those that want the CPU
    # those waits leave: started together, three outages left the machine
    # half idle for a minute. The waiting jobs take turns by suite, so the
    # consumer's do not all come after the relay's.
    waiting = [j for j in jobs if slow(j[2]) or j[0].startswith(WAITING)]
    busy = [j for j in jobs if not (slow(j[2]) or j[0].startswith(WAITING))]
    suites = {}
    for j in waiting:
        suites.setdefault(first(j[0]), []).append(j)
    waiting = [j for turn in itertools.zip_longest(*suites.values()) for j in turn if j]
    jobs = []
    while waiting and busy:
        jobs += [waiting.pop(0), busy.pop(0)]
    return jobs + waiting + busy


# Test binaries by how long their tests take, slowest first; others after
# (measured: a relay shard 70-165 s, a consumer shard 70-130 s, the
# service's HTTP suite 48 s, the core's shard with a database outage 50 s,
# the testkit's own tests 18-25 s, which ran last and alone while they
# were unlisted, every other job under 16 s).
SLOWEST = [
    "relay:test:it",
    "consumer:test:it",
    "examples/runs-service:test:http",
    "testkit:lib:ferry_testkit",
    ".:test:it",
    "console:test:it",
    "testkit:test:chaos",
]

# Suites whose jobs mostly wait, like the shards of SLOW_TESTS (see jobs_of).
WAITING = ("consumer:test:it", "examples/runs-service:test:http")

# Tests that make their shard one of its suite's slowest (a cluster
# stopped and started).
SLOW_TESTS = ["outage::"]


def slow(argv):
    return any(t.startswith(prefix) for t in argv[1:] for prefix in SLOW_TESTS)


def first(label):
    for i, prefix in enumerate(SLOWEST):
        if label.startswith(prefix):
            return i
    return len(SLOWEST)


def run(job):
    label, cwd, argv, expected = job
    started = time.monotonic()
    # A session of its own: a job that hangs is killed with what it started
    # (brokers, relays), and fails with what it printed so far (libtest
    # names a test running for over 60 seconds).
    p = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = p.communicate(timeout=JOB_TIMEOUT)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        stdout += f"\nrun-tests: {label} still running after {JOB_TIMEOUT} s (FERRY_TEST_JOB_TIMEOUT): killed\n"
        hung = True
    took = time.monotonic() - started
    passed = failed = ignored = 0
    for m in RESULT.finditer(stdout):
        passed += int(m.group(2))
        failed += int(m.group(3))
        ignored += int(m.group(4))
    ok = not hung and p.returncode == 0 and failed == 0 and (expected is None or passed + ignored >= expected)
    return label, ok, passed, failed, took, stdout


# This run's token, handed to its test processes (FERRY_TEST_RUN): the
# schemas and databases they make end with it (ferry_t_<born>_<pid>_<n>_<run>,
# ferry-testkit's db.rs).
RUN = secrets.token_hex(8)
# Tagged schemas are stale after 20 minutes (ferry-testkit's db.rs): so
# only while no job may outlive the default timeout.
TAGGED = JOB_TIMEOUT <= 900


def drop_own_schemas():
    """Drops, in a process of its own that this run does not wait for, the
    test schemas and databases this run's test processes made, once every
    test passed (a failing run's stay for inspection, and a later run drops
    them after 20 minutes). Some DDL reads the whole catalog, so a run
    migrates its schemas faster without the last run's 700 beside them. The
    drops (about 20 s of one backend) overlap what follows: the test
    command's last checks, the next run's setup and build. Without psql,
    or should it fail (its log: target/drop-own-schemas.log), the
    20-minute rule alone applies."""
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    own = f"^ferry_t_[0-9]+_[0-9]+_[0-9]+_{RUN}$"
    script = (
        "SET lock_timeout = '2s';\nSET client_min_messages = warning;\n"
        "SELECT format('DROP SCHEMA IF EXISTS %I CASCADE', nspname) FROM pg_namespace "
        f"WHERE nspname ~ '{own}' "
        "UNION ALL SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', datname) "
        f"FROM pg_database WHERE datname ~ '{own}'\n\\gexec\n"
    )
    try:
        with open(os.path.join(ROOT, "target", "drop-own-schemas.log"), "a") as log:
            # No ~/.psqlrc (-X), never a password prompt (-w), every drop
            # tried however one fails, none waiting on a lock over 2 s.
            p = subprocess.Popen(
                ["psql", "-X", "-w", "-qAt", "-v", "ON_ERROR_STOP=0", "-d", url],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        p.stdin.write(script)
        p.stdin.close()
    except OSError:
        pass


# One pool per run: another run in the same checkout keeps its own.
BROKER_POOL = os.path.join(ROOT, "target", "broker-pool", str(os.getpid()))


def open_broker_pool():
    """The run's shared pool of reset Kafka brokers, empty; its brokers'
    watchdogs kill them once this process is gone."""
    close_broker_pool()
    os.makedirs(BROKER_POOL, exist_ok=True)
    os.environ["FERRY_TEST_BROKER_POOL"] = BROKER_POOL
    os.environ["FERRY_TEST_BROKER_POOL_OWNER"] = str(os.getpid())
    if TAGGED:
        os.environ["FERRY_TEST_RUN"] = RUN
    else:
        os.environ.pop("FERRY_TEST_RUN", None)


def close_broker_pool():
    """Kills the parked brokers (an earlier run's are gone with it) and
    removes the pool's directory with their log dirs."""
    parked = os.path.join(BROKER_POOL, "parked")
    for entry in os.listdir(parked) if os.path.isdir(parked) else []:
        try:
            with open(os.path.join(parked, entry)) as f:
                pid = int(f.read().split()[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                broker = b"kafka.Kafka" in f.read()
            if broker:  # not another process that took a dead one's pid
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
    subprocess.run(["rm", "-rf", BROKER_POOL], check=False)


def busy_core_seconds():
    """(busy, all) core-seconds this machine has spent since boot, from
    /proc/stat (busy: user, nice, system, irq and softirq time)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return busy / tick, sum(fields[:8]) / tick


def main():
    started = time.monotonic()
    busy_before, all_before = busy_core_seconds()
    binaries = build()
    open_broker_pool()
    jobs = jobs_of(binaries)
    jobs.append(("doc tests", ROOT, ["cargo", "test", "--workspace", "--doc"], None))
    print(f"run-tests: {len(binaries)} test binaries, {len(jobs)} jobs, {JOBS} at a time", flush=True)
    total = bad = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
        running = [pool.submit(run, job) for job in jobs]
        for done in concurrent.futures.as_completed(running):
            label, ok, passed, failed, took, out = done.result()
            total += passed
            status = "ok" if ok else "FAILED"
            print(f"run-tests: {status:6} {passed:4} passed {failed:3} failed {took:7.1f}s  {label}", flush=True)
            if not ok:
                bad += 1
                print(out, flush=True)
    close_broker_pool()
    if not bad and TAGGED:
        drop_own_schemas()
    busy_after, all_after = busy_core_seconds()
    print(
        f"run-tests: {total} tests passed; {bad} jobs failed; {time.monotonic() - started:.0f}s",
        flush=True,
    )
    # Where the phase's time is bound: a machine busy nearly all of it is
    # bound by CPU; much idle time means waits (timeouts, leases, polls).
    print(
        f"run-tests: the machine was busy {busy_after - busy_before:.0f} of "
        f"{all_after - all_before:.0f} core-seconds ({os.cpu_count()} cores)",
        flush=True,
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
