#!/usr/bin/env python3
"""Checks renderings of the Helm chart deploy/helm/ferry (`helm template`
output, made by scripts/check-helm):

- every standard Kubernetes object against the Kubernetes schemas
  (kubernetes-validate, as scripts/validate-deploy does for deploy/k8s/);
- Ferry's deployment rules of scripts/check-deploy.py (the relay sidecar and
  its probes, the termination grace, the consumer, the migration, the
  console's isolation, every secret reference resolved);
- the chart's own rules: the migration Job is a pre-install/pre-upgrade hook
  whose Secret exists before it, the relay's metrics are annotated for
  scraping, and the custom resources (ServiceMonitor, PrometheusRule), for
  which kubernetes-validate has no schema, are checked structurally;
- every flag rendered for `ferry-relay run` (and `ferry console`) is one the
  binary's --help lists, and the relay's own parser and validation accept
  the rendered arguments: the relay is run with them against a database
  that cannot be opened, and must get past parsing and validation to fail
  on opening the database.

Usage: check-helm.py RELAY_BIN FERRY_BIN OUT_DIR NAME=RENDERED.yaml...
where NAME is `default` (the chart's defaults) or `all-on`
(deploy/helm/ferry/ci/all-on-values.yaml)."""
import importlib.util
import os
import re
import subprocess
import sys

import yaml

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("check_deploy", os.path.join(here, "check-deploy.py"))
deploy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deploy)
fail = deploy.fail

CUSTOM = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PrometheusRule"}}
# What each rendering must and must not contain.
EXPECT = {
    "default": {"console": False, "kinds": set(), "relay_flags": set(), "no_relay_flags": {"capture", "exactly-once"},
                "external_secrets": set(), "relay_env": set()},
    "all-on": {"console": True, "kinds": {"ServiceMonitor", "PrometheusRule", "NetworkPolicy"},
               "relay_flags": {"capture=wal", "exactly-once", "delete-on-delivery", "slot=ferry_orders"},
               "no_relay_flags": set(), "external_secrets": {"runs-service-db"}, "relay_env": set()},
    # Kafka properties from a Secret: FERRY_KAFKA, and no --kafka flag.
    "kafka-secret": {"console": False, "kinds": set(), "relay_flags": set(), "no_relay_flags": {"kafka", "capture"},
                     "external_secrets": {"kafka-client"}, "relay_env": {"FERRY_KAFKA"}},
}


def help_of(cmd):
    """The flags (`--name`) and env variables (`[env: NAME=]`) a --help lists."""
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, check=True).stdout
    flags = set(re.findall(r"^\s+(?:-[A-Za-z], )?--([a-z][a-z0-9-]*)", out, re.M))
    if not flags:
        fail(f"helm: {' '.join(cmd)} --help lists no flags")
    return flags, set(re.findall(r"\[env: ([A-Z0-9_]+)=", out))


def flag_names(where, args, known):
    """The flags of args (`--name` or `--name=value`), each checked against known."""
    names = []
    for a in args:
        if not a.startswith("--"):
            fail(f"helm: {where}: argument {a!r} is not a --flag=value (render every setting as one)")
        name = a[2:].split("=", 1)[0]
        if name not in known:
            fail(f"helm: {where} renders --{name}, which `--help` does not list")
        names.append(a[2:])
    return names


def relay_parses(relay_bin, args, where):
    """Runs the relay with args against an unopenable SQLite database: clap's
    parser and RelayConfig::validate must accept them, so the run fails only
    on opening the database."""
    env = {"PATH": os.environ.get("PATH", ""), "DATABASE_URL": "sqlite:///nonexistent-ferry-dir/helm-check.db",
           "RUST_LOG": "error"}
    p = subprocess.run([relay_bin] + args, capture_output=True, text=True, env=env, timeout=60)
    err = p.stderr
    if p.returncode == 2 or "Usage:" in err:
        fail(f"helm: {where}: ferry-relay's parser refused the rendered arguments:\n{err}")
    # main prints the error last as `ferry-relay: <error>`; a RelayConfig
    # refusal is `configuration: ...`.
    if p.returncode != 1 or not any(line.startswith("ferry-relay: database:") for line in err.splitlines()):
        fail(f"helm: {where}: expected ferry-relay to pass parsing and validation and fail on opening the database, got exit {p.returncode}:\n{err}")


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_rendering(name, path, out_dir, relay_bin, ferry_bin, relay_help, console_help):
    expect = EXPECT[name]
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    standard, custom = [], []
    for d in docs:
        api, kind = d.get("apiVersion"), d.get("kind")
        if api in CUSTOM:
            if kind not in CUSTOM[api]:
                fail(f"helm ({name}): unexpected custom resource {api} {kind}")
            custom.append(d)
        else:
            standard.append(d)
    # The Kubernetes schemas.
    k8s_file = os.path.join(out_dir, f"{name}.k8s.yaml")
    with open(k8s_file, "w") as f:
        yaml.safe_dump_all(standard, f, sort_keys=False)
    validate = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    r = subprocess.run([validate, "--strict", "--kubernetes-version", "1.31", k8s_file], capture_output=True, text=True)
    sys.stderr.write(r.stdout + r.stderr)
    if r.returncode != 0:
        fail(f"helm ({name}): kubernetes-validate rejected the rendering ({k8s_file})")
    # Ferry's deployment rules.
    required = ["Deployment", "Job", "Secret", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Service"]
    deploy.check_k8s(docs, required, console_required=expect["console"], external_secrets=expect["external_secrets"])
    by_kind = deploy.by_kind_of(docs)
    for kind in expect["kinds"]:
        if kind not in by_kind:
            fail(f"helm ({name}): no {kind}")
    if not expect["console"] and deploy.running(by_kind.get("Deployment", []), "ferry", "console"):
        fail(f"helm ({name}): the console is deployed, but it is off by default")
    if name == "default" and set(by_kind) & {"ServiceMonitor", "PrometheusRule"}:
        fail(f"helm ({name}): ServiceMonitor and PrometheusRule are off by default")

    # The relay sidecar: flags from --help, values its parser accepts.
    relay_flags, relay_envs = relay_help
    services = deploy.running(by_kind["Deployment"], "ferry-relay")
    relay_port = None
    for svc in services:
        pod = svc["spec"]["template"]
        sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "ferry-relay")
        args = sidecar["args"]
        where = f"{svc['metadata']['name']}/ferry-relay"
        rendered = flag_names(where, args[1:], relay_flags)
        for e in sidecar.get("env") or []:
            if e["name"].startswith("FERRY_") and e["name"] not in relay_envs:
                fail(f"helm: {where} sets {e['name']}, which `ferry-relay run --help` does not list")
        for want in expect["relay_env"]:
            if not any(e["name"] == want for e in sidecar.get("env") or []):
                fail(f"helm ({name}): the relay's environment lacks {want}")
        for want in expect["relay_flags"]:
            if want not in rendered:
                fail(f"helm ({name}): the relay's arguments lack --{want}: {args}")
        for unwanted in expect["no_relay_flags"]:
            if any(f.split("=", 1)[0] == unwanted for f in rendered):
                fail(f"helm ({name}): the relay's arguments have --{unwanted}, which this rendering leaves to the default: {args}")
        relay_parses(relay_bin, args, f"{name}: {where}")
        port = next(p for p in sidecar["ports"] if p["name"] == "relay-http")["containerPort"]
        listen = deploy.relay_setting(sidecar, "--listen", "FERRY_LISTEN", {}, "")
        if listen != f"0.0.0.0:{port}":
            fail(f"helm: {where} listens on {listen!r}, not 0.0.0.0:{port}, its relay-http port")
        notes = pod["metadata"].get("annotations") or {}
        if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != str(port) \
                or notes.get("prometheus.io/path") != "/metrics":
            fail(f"helm: {svc['metadata']['name']}: the pod needs prometheus.io/scrape, /port ({port}) and /path annotations")
        relay_port = port

    # The console's flags.
    for console in deploy.running(by_kind["Deployment"], "ferry", "console"):
        c = next(c for c in deploy.containers(console) if (c.get("args") or [None])[0] == "console")
        flag_names(f"{console['metadata']['name']}/{c['name']}", c["args"][1:], console_help[0])

    # The migration: a pre-install/pre-upgrade hook; its Secret a hook made before it.
    secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
    for job in by_kind["Job"]:
        notes = job["metadata"].get("annotations") or {}
        hooks = set(notes.get("helm.sh/hook", "").split(","))
        if not {"pre-install", "pre-upgrade"} <= hooks:
            fail(f"helm: Job {job['metadata']['name']} must be a pre-install,pre-upgrade hook, is {sorted(hooks)}")
        weight = int(notes.get("helm.sh/hook-weight", "0"))
        for c in deploy.containers(job):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if not ref or ref["name"] in expect["external_secrets"]:
                    continue
                s_notes = secrets[ref["name"]]["metadata"].get("annotations") or {}
                if not hooks <= set(s_notes.get("helm.sh/hook", "").split(",")) \
                        or int(s_notes.get("helm.sh/hook-weight", "0")) >= weight:
                    fail(f"helm: the migration reads Secret {ref['name']}, which is no hook created before it")

    # Custom resources, structurally.
    for d in custom:
        if not d.get("metadata", {}).get("name"):
            fail(f"helm ({name}): {d['kind']} without metadata.name")
        if d["kind"] == "PrometheusRule":
            deploy.check_prometheus_rule(d, f"helm template ({name})")
        elif d["kind"] == "ServiceMonitor":
            if set(d) != {"apiVersion", "kind", "metadata", "spec"} or set(d["spec"]) - {"selector", "endpoints", "namespaceSelector"}:
                fail(f"helm ({name}): ServiceMonitor with unexpected fields {sorted(d)} / {sorted(d['spec'])}")
            targets = [s for s in by_kind.get("Service", [])
                       if selects(d["spec"]["selector"].get("matchLabels"), s["metadata"].get("labels") or {})]
            if not targets:
                fail(f"helm ({name}): the ServiceMonitor selects no Service")
            for ep in d["spec"]["endpoints"]:
                if ep.get("path") != "/metrics" or set(ep) - {"port", "path", "interval"}:
                    fail(f"helm ({name}): ServiceMonitor endpoint {ep} must scrape /metrics by port name")
                for s in targets:
                    port = next((p for p in s["spec"]["ports"] if p.get("name") == ep["port"]), None) \
                        or fail(f"helm ({name}): Service {s['metadata']['name']} has no port {ep['port']}")
                    pods = [svc for svc in services if selects(s["spec"]["selector"], svc["spec"]["template"]["metadata"]["labels"])]
                    if not pods or port["targetPort"] != "relay-http" or port["port"] != relay_port:
                        fail(f"helm ({name}): Service {s['metadata']['name']} does not lead to the relay's metrics port")
    print(f"helm check ({name}): {len(standard)} objects valid, {len(custom)} custom resources, relay args {' '.join(sidecar['args'])} accepted")


def main():
    relay_bin, ferry_bin, out_dir = sys.argv[1:4]
    relay_help = help_of([relay_bin, "run"])
    console_help = help_of([ferry_bin, "console"])
    for arg in sys.argv[4:]:
        name, path = arg.split("=", 1)
        check_rendering(name, path, out_dir, relay_bin, ferry_bin, relay_help, console_help)


if __name__ == "__main__":
    main()
