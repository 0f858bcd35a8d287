#!/usr/bin/env python3
"""The worker's complete_and_claim statement under a custom and a generic plan
(issue #21, BENCHMARKS.md "Jobs beside both peers, and the completion window
(stop 28)"): on a fresh database migrated from migrations/postgres, seeds
20,000 runs (2,000 of their jobs leased by `w` with their attempts open,
18,000 queued and due), then completes all the leases `--batch` (16) at a
time with the statement rendered by render.py, claiming as many more each
time (2,000 / batch statements per mode), each autocommitted through psql, and prints the milliseconds per
statement. `plan_cache_mode` is `auto` (PostgreSQL keeps planning this
statement anew: a custom plan each time) or `force_generic_plan`.

    scripts/explain/plan-modes.py [--rounds 2] [--batch 16]

DATABASE_URL names the cluster; a database `ferry_plan_modes` is created
and dropped.
"""
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASE = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
DB = "ferry_plan_modes"
URL = BASE.rsplit("/", 1)[0] + "/" + DB

SEED = """
SELECT (extract(epoch FROM now()) * 1000)::bigint AS nowms \\gset
INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
SELECT 'tenant-' || (i % 10), gen_random_uuid(), 'op', 'queued', 1, '{"amount": 5}',
       :nowms - 100000 + i, :nowms - 100000 + i, 1
FROM generate_series(1, 20000) i;
INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
SELECT tenant, run_id, 1, 'run_queued', '{"operation": "op", "queue": "q"}', created_at FROM runs;
INSERT INTO jobs (tenant, run_id, queue, state, available_at, lease_owner, lease_expires_at, lease_generation,
                  attempts, max_attempts, created_at, updated_at)
SELECT tenant, run_id, 'q', CASE WHEN n <= 2000 THEN 'leased' ELSE 'queued' END,
       CASE WHEN n <= 2000 THEN :nowms + 3600000 ELSE created_at END,
       CASE WHEN n <= 2000 THEN 'w' END, CASE WHEN n <= 2000 THEN :nowms + 3600000 END,
       CASE WHEN n <= 2000 THEN 1 ELSE 0 END, CASE WHEN n <= 2000 THEN 1 ELSE 0 END, 5, created_at, created_at
FROM (SELECT *, row_number() OVER (ORDER BY created_at) n FROM runs) r;
INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at)
SELECT tenant, run_id, 1, 1, 'w', created_at FROM jobs WHERE state = 'leased';
VACUUM ANALYZE;
CREATE TABLE leases AS
SELECT (row_number() OVER (ORDER BY run_id) - 1) / :batch AS b, tenant, run_id FROM jobs WHERE state = 'leased';
"""


def psql(url, *args, inp=None):
    return subprocess.run(["psql", url, "-qAt", *args], input=inp, capture_output=True, text=True, check=False)


def one(statement, mode, batch):
    psql(BASE, "-c", f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
    psql(BASE, "-c", f"CREATE DATABASE {DB}")
    for f in sorted(glob.glob(f"{ROOT}/migrations/postgres/*.sql")):
        psql(URL, "-v", "ON_ERROR_STOP=1", "-f", f)
    psql(URL, "-v", f"batch={batch}", inp=SEED)
    rows = psql(URL, "-F", "|", "-c",
                "SELECT b, array_agg(tenant)::text, array_agg(run_id)::text FROM leases GROUP BY b ORDER BY b LIMIT %d" % (2000 // batch))
    lines = [
        "PREPARE cac(text[], uuid[], text[], bigint[], jsonb[], int[], bigint, text, text, int, text, bigint) AS",
        statement, ";", f"SET plan_cache_mode = {mode};", "SELECT clock_timestamp() AS t0 \\gset",
    ]
    for row in filter(None, rows.stdout.split("\n")):
        _, tenants, ids = row.split("|")
        n = len(tenants.strip("{}").split(","))
        arr = lambda v: "{" + ",".join([v] * n) + "}"  # noqa: E731
        jsons = "{" + ",".join(['"{}"'] * n) + "}"
        lines.append("EXECUTE cac('%s', '%s', '%s', '%s', '%s', '%s', NULL, 'ferry.run-events', 'q', %d, 'w2', 30000)"
                     " \\g /dev/null" % (tenants, ids, arr("w"), arr("1"), jsons, arr("1"), batch))
    lines.append("SELECT round(extract(epoch FROM clock_timestamp() - :'t0'::timestamptz) * 1000 / %d, 2)," % (2000 // batch) +
                 " (SELECT count(*) FROM jobs WHERE state = 'succeeded');")
    out = psql(URL, inp="\n".join(lines))
    ms, done = out.stdout.strip().split("\n")[-1].split("|")
    print(f"{mode:<20} {ms:>8} ms per statement ({done} jobs completed){' ' + out.stderr[:200] if out.stderr else ''}",
          flush=True)
    psql(BASE, "-c", f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


def main():
    arg = lambda name, default: int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default  # noqa: E731
    rounds = arg("--rounds", 2)
    batch = arg("--batch", 16)
    statement = subprocess.run([sys.executable, f"{HERE}/render.py", "complete_and_claim", f"{ROOT}/sql/jobs.sql"],
                               capture_output=True, text=True, check=True).stdout
    for _ in range(rounds):
        for mode in ("auto", "force_generic_plan"):
            one(statement, mode, batch)


main()
