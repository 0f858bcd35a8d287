// A Node service's outbox writes through ferry_enqueue_json, with
// node-postgres (pg). relay/tests/it/writers.rs runs it with the JSON plan
// tests/writers/python/writer.py describes, and reads what it prints.
'use strict';
const { Client } = require('pg');

async function main() {
  const plan = JSON.parse(process.argv[2]);
  const out = { ids: [], bad_input: null };
  const client = new Client({ connectionString: plan.url });
  await client.connect();
  try {
    for (const [key, seq] of plan.rows) {
      const payload = JSON.stringify({ seq, writer: plan.writer });
      await client.query('BEGIN');
      await client.query('INSERT INTO app_orders (key, seq, writer) VALUES ($1, $2, $3)', [key, seq, plan.writer]);
      const res = await client.query('SELECT ferry_enqueue_json($1, $2, $3, $4::json) AS id', [
        plan.tenant,
        plan.topic,
        key,
        payload,
      ]);
      await client.query('COMMIT');
      out.ids.push(Number(res.rows[0].id));
    }
    // A transaction that rolls back publishes nothing.
    await client.query('BEGIN');
    for (const [key, seq] of plan.rollback) {
      await client.query('INSERT INTO app_orders (key, seq, writer) VALUES ($1, $2, $3)', [key, seq, plan.writer]);
      await client.query('SELECT ferry_enqueue_json($1, $2, $3, $4::json)', [
        plan.tenant,
        plan.topic,
        key,
        JSON.stringify({ seq }),
      ]);
    }
    await client.query('ROLLBACK');
    // Bad input: a typed error, and the transaction writes nothing.
    await client.query('BEGIN');
    try {
      await client.query("INSERT INTO app_orders (key, seq, writer) VALUES ('bad', -1, $1)", [plan.writer]);
      await client.query('SELECT ferry_enqueue_json($1, $2, $3, $4::json)', [plan.tenant, 'bad/topic', 'k', '{}']);
    } catch (e) {
      out.bad_input = { sqlstate: e.code, message: e.message, detail: e.detail, column: e.column };
    }
    await client.query('ROLLBACK');
  } finally {
    await client.end();
  }
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
