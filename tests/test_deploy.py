"""deploy/k8s: the Kubernetes manifests (and docs/deploy.md's commands), checked without a cluster
(the Dockerfile: tests/test_dockerfile.py).

YAML parses; each kind has the fields it needs; probes ask /health on the serving port; the
termination grace outlasts `--grace-period`; every `jserve serve` command line of the manifests
parses with jserve's own parser; the LeaderWorkerSet's env wiring reaches
`jax.distributed.initialize` through `jserve.runtime.distributed`; accelerator counts, node
selectors, `-tp`, Services, PodMonitorings and the inference gateway's references agree.
"""

from __future__ import annotations

import math
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from jserve.cli import build_parser
from jserve.runtime import distributed
from jserve.runtime.sharding import parse_mesh
from jserve.vllm_args import apply_vllm_args

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
EXPECTED = {"tpu-deployment.yaml", "tpu-multihost-lws.yaml", "gpu-deployment.yaml", "inference-gateway.yaml"}


LWS_VARS = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
API_VERSIONS = {
    "Deployment": "apps/v1", "Service": "v1", "ServiceAccount": "v1", "ConfigMap": "v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
    "PodMonitoring": "monitoring.googleapis.com/v1", "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
    "InferencePool": "inference.networking.k8s.io/v1", "Gateway": "gateway.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1", "HealthCheckPolicy": "networking.gke.io/v1",
    "GCPBackendPolicy": "networking.gke.io/v1",
}
REQUIRED = {  # dotted paths each kind must have
    "Deployment": ["spec.replicas", "spec.selector.matchLabels", "spec.template.metadata.labels",
                   "spec.template.spec.containers"],
    "Service": ["spec.selector", "spec.ports"],
    "ServiceAccount": [],
    "ConfigMap": ["data"],
    "Role": ["rules"],
    "RoleBinding": ["subjects", "roleRef.kind", "roleRef.name"],
    "PodMonitoring": ["spec.selector.matchLabels", "spec.endpoints"],
    "LeaderWorkerSet": ["spec.replicas", "spec.leaderWorkerTemplate.size", "spec.leaderWorkerTemplate.restartPolicy",
                        "spec.leaderWorkerTemplate.leaderTemplate.metadata.labels",
                        "spec.leaderWorkerTemplate.leaderTemplate.spec.containers",
                        "spec.leaderWorkerTemplate.workerTemplate.spec.containers"],
    "InferencePool": ["spec.selector.matchLabels", "spec.targetPorts", "spec.endpointPickerRef.name",
                      "spec.endpointPickerRef.port.number"],
    "Gateway": ["spec.gatewayClassName", "spec.listeners"],
    "HTTPRoute": ["spec.parentRefs", "spec.rules"],
    "HealthCheckPolicy": ["spec.targetRef.kind", "spec.targetRef.name", "spec.default.config.httpHealthCheck"],
    "GCPBackendPolicy": ["spec.targetRef.kind", "spec.targetRef.name", "spec.default.timeoutSec"],
}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def get(obj, dotted: str):
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            raise KeyError(dotted)
        obj = obj[key]
    return obj


def of_kind(path: Path, kind: str) -> list[dict]:
    return [d for d in docs(path) if d["kind"] == kind]


def pods(path: Path) -> list[tuple[str, dict, dict]]:
    """(role, pod labels, pod spec) of every pod template in the file: 'server' for a
    Deployment's pods and an LWS leader, 'worker' for LWS workers."""
    out = []
    for d in docs(path):
        if d["kind"] == "Deployment":
            out.append(("server", d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "LeaderWorkerSet":
            lws = {"leaderworkerset.sigs.k8s.io/name": d["metadata"]["name"]}
            t = d["spec"]["leaderWorkerTemplate"]
            out.append(("server", {**t["leaderTemplate"]["metadata"]["labels"], **lws}, t["leaderTemplate"]["spec"]))
            out.append(("worker", {**t["workerTemplate"]["metadata"]["labels"], **lws}, t["workerTemplate"]["spec"]))
    return out


def jserve_containers() -> list[tuple[Path, str, dict, dict]]:
    """(file, role, container, pod spec) of every container that runs jserve."""
    return [(path, role, c, spec) for path in MANIFESTS for role, _, spec in pods(path)
            for c in spec["containers"] if c.get("command", [None])[0] == "jserve"]


def serve_parser():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["serve"], sub.choices


def option_strings(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", a)]


def value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def parse_serve(argv: list[str], env: dict[str, str] | None = None):
    """jserve's own parse of a `jserve serve` argument list, with $(VAR)s replaced from `env`, and
    vLLM's parallel sizes folded into --mesh as `jserve` does."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: (env or {})[m.group(1)], a) for a in argv]
    args = build_parser().parse_args(["serve", *argv])
    apply_vllm_args(args)
    return args


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def container_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)


def devices(args) -> int:
    return math.prod(parse_mesh(args.mesh).values()) if args.mesh else 1


# ---------------------------------------------------------------------------------------- YAML


def test_the_manifests_are_there():
    assert {p.name for p in MANIFESTS} == EXPECTED


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_yaml_parses_with_the_fields_each_kind_needs(path):
    found = docs(path)
    assert found, f"{path.name} holds no document"
    for d in found:
        kind = d.get("kind")
        assert kind in REQUIRED, f"{path.name}: no check for kind {kind!r}; add it to REQUIRED"
        assert d.get("apiVersion") == API_VERSIONS[kind], (path.name, kind, d.get("apiVersion"))
        assert get(d, "metadata.name")
        for field in REQUIRED[kind]:
            try:
                assert get(d, field) not in (None, "", [], {}), f"{path.name}: {kind} {field} is empty"
            except KeyError:
                pytest.fail(f"{path.name}: {kind} {d['metadata']['name']} lacks {field}")
        if kind == "Deployment":
            assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_services_and_pod_monitorings_select_serving_pods_by_a_named_port(path):
    servers = [(labels, spec) for role, labels, spec in pods(path) if role == "server"]
    workers = [labels for role, labels, _ in pods(path) if role == "worker"]
    for kind in ("Service", "PodMonitoring"):
        for d in of_kind(path, kind):
            selector = d["spec"]["selector"] if kind == "Service" else d["spec"]["selector"]["matchLabels"]
            chosen = [spec for labels, spec in servers if selector.items() <= labels.items()]
            assert chosen, f"{path.name}: {kind} {d['metadata']['name']} selects no serving pod"
            assert not any(selector.items() <= labels.items() for labels in workers), \
                f"{path.name}: {kind} selects LWS workers, which serve no HTTP"
            ports = [p["targetPort"] for p in d["spec"]["ports"]] if kind == "Service" else \
                [e["port"] for e in d["spec"]["endpoints"]]
            for spec in chosen:
                for port in ports:
                    assert any(container_port(c, port) for c in spec["containers"])
            if kind == "PodMonitoring":
                assert [e["path"] for e in d["spec"]["endpoints"]] == ["/metrics"]


# -------------------------------------------------------------------------- jserve's commands


def test_every_manifest_runs_jserve():
    files = {path.name for path, *_ in jserve_containers()}
    assert files == EXPECTED - {"inference-gateway.yaml"}


@pytest.mark.parametrize("path, role, container, spec", jserve_containers(),
                         ids=lambda x: x.name if isinstance(x, Path) else x if isinstance(x, str) else "")
def test_jserve_command_lines_parse_with_jserves_parser(path, role, container, spec):
    command, argv = container["command"], container["args"]
    parser, commands = serve_parser()
    assert command[0] in console_scripts(), f"{command[0]} is not a console script in pyproject.toml"
    assert command[1:] == ["serve"] and "serve" in commands
    unknown = set(flags(argv)) - option_strings(parser)
    assert not unknown, f"{path.name}: `jserve serve --help` has no {sorted(unknown)}"
    env = {e["name"] for e in container.get("env", [])}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(argv)):
        assert ref in env or (ref in LWS_VARS and "LeaderWorkerSet" in {d["kind"] for d in docs(path)}), \
            f"{path.name}: $({ref}) is set by nothing, so Kubernetes would pass it on unexpanded"
    args = parse_serve(argv, {v: "1" for v in LWS_VARS} | {"LWS_LEADER_ADDRESS": "leader"})
    assert args.host == "0.0.0.0"
    assert args.model.count("/") == 1, "a Hugging Face Hub id"
    if role == "server":
        assert args.port == container_port(container, "http")


@pytest.mark.parametrize("path, role, container, spec", jserve_containers(),
                         ids=lambda x: x.name if isinstance(x, Path) else x if isinstance(x, str) else "")
def test_probes_ask_health_on_the_serving_port_and_grace_outlasts_draining(path, role, container, spec):
    args = parse_serve(container["args"], {v: "1" for v in LWS_VARS})
    if role == "worker":  # a follower process listens on nothing (jserve/server/cli.py serve_command)
        assert not any(k.endswith("Probe") for k in container), f"{path.name}: a probe on an LWS worker"
    else:
        for probe in ("startupProbe", "readinessProbe"):
            http = container[probe]["httpGet"]
            assert http["path"] == "/health", (path.name, probe)
            assert container_port(container, http["port"]) == args.port, (path.name, probe)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert spec["terminationGracePeriodSeconds"] > sleep + args.grace_period, \
        f"{path.name}: terminationGracePeriodSeconds must outlast the preStop sleep and --grace-period"
    assert "--grace-period" in container["args"], "say the grace period the termination grace is sized for"


def test_tpu_pods_ask_for_the_slices_chips_and_shard_over_them():
    for path in (K8S / "tpu-deployment.yaml", K8S / "tpu-multihost-lws.yaml"):
        lws = of_kind(path, "LeaderWorkerSet")
        hosts = lws[0]["spec"]["leaderWorkerTemplate"]["size"] if lws else 1
        for _, _, spec in pods(path):
            selector = spec["nodeSelector"]
            assert selector["cloud.google.com/gke-tpu-accelerator"].startswith(("tpu-", "tpu7"))
            chips = math.prod(int(n) for n in selector["cloud.google.com/gke-tpu-topology"].split("x"))
            (c,) = spec["containers"]
            per_host = int(c["resources"]["limits"]["google.com/tpu"])
            assert int(c["resources"]["requests"]["google.com/tpu"]) == per_host
            assert per_host * hosts == chips, f"{path.name}: {hosts} hosts x {per_host} chips != topology {chips}"
            assert devices(parse_serve(c["args"], {v: "1" for v in LWS_VARS})) == chips, f"{path.name}: -tp"


def test_gpu_pod_shards_over_its_gpus():
    (d,) = of_kind(K8S / "gpu-deployment.yaml", "Deployment")
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert devices(parse_serve(c["args"])) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert "cloud.google.com/gke-accelerator" in d["spec"]["template"]["spec"]["nodeSelector"]


def test_leaderworkerset_workers_join_through_jserves_multihost_flags(monkeypatch):
    import jax

    (lws,) = of_kind(K8S / "tpu-multihost-lws.yaml", "LeaderWorkerSet")
    t = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = t["leaderTemplate"]["spec"]["containers"]
    (worker,) = t["workerTemplate"]["spec"]["containers"]
    assert leader["args"] == worker["args"], "every process of a multi-host run runs the same command"
    assert t["restartPolicy"] == "RecreateGroupOnPodRestart"
    multihost = {a.option_strings[0] for g in serve_parser()[0]._action_groups
                 if g.title and g.title.startswith("multi-host") for a in g._group_actions}
    wiring = {"--coordinator-address": "$(LWS_LEADER_ADDRESS):", "--num-processes": "$(LWS_GROUP_SIZE)",
              "--process-id": "$(LWS_WORKER_INDEX)"}
    assert set(wiring) | {"--distributed"} <= multihost, "the multi-host flags moved: update the LWS manifest"
    assert "--distributed" in leader["args"]
    for flag, start in wiring.items():
        assert value(leader["args"], flag).startswith(start), (flag, value(leader["args"], flag))
    port = int(value(leader["args"], "--coordinator-address").rsplit(":", 1)[1])
    assert container_port(leader, "coordinator") == port

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # gloo for CPU collectives: not here
    size = t["size"]
    for index in range(size):
        env = {"LWS_LEADER_ADDRESS": "jserve-multihost-0.jserve-multihost.default", "LWS_GROUP_SIZE": str(size),
               "LWS_WORKER_INDEX": str(index)}
        distributed.from_args(parse_serve(leader["args"] if index == 0 else worker["args"], env))
    assert calls == [{"coordinator_address": f"jserve-multihost-0.jserve-multihost.default:{port}",
                      "num_processes": size, "process_id": i} for i in range(size)]


# ----------------------------------------------------------------------------- the gateway


def test_inference_pool_routes_to_the_tpu_deployments_pods():
    gw = K8S / "inference-gateway.yaml"
    (pool,) = of_kind(gw, "InferencePool")
    (server,) = of_kind(K8S / "tpu-deployment.yaml", "Deployment")
    pod = server["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [container_port(c, "http")]

    ref = pool["spec"]["endpointPickerRef"]
    services = {s["metadata"]["name"]: s for s in of_kind(gw, "Service")}
    epp_service = services[ref["name"]]
    assert ref["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    (epp,) = [d for d in of_kind(gw, "Deployment")
              if epp_service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    epp_spec = epp["spec"]["template"]["spec"]
    (picker,) = epp_spec["containers"]
    assert value(picker["args"], "--pool-name") == pool["metadata"]["name"]
    assert value(picker["args"], "--pool-group") == pool["apiVersion"].split("/")[0]
    assert epp_spec["terminationGracePeriodSeconds"] >= pod["spec"]["terminationGracePeriodSeconds"]
    assert epp_spec["serviceAccountName"] in {d["metadata"]["name"] for d in of_kind(gw, "ServiceAccount")}

    # the picker's plugins file: mounted from the ConfigMap, every profile's plugin declared
    config_path = Path(value(picker["args"], "--config-file"))
    mount = next(m for m in picker["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in epp_spec["volumes"] if v["name"] == mount["name"])
    (config_map,) = [m for m in of_kind(gw, "ConfigMap") if m["metadata"]["name"] == volume["configMap"]["name"]]
    plugins = yaml.safe_load(config_map["data"][config_path.name])
    declared = {p["type"] for p in plugins["plugins"]}
    assert {r["pluginRef"] for prof in plugins["schedulingProfiles"] for r in prof["plugins"]} <= declared


def test_route_and_gke_policies_point_at_the_pool():
    gw = K8S / "inference-gateway.yaml"
    (pool,) = of_kind(gw, "InferencePool")
    name, group = pool["metadata"]["name"], pool["apiVersion"].split("/")[0]
    gateways = {g["metadata"]["name"] for g in of_kind(gw, "Gateway")}
    (route,) = of_kind(gw, "HTTPRoute")
    assert {p["name"] for p in route["spec"]["parentRefs"]} <= gateways
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": group, "kind": "InferencePool", "name": name}]
    for kind in ("HealthCheckPolicy", "GCPBackendPolicy"):
        (policy,) = of_kind(gw, kind)
        assert policy["spec"]["targetRef"] == {"group": group, "kind": "InferencePool", "name": name}
    check = of_kind(gw, "HealthCheckPolicy")[0]["spec"]["default"]["config"]["httpHealthCheck"]
    assert check == {"requestPath": "/health", "port": pool["spec"]["targetPorts"][0]["number"]}


# ------------------------------------------------------------------------------- the guide

GUIDE = ROOT / "docs" / "deploy.md"


def guide_commands() -> list[list[str]]:
    """Every command line of the guide's bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_guides_jserve_command_lines_parse():
    """`bash scripts/serve.sh ARGS` and `docker run ... jserve:TARGET ARGS` hand ARGS to `jserve serve`."""
    served = []
    for words in guide_commands():
        if words[:2] == ["bash", "scripts/serve.sh"] and words[2:3] != ["--print-platform"]:
            served.append(words[2:])
        elif words[:2] == ["docker", "run"]:
            image = next(i for i, w in enumerate(words) if re.fullmatch(r"jserve:(cpu|tpu|cuda)", w))
            served.append(words[image + 1:])
    assert len(served) >= 4
    parser, _ = serve_parser()
    for argv in served:
        assert set(flags(argv)) <= option_strings(parser), argv
        parse_serve(argv)


def test_guide_builds_every_target_applies_every_manifest_and_scales_the_pool_to_two():
    from test_dockerfile import stages

    commands = [" ".join(words) for words in guide_commands()]
    for target in stages().keys() - {"base"}:
        assert f"docker build -f deploy/Dockerfile --target {target} -t jserve:{target} ." in commands
    for path in MANIFESTS:
        assert f"kubectl apply -f deploy/k8s/{path.name}" in commands, path.name
    (pool,) = of_kind(K8S / "inference-gateway.yaml", "InferencePool")
    (server,) = of_kind(K8S / "tpu-deployment.yaml", "Deployment")
    assert pool["spec"]["selector"]["matchLabels"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    assert f"kubectl scale deployment/{server['metadata']['name']} --replicas=2" in commands
