"""A Python service's outbox writes through ferry_enqueue_json, with psycopg 3.

relay/tests/it/writers.rs runs it with a JSON plan as its one argument:
  {"url": ..., "tenant": ..., "topic": ..., "writer": "python",
   "rows": [[key, seq], ...], "rollback": [[key, seq], ...]}
Each row of `rows` is one transaction that writes the service's own row
(app_orders) and enqueues {"seq": seq, "writer": writer} for `key`; the rows
of `rollback` are enqueued in a transaction that rolls back; then a call with
a bad topic is made inside a transaction. Prints what it saw as JSON.
"""

import json
import sys

import psycopg


def main():
    plan = json.loads(sys.argv[1])
    out = {"ids": [], "bad_input": None}
    with psycopg.connect(plan["url"], autocommit=True) as conn:
        for key, seq in plan["rows"]:
            payload = json.dumps({"seq": seq, "writer": plan["writer"]}, separators=(",", ":"))
            with conn.transaction():
                conn.execute(
                    "INSERT INTO app_orders (key, seq, writer) VALUES (%s, %s, %s)",
                    (key, seq, plan["writer"]),
                )
                row = conn.execute(
                    "SELECT ferry_enqueue_json(%s, %s, %s, %s::json)",
                    (plan["tenant"], plan["topic"], key, payload),
                ).fetchone()
                out["ids"].append(row[0])
        # A transaction that rolls back publishes nothing.
        try:
            with conn.transaction():
                for key, seq in plan["rollback"]:
                    conn.execute(
                        "INSERT INTO app_orders (key, seq, writer) VALUES (%s, %s, %s)",
                        (key, seq, plan["writer"]),
                    )
                    conn.execute(
                        "SELECT ferry_enqueue_json(%s, %s, %s, %s::json)",
                        (plan["tenant"], plan["topic"], key, json.dumps({"seq": seq})),
                    )
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        # Bad input: a typed error, and the transaction writes nothing.
        try:
            with conn.transaction():
                conn.execute("INSERT INTO app_orders (key, seq, writer) VALUES ('bad', -1, %s)", (plan["writer"],))
                conn.execute(
                    "SELECT ferry_enqueue_json(%s, %s, %s, %s::json)",
                    (plan["tenant"], "bad/topic", "k", "{}"),
                )
        except psycopg.errors.InvalidParameterValue as e:
            out["bad_input"] = {
                "sqlstate": e.sqlstate,
                "message": e.diag.message_primary,
                "detail": e.diag.message_detail,
                "column": e.diag.column_name,
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
