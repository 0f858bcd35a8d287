#!/usr/bin/env python3
"""Parse-and-check of deploy/: the compose file and the Dockerfile (no Docker
engine runs here), and Ferry's own rules for the Kubernetes manifests, which
kubernetes-validate checks against the Kubernetes schemas separately."""
import glob
import re
import sys

import yaml


def fail(msg):
    print(f"deploy check failed: {msg}", file=sys.stderr)
    sys.exit(1)


def seconds(v):
    m = re.fullmatch(r"(\d+)(ms|s|m)?", str(v))
    if not m:
        fail(f"not a duration: {v}")
    n, unit = int(m.group(1)), m.group(2) or "ms"
    return n / 1000 if unit == "ms" else n * 60 if unit == "m" else n


compose = yaml.safe_load(open("deploy/compose.yaml"))
services = compose.get("services") or fail("compose: no services")
for name in ["postgres", "kafka", "relay", "consumer", "otel-collector"]:
    if name not in services:
        fail(f"compose: missing service {name}")
for name, svc in services.items():
    if "image" not in svc and "build" not in svc:
        fail(f"compose: {name} has neither image nor build")
    deps = svc.get("depends_on") or {}
    for dep in deps:
        if dep not in services:
            fail(f"compose: {name} depends on unknown service {dep}")
kafka_env = services["kafka"].get("environment", {})
if "controller" not in str(kafka_env.get("KAFKA_PROCESS_ROLES", "")):
    fail("compose: kafka must run in KRaft mode (KAFKA_PROCESS_ROLES with controller)")
if services["relay"].get("command", [None])[0] != "run":
    fail("compose: the relay must run `ferry-relay run`")

docker = open("deploy/Dockerfile").read()
if len(re.findall(r"^FROM ", docker, re.M)) < 2:
    fail("Dockerfile must be multi-stage")
for binary in ["ferry-relay", "ferry-projection"]:
    if binary not in docker:
        fail(f"Dockerfile does not ship {binary}")

docs = []
for path in sorted(glob.glob("deploy/k8s/*.yaml")):
    docs += [d for d in yaml.safe_load_all(open(path)) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
for kind in ["Deployment", "Job", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"]:
    if kind not in by_kind:
        fail(f"k8s: no {kind}")
config = by_kind["ConfigMap"][0]["data"]
relay_grace = seconds(config["FERRY_GRACE"])
service = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "runs-service")
pod = service["spec"]["template"]["spec"]
sidecar = next((c for c in pod["containers"] if c["name"] == "ferry-relay"), None) or fail("k8s: no ferry-relay sidecar")
if sidecar["livenessProbe"]["httpGet"]["path"] != "/healthz" or sidecar["readinessProbe"]["httpGet"]["path"] != "/readyz":
    fail("k8s: the relay sidecar needs /healthz liveness and /readyz readiness probes")
if pod["terminationGracePeriodSeconds"] <= relay_grace:
    fail("k8s: the pod's termination grace must exceed the relay's --grace")
hpa = by_kind["HorizontalPodAutoscaler"][0]
if hpa["spec"]["scaleTargetRef"]["name"] not in [d["metadata"]["name"] for d in by_kind["Deployment"]]:
    fail("k8s: the HPA targets no deployment here")
if "lag" not in str(hpa["spec"]["metrics"]):
    fail("k8s: the consumer HPA must scale on lag")
secret = by_kind["Secret"][0]["stringData"]
for key in ["service-url", "relay-url", "consumer-url", "migrate-url"]:
    if key not in secret:
        fail(f"k8s: secret lacks {key}")
print(f"deploy check: compose ({len(services)} services), Dockerfile, {len(docs)} manifests ok")
