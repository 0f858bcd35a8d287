#!/usr/bin/env python3
"""Checks every PromQL expression Ferry ships: the alert rules
(deploy/prometheus/*.yaml) and the Grafana dashboard (deploy/grafana/*.json).

The PrometheusRule manifest is skipped: scripts/check-deploy.py keeps its
groups equal to ferry-rules.yaml's.

(a) Each expression parses: all of them go into one temporary rule file, one
    recording rule each, checked by `promtool check rules` (Grafana's
    `$__rate_interval`, `$__interval` and `$__range` become 5m first; any other
    `$` variable is refused).
(b) Each names only metrics listed in deploy/prometheus/metrics.txt (which a
    relay test keeps equal to what the code exports). Metric names are read
    with a small PromQL tokenizer: strings, label matchers `{...}`, ranges
    `[...]`, grouping label lists (`by`, `without`, `on`, `ignoring`,
    `group_left`, `group_right`), keywords, numbers and function calls are
    skipped; every other identifier is a metric name.

Usage: check-promql.py PROMTOOL"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "5m", "$__range": "5m"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
NUMBER = re.compile(r"(0x[0-9a-fA-F]+|[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?)([smhdwy]|ms)?")


def fail(msg):
    print(f"promql check failed: {msg}", file=sys.stderr)
    sys.exit(1)


def skip_to(expr, i, close):
    """Index after the `close` that ends the bracket opened before i (strings skipped)."""
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = skip_string(expr, i)
            continue
        if c == close:
            return i + 1
        i += 1
    raise ValueError(f"unclosed {close!r}")


def skip_string(expr, i):
    quote = expr[i]
    i += 1
    while i < len(expr) and expr[i] != quote:
        i += 2 if expr[i] == "\\" else 1
    return i + 1


def metric_names(expr):
    """The metric names an expression selects."""
    names, i, after_grouping = set(), 0, False
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c == "#":
            end = expr.find("\n", i)
            i = len(expr) if end < 0 else end + 1
        elif c in "\"'`":
            i = skip_string(expr, i)
        elif c == "{":
            i = skip_to(expr, i + 1, "}")
        elif c == "[":
            i = skip_to(expr, i + 1, "]")
        elif c == "(" and after_grouping:
            i = skip_to(expr, i + 1, ")")
            after_grouping = False
        elif c.isdigit() or (c == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            i += NUMBER.match(expr, i).end() - i
        elif IDENT.match(expr, i):
            word = IDENT.match(expr, i).group(0)
            i += len(word)
            rest = expr[i:].lstrip()
            if word.lower() in KEYWORDS:
                after_grouping = word.lower() in GROUPING
            elif rest.startswith("(") or (word in AGGREGATIONS and re.match(r"(by|without)\b", rest)):
                pass  # a function or an aggregation
            else:
                names.add(word)
        else:
            i += 1
    return names


def expressions():
    """(where, expression) for every rule and dashboard target."""
    out = []
    for path in sorted(glob.glob("deploy/prometheus/*.yaml")):
        doc = yaml.safe_load(open(path))
        if "kind" in doc:
            continue  # the PrometheusRule: check-deploy.py keeps its groups equal to the rule file's
        for g in doc["groups"]:
            for r in g["rules"]:
                out.append((f"{path}: {r.get('alert') or r.get('record')}", r["expr"]))

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for path in sorted(glob.glob("deploy/grafana/*.json")):
        for p in panels(json.load(open(path))["panels"]):
            for t in p.get("targets", []):
                out.append((f"{path}: panel {p['title']!r} {t['refId']}", t["expr"]))
    return out


def main():
    promtool = sys.argv[1]
    allowed = {l.strip() for l in open("deploy/prometheus/metrics.txt") if l.strip() and not l.startswith("#")}
    exprs = expressions()
    if not exprs:
        fail("no expressions found")
    rules, names_used = [], set()
    for n, (where, expr) in enumerate(exprs):
        for var, value in GRAFANA_RANGES.items():
            expr = expr.replace(var, value)
        if "$" in expr:
            fail(f"{where}: unknown variable in {expr!r}")
        try:
            names = metric_names(expr)
        except ValueError as e:
            fail(f"{where}: {e} in {expr!r}")
        if not names:
            fail(f"{where}: names no metric: {expr!r}")
        unknown = names - allowed
        if unknown:
            fail(f"{where}: names metrics not exported (deploy/prometheus/metrics.txt): {sorted(unknown)}")
        names_used |= names
        rules.append({"record": f"ferry_check:expr_{n}", "expr": expr})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump({"groups": [{"name": "every-shipped-expression", "rules": rules}]}, f)
    try:
        done = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        refused = sorted({exprs[int(n)][0] for n in re.findall(r"ferry_check:expr_(\d+)", done.stdout + done.stderr)})
        fail(f"promtool refused {refused}:\n{done.stdout}{done.stderr}")
    print(f"promql check: {len(exprs)} expressions parse and name {len(names_used)} of the "
          f"{len(allowed)} exported metrics")


if __name__ == "__main__":
    main()
