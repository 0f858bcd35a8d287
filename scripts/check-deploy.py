#!/usr/bin/env python3
"""Parse-and-check of deploy/: the compose file and the Dockerfile (no Docker
engine runs here), Ferry's own rules for the Kubernetes manifests, which
kubernetes-validate checks against the Kubernetes schemas separately, and the
PrometheusRule of deploy/prometheus/ (no schema there): its structure, its
groups equal to ferry-rules.yaml's, and each runbook_url naming a section
of docs/runbook.md. scripts/check-helm.py applies the same Kubernetes and
PrometheusRule rules (check_k8s, check_prometheus_rule) to the rendered Helm
chart.

deploy/Dockerfile builds three images, one binary each; the sidecar image
holds only the relay. IMAGES maps an image's name (the last path segment,
without the tag) to its Dockerfile target, the binary it ships and the
package that builds it."""
import glob
import os
import re
import shlex
import sys

import yaml

IMAGES = {
    "ferry-relay": {"target": "relay", "binary": "ferry-relay", "package": "ferry-relay"},
    "ferry-projection": {"target": "projection", "binary": "ferry-projection", "package": "ferry-consumer"},
    "ferry": {"target": "ferry", "binary": "ferry", "package": "ferry-cli"},
}
BY_TARGET = {v["target"]: dict(v, image=k) for k, v in IMAGES.items()}
RUNTIME_BASE = "debian:bookworm-slim"
RUNTIME_UID = "10001"


def fail(msg):
    print(f"deploy check failed: {msg}", file=sys.stderr)
    sys.exit(1)


def seconds(v):
    m = re.fullmatch(r"(\d+)(ms|s|m)?", str(v))
    if not m:
        fail(f"not a duration: {v}")
    n, unit = int(m.group(1)), m.group(2) or "ms"
    return n / 1000 if unit == "ms" else n * 60 if unit == "m" else n


def image_name(ref):
    """ghcr.io/example/ferry-relay:0.1.0 -> ferry-relay"""
    last = str(ref).rsplit("/", 1)[-1]
    return last.split("@", 1)[0].split(":", 1)[0]


# --- Dockerfile ------------------------------------------------------------

def parse_dockerfile(text):
    """Stages in order: {name, base, instrs: [(INSTR, args)]}."""
    lines, cur = [], ""
    for raw in text.splitlines():
        if not cur and raw.strip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    if cur.strip():
        lines.append(cur.strip())
    stages = []
    for line in lines:
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append({"name": name, "base": words[0], "instrs": []})
        elif not stages:
            if instr != "ARG":
                fail(f"Dockerfile: {instr} before the first FROM")
        else:
            stages[-1]["instrs"].append((instr, args.strip()))
    return stages


def exec_form(args):
    try:
        v = yaml.safe_load(args)
    except yaml.YAMLError:
        v = None
    if not isinstance(v, list):
        fail(f"Dockerfile: use the exec form (JSON array), not `{args}`")
    return v


def chain(stages, name):
    """The stage called name and the stages it builds on, nearest first; the
    external base image it ends on."""
    named = {s["name"]: s for s in stages if s["name"]}
    out, seen = [], set()
    s = named.get(name) or fail(f"Dockerfile: no stage {name}")
    while True:
        if s["name"] in seen:
            fail(f"Dockerfile: stage {name} builds on itself")
        seen.add(s["name"])
        out.append(s)
        if s["base"] in named:
            s = named[s["base"]]
        else:
            return out, s["base"]


def cargo_builds(stages, name):
    """The `cargo build` commands run in stage name and the stages under it."""
    cmds = []
    for s in chain(stages, name)[0]:
        for instr, args in s["instrs"]:
            if instr == "RUN":
                for part in re.split(r"&&|;|\|\|", args):
                    words = shlex.split(part)
                    if words[:2] == ["cargo", "build"]:
                        cmds.append(words)
    return cmds


def option_values(words, opt):
    vals = []
    for i, w in enumerate(words):
        if w == opt and i + 1 < len(words):
            vals.append(words[i + 1])
        elif w.startswith(opt + "="):
            vals.append(w.split("=", 1)[1])
    return vals


def check_image(stages, target):
    spec = BY_TARGET[target]
    binary, package = spec["binary"], spec["package"]
    stage_chain, base = chain(stages, target)
    if base != RUNTIME_BASE:
        fail(f"Dockerfile: target {target} must run on {RUNTIME_BASE}, not {base}")
    shipped, entrypoint, user, useradd = set(), None, None, False
    build_stages = set()
    for s in reversed(stage_chain):  # the base stage first
        for instr, args in s["instrs"]:
            if instr == "ADD":
                fail(f"Dockerfile: target {target} uses ADD; COPY --from a build stage instead")
            if instr == "COPY":
                words = args.split()
                src_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
                if src_stage is None:
                    fail(f"Dockerfile: target {target} copies from the build context: `COPY {args}`")
                build_stages.add(src_stage)
                paths = [w for w in words if not w.startswith("--")]
                shipped.update(os.path.basename(p.rstrip("/")) for p in paths[:-1])
            if instr == "RUN":
                if "cargo" in args.split() or "rustup" in args:
                    fail(f"Dockerfile: target {target} compiles in the runtime stage")
                for part in re.split(r"&&|;", args):
                    words = shlex.split(part)
                    if words[:2] in (["apt-get", "install"], ["apt", "install"]):
                        pkgs = {w for w in words[2:] if not w.startswith("-")}
                        if pkgs != {"ca-certificates"}:
                            fail(f"Dockerfile: target {target} installs {sorted(pkgs)}; only ca-certificates belongs in the runtime")
                    if words[:1] == ["useradd"] and option_values(words, "--uid") == [RUNTIME_UID]:
                        useradd = True
            if instr == "USER":
                user = args.split(":")[0]
            if instr == "ENTRYPOINT":
                entrypoint = exec_form(args)
    if shipped != {binary}:
        fail(f"Dockerfile: target {target} must ship only {binary}, ships {sorted(shipped) or 'nothing'}")
    if entrypoint != [binary]:
        fail(f"Dockerfile: target {target} needs ENTRYPOINT [\"{binary}\"], has {entrypoint}")
    if user != RUNTIME_UID or not useradd:
        fail(f"Dockerfile: target {target} must run as the non-root user uid {RUNTIME_UID}")
    for src in build_stages:
        builds = cargo_builds(stages, src)
        if not any(package in option_values(c, "-p") + option_values(c, "--package")
                   and binary in option_values(c, "--bin")
                   and "--release" in c and "--locked" in c for c in builds):
            fail(f"Dockerfile: stage {src} never runs `cargo build --release --locked -p {package} --bin {binary}`")
    return build_stages


def check_dockerfile():
    """deploy/Dockerfile: one target per image, one binary each."""
    docker_text = open("deploy/Dockerfile").read()
    stages = parse_dockerfile(docker_text)
    if len(stages) < 2:
        fail("Dockerfile must be multi-stage")
    for target in BY_TARGET:
        check_image(stages, target)
    # The sidecar's build compiles the relay and nothing else: no consumer, no
    # operator binary (neither links into the relay, and neither is needed).
    for src in check_image(stages, "relay"):
        for c in cargo_builds(stages, src):
            pkgs = option_values(c, "-p") + option_values(c, "--package")
            bins = option_values(c, "--bin")
            if pkgs != ["ferry-relay"] or bins != ["ferry-relay"] or {"--bins", "--workspace", "--all"} & set(c):
                fail(f"Dockerfile: the relay's build stage {src} builds more than ferry-relay: `{' '.join(c)}`")
    if stages[-1]["name"] != "relay":
        fail("Dockerfile: the last stage (the default target) must be the relay sidecar")
    relay_instrs = dict(stages[-1]["instrs"])
    if exec_form(relay_instrs.get("CMD", "[]"))[:1] != ["run"] or "9464" not in relay_instrs.get("EXPOSE", ""):
        fail("Dockerfile: the relay image must default to `run` and expose 9464")
    ignore = "deploy/Dockerfile.dockerignore"
    if not os.path.exists(ignore) or not any(
            line.strip().strip("/") == "target" for line in open(ignore)):
        fail(f"{ignore} must keep the host's target/ out of the build context")


# --- compose ---------------------------------------------------------------

def check_compose():
    """deploy/compose.yaml: the services, their images and their order; the number of services."""
    compose = yaml.safe_load(open("deploy/compose.yaml"))
    services = compose.get("services") or fail("compose: no services")
    for name in ["postgres", "kafka", "migrate", "relay", "consumer", "otel-collector"]:
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
    if (services["relay"].get("command") or [None])[0] != "run":
        fail("compose: the relay must run `ferry-relay run`")

    built = {}  # image -> target, for every service built from deploy/Dockerfile
    for name, svc in services.items():
        build = svc.get("build")
        if build is None:
            continue
        if not isinstance(build, dict):
            build = {"context": build}
        context = os.path.normpath(os.path.join("deploy", build.get("context", ".")))
        dockerfile = os.path.normpath(os.path.join(context, build.get("dockerfile", "Dockerfile")))
        if not os.path.isfile(dockerfile):
            fail(f"compose: {name} builds from {dockerfile}, which does not exist")
        if dockerfile != os.path.normpath("deploy/Dockerfile"):
            continue
        if context != ".":
            fail(f"compose: {name} must build deploy/Dockerfile from the repository root")
        target = build.get("target") or fail(f"compose: {name} builds deploy/Dockerfile without a target")
        if target not in BY_TARGET:
            fail(f"compose: {name} builds target {target}, not one of {sorted(BY_TARGET)}")
        image = svc.get("image") or fail(f"compose: {name} builds an image without naming it")
        if image_name(image) != BY_TARGET[target]["image"]:
            fail(f"compose: {name} tags target {target} as {image}; name it {BY_TARGET[target]['image']}:…")
        if built.get(image, target) != target:
            fail(f"compose: image {image} is built from two targets")
        built[image] = target

    def compose_binary(name):
        svc = services[name]
        image = svc.get("image")
        target = built.get(image) or fail(f"compose: {name} runs {image}, which no service builds from deploy/Dockerfile")
        binary = BY_TARGET[target]["binary"]
        entrypoint = svc.get("entrypoint")
        if entrypoint not in (None, [binary], binary):
            fail(f"compose: {name} overrides the entrypoint of {image} ({binary}) with {entrypoint}")
        return binary

    if compose_binary("relay") != "ferry-relay":
        fail("compose: the relay must run the relay image (target relay)")
    if compose_binary("consumer") != "ferry-projection":
        fail("compose: the consumer must run the projection image (target projection)")
    if compose_binary("migrate") not in ("ferry", "ferry-relay") or (services["migrate"].get("command") or [None])[0] != "migrate":
        fail("compose: migrate must run `ferry migrate` (or `ferry-relay migrate`)")
    if (services["relay"].get("depends_on") or {}).get("migrate", {}).get("condition") != "service_completed_successfully":
        fail("compose: the relay must wait for the migrations")
    for target in BY_TARGET:
        if target not in built.values():
            fail(f"compose: no service builds the {target} image")
    return len(services)


# --- Kubernetes ------------------------------------------------------------
# Ferry's rules for a set of manifests: deploy/k8s/*.yaml here, and the
# rendered Helm chart in scripts/check-helm.py. Workloads are found by the
# image they run (IMAGES), not by name.


def k8s_binary(where, c):
    """The binary a container runs, checked against its image."""
    name = image_name(c["image"])
    if name not in IMAGES:
        if name.startswith("ferry"):
            fail(f"k8s: {where} runs {c['image']}, which deploy/Dockerfile does not build")
        return None
    binary = IMAGES[name]["binary"]
    if c.get("command") not in (None, [binary]):
        fail(f"k8s: {where} runs {c['command']} in the {name} image, which ships only {binary}")
    return binary


def by_kind_of(docs):
    out = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def containers(d):
    return d["spec"]["template"]["spec"]["containers"]


def running(workloads, binary, arg0=None):
    """The workloads with a container running binary (and first argument arg0)."""
    return [d for d in workloads
            if any(k8s_binary(f"{d['kind']} {d['metadata']['name']}/{c['name']}", c) == binary
                   and (arg0 is None or (c.get("args") or [None])[0] == arg0) for c in containers(d))]


def relay_setting(c, flag, env, configmaps, default):
    """A relay setting as the container gives it: --flag[=value] in its
    arguments, else its env variable, else an envFrom ConfigMap's, else the
    relay's default."""
    args = c.get("args") or []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    for e in c.get("env") or []:
        if e["name"] == env and "value" in e:
            return e["value"]
    for src in c.get("envFrom") or []:
        ref = (src.get("configMapRef") or {}).get("name")
        data = configmaps.get(ref, {})
        if env in data:
            return data[env]
    return default


def check_k8s(docs, required, console_required=True, external_secrets=()):
    """Ferry's rules for the manifests docs; required: kinds that must be
    there; console_required: whether the console must be deployed (its rules
    apply whenever it is); external_secrets: Secrets referenced but managed
    outside docs."""
    by_kind = by_kind_of(docs)
    for kind in required:
        if kind not in by_kind:
            fail(f"k8s: no {kind}")
    deployments, jobs = by_kind.get("Deployment", []), by_kind.get("Job", [])
    for d in deployments + jobs:
        for c in containers(d):
            k8s_binary(f"{d['kind']} {d['metadata']['name']}/{c['name']}", c)
    configmaps = {m["metadata"]["name"]: m.get("data") or {} for m in by_kind.get("ConfigMap", [])}

    services = running(deployments, "ferry-relay") or fail("k8s: no deployment runs the ferry-relay sidecar")
    for service in services:
        pod = service["spec"]["template"]["spec"]
        sidecar = next((c for c in pod["containers"] if c["name"] == "ferry-relay"), None) \
            or fail(f"k8s: {service['metadata']['name']}: no container named ferry-relay")
        if k8s_binary("the relay sidecar", sidecar) != "ferry-relay":
            fail(f"k8s: the relay sidecar must run the relay image (ferry-relay), not {sidecar['image']}")
        if (sidecar.get("args") or [None])[0] != "run":
            fail("k8s: the relay sidecar must run `ferry-relay run`")
        if sidecar["livenessProbe"]["httpGet"]["path"] != "/healthz" or sidecar["readinessProbe"]["httpGet"]["path"] != "/readyz":
            fail("k8s: the relay sidecar needs /healthz liveness and /readyz readiness probes")
        relay_grace = seconds(relay_setting(sidecar, "--grace", "FERRY_GRACE", configmaps, "10s"))
        if pod["terminationGracePeriodSeconds"] <= relay_grace:
            fail("k8s: the pod's termination grace must exceed the relay's --grace")
    if not running(deployments, "ferry-projection"):
        fail("k8s: no deployment runs the consumer (the projection image, ferry-projection)")
    migrate = [j for j in jobs if any((c.get("args") or [None])[0] == "migrate" for c in containers(j))] \
        or fail("k8s: no job runs the migrations")
    for j in migrate:
        for c in containers(j):
            if k8s_binary("the migrate job", c) not in ("ferry", "ferry-relay") or (c.get("args") or [None])[0] != "migrate":
                fail(f"k8s: the migrate job must run `ferry migrate` from the operator image, not {c['image']} {c.get('args')}")
    names = [d["metadata"]["name"] for d in deployments]
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        if hpa["spec"]["scaleTargetRef"]["name"] not in names:
            fail(f"k8s: the HPA {hpa['metadata']['name']} targets no deployment here")
        if "lag" not in str(hpa["spec"]["metrics"]):
            fail("k8s: the consumer HPA must scale on lag")
    # The console: the operator image running `ferry console`, reachable only
    # inside the cluster (ClusterIP, no Ingress, a NetworkPolicy without ipBlock).
    if "Ingress" in by_kind:
        fail("k8s: no Ingress: the console (and the rest) is reached inside the cluster")
    consoles = running(deployments, "ferry", "console")
    if console_required and not consoles:
        fail("k8s: no deployment runs `ferry console`")
    for console in consoles:
        console_labels = console["spec"]["template"]["metadata"]["labels"]
        for svc in by_kind.get("Service", []):
            selects = svc["spec"].get("selector") or {}
            if selects and all(console_labels.get(k) == v for k, v in selects.items()):
                if svc["spec"].get("type", "ClusterIP") != "ClusterIP":
                    fail(f"k8s: Service {svc['metadata']['name']} exposes the console as {svc['spec']['type']}; use ClusterIP")
        policies = [p for p in by_kind.get("NetworkPolicy", [])
                    if all(console_labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
                    and "Ingress" in p["spec"].get("policyTypes", [])]
        if not policies:
            fail("k8s: no NetworkPolicy restricts ingress to the console")
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                if not rule.get("from") or any("ipBlock" in peer for peer in rule["from"]):
                    fail(f"k8s: NetworkPolicy {p['metadata']['name']} admits traffic from outside the cluster to the console")
    # Every database login a container reads comes from a Secret that is
    # here (or named as managed outside) and has that key.
    secrets = {s["metadata"]["name"]: set(s.get("stringData") or {}) | set(s.get("data") or {})
               for s in by_kind.get("Secret", [])}
    for d in deployments + jobs:
        for c in containers(d):
            if k8s_binary("a container", c) and not any(e["name"] == "DATABASE_URL" for e in c.get("env") or []):
                fail(f"k8s: {d['metadata']['name']}/{c['name']} has no DATABASE_URL")
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] not in external_secrets and ref["key"] not in secrets.get(ref["name"], ()):
                    fail(f"k8s: {d['metadata']['name']}/{c['name']} reads {e['name']} from secret {ref['name']} key {ref['key']}, which is not there")


# --- Prometheus rules --------------------------------------------------------
# kubernetes-validate has no schema for prometheus-operator's PrometheusRule,
# so it lives in deploy/prometheus/ beside the plain rule file and is checked
# here: its structure, its groups equal to the rule file's, and every alert's
# runbook_url naming a section of docs/runbook.md.


def anchors(markdown):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def check_prometheus_rule(crd, where):
    """A PrometheusRule (from where) against deploy/prometheus/ferry-rules.yaml
    and docs/runbook.md; the number of alerts."""
    rules = yaml.safe_load(open("deploy/prometheus/ferry-rules.yaml"))
    if crd.get("apiVersion") != "monitoring.coreos.com/v1" or crd.get("kind") != "PrometheusRule":
        fail(f"prometheus: {where} is not a monitoring.coreos.com/v1 PrometheusRule")
    if not crd.get("metadata", {}).get("name") or set(crd) != {"apiVersion", "kind", "metadata", "spec"} or set(crd["spec"]) != {"groups"}:
        fail(f"prometheus: the PrometheusRule of {where} needs metadata.name and only spec.groups")
    if crd["spec"]["groups"] != rules["groups"]:
        fail(f"prometheus: the PrometheusRule's groups in {where} differ from ferry-rules.yaml's")
    sections = anchors(open("docs/runbook.md").read())
    alerts = 0
    for g in rules["groups"]:
        if set(g) != {"name", "rules"}:
            fail(f"prometheus: group {g.get('name')} has keys {sorted(g)}")
        for r in g["rules"]:
            if set(r) - {"alert", "expr", "for", "labels", "annotations"} or "alert" not in r:
                fail(f"prometheus: {r.get('alert') or r.get('record')}: an alert with keys {sorted(r)}")
            alerts += 1
            if r["labels"].get("severity") not in ("page", "warning"):
                fail(f"prometheus: {r['alert']}: severity must be page or warning")
            url = r["annotations"].get("runbook_url", "")
            if not url.startswith("docs/runbook.md#") or url.split("#", 1)[1] not in sections:
                fail(f"prometheus: {r['alert']}: runbook_url {url!r} names no section of docs/runbook.md")
            if not r["annotations"].get("summary"):
                fail(f"prometheus: {r['alert']}: no summary")
    return alerts


def main():
    check_dockerfile()
    services = check_compose()
    docs = []
    for path in sorted(glob.glob("deploy/k8s/*.yaml")):
        docs += [d for d in yaml.safe_load_all(open(path)) if d]
    check_k8s(docs, ["Deployment", "Job", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"])
    crd_path = "deploy/prometheus/ferry-prometheusrule.yaml"
    alerts = check_prometheus_rule(yaml.safe_load(open(crd_path)), crd_path)
    print(f"deploy check: compose ({services} services), Dockerfile (targets {', '.join(BY_TARGET)}), {len(docs)} manifests, PrometheusRule ({alerts} alerts, runbook sections present) ok")


if __name__ == "__main__":
    main()
