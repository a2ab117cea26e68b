"""The multi-instance deployment files: docker/compose.{disagg,replicas}.yaml, docker/k8s/*.yaml
and docker/router.Dockerfile (prefill/decode disaggregation and replica scale-out behind
vllm-router). Lint, schema validation, and the cross-references between them: roles, the shared
store and seed, health probes, router targets, Service selectors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
COMPOSE_FILES = ["compose.yaml", "compose.disagg.yaml", "compose.replicas.yaml", "compose.cpu.yaml"]
ROUTED = ["compose.disagg.yaml", "compose.replicas.yaml"]  # the compose files with a router
K8S_FILES = sorted(p.name for p in K8S.glob("*.yaml"))
K8S_VERSION = "1.31"  # a release kubernetes-validate ships schemas for (offline)
KVSERVE_PORT = 8000  # the image's KVSERVE_PORT
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


# ---- helpers -------------------------------------------------------------------------------------


def _compose(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())["services"]


def _image(ref: str) -> str:
    """The image's name without registry, tag or digest: REGISTRY/kvserve:1.0 -> kvserve."""
    return ref.split("@")[0].rsplit("/", 1)[-1].split(":")[0]


def _env(spec: dict) -> dict:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return env


def _tokens(cmd: list) -> list[str]:
    """A command line with every --flag=value split into --flag, value."""
    out: list[str] = []
    for token in map(str, cmd):
        if token.startswith("--") and "=" in token:
            out += token.split("=", 1)
        else:
            out.append(token)
    return out


def _values(cmd: list, flag: str) -> list[str]:
    """Every value given to `flag` (repeated flags and multi-value flags alike)."""
    tokens, out = _tokens(cmd), []
    for i, token in enumerate(tokens):
        if token == flag:
            for value in tokens[i + 1 :]:
                if value.startswith("--"):
                    break
                out.append(value)
    return out


def _kvserve_setting(env: dict, cmd: list, name: str) -> str | None:
    """A kvserve setting as the container gets it: its flag, else its KVSERVE_ variable."""
    flag = _values(cmd or [], "--" + name.replace("_", "-"))
    return flag[-1] if flag else env.get("KVSERVE_" + name.upper())


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def _compose_kvserve(services: dict) -> dict:
    return {n: s for n, s in services.items() if _image(s.get("image", "")) == "kvserve"}


def _compose_role(svc: dict) -> str | None:
    return _kvserve_setting(_env(svc), svc.get("command"), "role")


def _k8s_docs() -> list[tuple[str, dict]]:
    return [
        (name, doc)
        for name in K8S_FILES
        for doc in yaml.safe_load_all((K8S / name).read_text())
        if doc
    ]


def _k8s(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] == kind}


def _workloads() -> dict[str, dict]:
    return {**_k8s("Deployment"), **_k8s("StatefulSet")}


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _containers(image: str) -> list[tuple[str, dict]]:
    return [
        (name, c)
        for name, w in _workloads().items()
        for c in _pod(w)["containers"]
        if _image(c["image"]) == image
    ]


def _k8s_env(container: dict) -> dict:
    """name -> value, or the secretKeyRef / configMapKeyRef it comes from."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"].get("secretKeyRef") or e["valueFrom"].get("configMapKeyRef")
            out[e["name"]] = ("ref", ref["name"], ref["key"])
    return out


def _k8s_role(workload: dict) -> str | None:
    (c,) = [c for c in _pod(workload)["containers"] if _image(c["image"]) == "kvserve"]
    return _kvserve_setting(_k8s_env(c), c.get("args", []) + c.get("command", []), "role")


def _selected(service: dict) -> list[str]:
    """The workloads whose pods the Service selects."""
    sel = service["spec"]["selector"]
    return [
        name
        for name, w in _workloads().items()
        if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def _service_for(host: str, port: int) -> tuple[dict, str]:
    """The Service a worker URL names (`svc` or `pod.svc`), checked to expose `port`,
    and the one workload behind it."""
    services = _k8s("Service")
    name = host.split(".")[-1]
    assert name in services, f"{host}: no Service {name}"
    svc = services[name]
    assert port in [p["port"] for p in svc["spec"]["ports"]], (host, port)
    (workload,) = _selected(svc)
    return svc, workload


def _containers_of(workload: dict, image: str) -> list[dict]:
    return [c for c in _pod(workload)["containers"] if _image(c["image"]) == image]


def _router_args(flag: str) -> list[list[str]]:
    """The command lines of the router containers that pass `flag`."""
    return [
        c.get("command", []) + c.get("args", [])
        for w in _workloads().values()
        for c in _containers_of(w, "kvserve-router")
        if flag in _tokens(c.get("command", []) + c.get("args", []))
    ]


# ---- lint and schemas ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", COMPOSE_FILES + [f"k8s/{n}" for n in K8S_FILES])
def test_yamllint_clean(path) -> None:
    from yamllint import config, linter

    conf = config.YamlLintConfig(file=str(DOCKER / ".yamllint"))
    problems = list(linter.run((DOCKER / path).read_text(), conf, str(DOCKER / path)))
    report = [f"{path}:{p.line}:{p.column} {p.desc} ({p.rule})" for p in problems]
    assert not problems, "\n".join(report)


def test_k8s_manifests_found() -> None:
    assert {"secret.yaml", "store.yaml", "disagg.yaml", "replicas.yaml"} <= set(K8S_FILES)
    assert (K8S / "README.md").is_file()


@pytest.mark.parametrize("name", K8S_FILES)
def test_k8s_manifest_validates_against_schemas(name) -> None:
    """Strict: an unknown or misplaced field fails too (schemas ship with the package)."""
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {e.message} at {e.path}")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed")
def test_router_dockerfile_lints_clean() -> None:
    r = subprocess.run(
        [HADOLINT, str(DOCKER / "router.Dockerfile")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_router_image_pins_the_tested_router_and_runs_it_as_non_root() -> None:
    import tomllib

    text = (DOCKER / "router.Dockerfile").read_text()
    pin = re.search(r"pip install [^\n]*\bvllm-router==([\w.]+)", text)
    assert pin, "the router image should pip install a pinned vllm-router"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tested = [d for d in extra["optional-dependencies"]["test"] if d.startswith("vllm-router==")]
    if tested:  # the version the tests exercise is the one the image runs
        assert tested[0] == f"vllm-router=={pin.group(1)}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert '\nENTRYPOINT ["vllm-router"]' in text


# ---- compose -------------------------------------------------------------------------------------


def test_disagg_compose_is_store_router_prefill_decode() -> None:
    services = _compose("compose.disagg.yaml")
    assert set(services) == {"store", "router", "prefill", "decode"}
    assert _compose_role(services["prefill"]) == "prefill"
    assert _compose_role(services["decode"]) == "decode"
    # the store: a cache (no persistence, LRU-bounded)
    store_cmd = _tokens(services["store"]["command"])
    assert _image(services["store"]["image"]) in ("redis", "valkey")
    for flag, value in [
        ("--save", ""),
        ("--appendonly", "no"),
        ("--maxmemory-policy", "allkeys-lru"),
    ]:
        assert store_cmd[store_cmd.index(flag) + 1] == value, flag
    assert "--maxmemory" in store_cmd
    store_port = int(_values(store_cmd, "--port")[0]) if "--port" in store_cmd else 6379
    # both instances use the same store, by its service name, and the same required seed
    urls, seeds = set(), set()
    for name in ("prefill", "decode"):
        svc = services[name]
        env, cmd = _env(svc), svc.get("command")
        url = _kvserve_setting(env, cmd, "kv_store_url")
        assert url and urlsplit(url).scheme == "redis", (name, url)
        assert _host_port(url) == ("store", store_port), url
        urls.add(url)
        seed = _kvserve_setting(env, cmd, "kv_hash_seed")
        assert seed and seed.startswith("${KVSERVE_KV_HASH_SEED:?"), (name, seed)
        seeds.add(seed)
        assert svc["depends_on"]["store"]["condition"] == "service_healthy"
    assert len(urls) == 1 and len(seeds) == 1
    assert services["store"]["healthcheck"]["test"]


def test_disagg_compose_gives_prefill_and_decode_their_own_gpus() -> None:
    services = _compose("compose.disagg.yaml")
    ids = {}
    for name, var, default in [
        ("prefill", "KVSERVE_PREFILL_GPU", "0"),
        ("decode", "KVSERVE_DECODE_GPU", "1"),
    ]:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert device["device_ids"] == [f"${{{var}:-{default}}}"], device
        ids[name] = device["device_ids"][0]
    assert ids["prefill"] != ids["decode"]


def test_replicas_compose_gives_each_replica_its_own_gpu() -> None:
    services = _compose_kvserve(_compose("compose.replicas.yaml"))
    assert len(services) == 3
    ids = []
    for name, svc in services.items():
        assert _compose_role(svc) == "both", name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        ids.append(device["device_ids"][0])
    assert len(set(ids)) == len(ids), ids


@pytest.mark.parametrize("name", ["compose.disagg.yaml", "compose.replicas.yaml"])
def test_compose_only_the_router_is_published_and_waits_for_healthy_workers(name) -> None:
    services = _compose(name)
    assert [n for n, s in services.items() if s.get("ports")] == ["router"]
    router = services["router"]
    assert router["build"]["dockerfile"] == "router.Dockerfile"
    assert (DOCKER / router["build"]["context"] / "router.Dockerfile").is_file()
    (published,) = router["ports"]
    router_port = int(_values(router["command"], "--port")[0])
    assert str(published).split(":")[-1] == str(router_port)
    assert _values(router["command"], "--host") == ["0.0.0.0"]
    workers = _compose_kvserve(services)
    assert workers
    for worker in workers:
        assert router["depends_on"][worker]["condition"] == "service_healthy", worker
    assert f"127.0.0.1:{router_port}/" in " ".join(router["healthcheck"]["test"])


@pytest.mark.parametrize("name", ["compose.disagg.yaml", "compose.replicas.yaml"])
def test_compose_kvserve_services_check_health(name) -> None:
    for svc_name, svc in _compose_kvserve(_compose(name)).items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), svc_name
        (url,) = re.findall(r"https?://[^'\"\s]+", " ".join(test))
        assert url == f"http://127.0.0.1:{KVSERVE_PORT}/health", svc_name
        # the image has python3 but no curl: the probe must not need curl
        assert "curl" not in " ".join(test)
        # the first start compiles kernels: a start period like the image's HEALTHCHECK
        assert svc["healthcheck"]["start_period"] == "900s", svc_name
        assert "/models/${KVSERVE_MODEL_DIR:?" in " ".join(svc["command"])


def test_disagg_compose_router_targets_prefill_and_decode() -> None:
    services = _compose("compose.disagg.yaml")
    cmd = services["router"]["command"]
    assert "--vllm-pd-disaggregation" in _tokens(cmd)
    for flag, role in [("--prefill", "prefill"), ("--decode", "decode")]:
        urls = [u for u in _values(cmd, flag) if "://" in u]  # --prefill URL [BOOTSTRAP_PORT]
        assert urls, flag
        for url in urls:
            host, port = _host_port(url)
            assert host in services and _compose_role(services[host]) == role, url
            assert port == KVSERVE_PORT, url


def test_replicas_compose_router_lists_every_replica() -> None:
    services = _compose("compose.replicas.yaml")
    urls = _values(services["router"]["command"], "--worker-urls")
    assert sorted(_host_port(u) for u in urls) == sorted(
        (name, KVSERVE_PORT) for name in _compose_kvserve(services)
    )


def _interpolate(value: str) -> str:
    """Compose's ${VAR:?msg} / ${VAR:-default} / ${VAR}, with VAR unset: the default or 'x'."""
    return re.sub(
        r"\$\{\w+(?::?-([^}]*)|:?\?[^}]*)?\}",
        lambda m: m.group(1) if m.group(1) is not None else "x",
        str(value),
    )


@pytest.mark.parametrize("name", ["compose.disagg.yaml", "compose.replicas.yaml"])
def test_compose_kvserve_settings_are_ones_kvserve_accepts(name) -> None:
    """Every KVSERVE_* variable names a real setting, and kvserve's own config loader takes the
    service's command and environment (role, store, seed) as given."""
    from server.config import _defaults, load_config

    for svc_name, svc in _compose_kvserve(_compose(name)).items():
        env = {k: _interpolate(v) for k, v in _env(svc).items()}
        unknown = [k for k in env if k.removeprefix("KVSERVE_").lower() not in _defaults()]
        assert not unknown, (svc_name, unknown)
        cfg = load_config([_interpolate(a) for a in svc["command"]], env=env)
        assert cfg.server.role == _compose_role(svc), svc_name
        assert cfg.server.kv_store_url == env.get("KVSERVE_KV_STORE_URL", ""), svc_name
        assert cfg.engine.model.startswith("/models/") and cfg.engine.require_fast_kernels


# ---- Kubernetes ----------------------------------------------------------------------------------


def test_k8s_workload_selectors_match_their_own_pods_only() -> None:
    workloads = _workloads()
    assert workloads
    for name, w in workloads.items():
        sel = w["spec"]["selector"]["matchLabels"]
        for other, o in workloads.items():
            matches = sel.items() <= o["spec"]["template"]["metadata"]["labels"].items()
            assert matches == (other == name), f"{name}'s selector vs {other}'s pods"


def test_k8s_services_select_one_workload_and_its_ports() -> None:
    services = _k8s("Service")
    assert services
    workloads = _workloads()
    for name, svc in services.items():
        selected = _selected(svc)
        assert len(selected) == 1, f"Service {name} selects {selected}"
        containers = _pod(workloads[selected[0]])["containers"]
        ports = [p for c in containers for p in c.get("ports", [])]
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert any(target in (cp.get("name"), cp["containerPort"]) for cp in ports), (
                f"Service {name} port {p['port']} -> {target}: no such container port"
            )


def test_k8s_referenced_secrets_and_configmaps_exist() -> None:
    secrets, configmaps = _k8s("Secret"), _k8s("ConfigMap")
    for name, w in _workloads().items():
        for c in _pod(w)["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    s = secrets.get(ref["name"])
                    assert s, f"{name}: no Secret {ref['name']}"
                    assert ref["key"] in {**s.get("data", {}), **s.get("stringData", {})}
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps, name


def test_k8s_kvserve_containers_probe_health_and_take_one_gpu() -> None:
    containers = _containers("kvserve")
    assert len(containers) >= 3
    for name, c in containers:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet")
            assert get and get["path"] == "/health", (name, probe)
            named = {p.get("name"): p["containerPort"] for p in c["ports"]}
            assert named.get(get["port"], get["port"]) == KVSERVE_PORT, (name, probe)
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 900, name  # kernel compile
        res = c["resources"]
        assert str(res["limits"]["nvidia.com/gpu"]) == "1", name
        assert res["requests"]["cpu"] and res["requests"]["memory"], name
        assert _kvserve_setting(_k8s_env(c), c.get("args", []), "role") in (
            "prefill",
            "decode",
            "both",
        ), name


def test_k8s_kvserve_settings_are_ones_kvserve_accepts() -> None:
    from server.config import _defaults, load_config

    configmaps = _k8s("ConfigMap")
    for name, c in _containers("kvserve"):
        env = {}
        for src in c.get("envFrom", []):
            env.update(configmaps[src["configMapRef"]["name"]]["data"])
        env.update({k: v if isinstance(v, str) else "x" for k, v in _k8s_env(c).items()})
        unknown = [k for k in env if k.removeprefix("KVSERVE_").lower() not in _defaults()]
        assert not unknown, (name, unknown)
        cfg = load_config(c.get("args", []), env=env)
        assert cfg.server.role == env["KVSERVE_ROLE"], name
        assert cfg.engine.model.startswith("/models/") and cfg.engine.require_fast_kernels


def test_k8s_disagg_roles_share_the_store_and_the_seed() -> None:
    workloads = _workloads()
    roles = {name: _k8s_role(w) for name, w in workloads.items() if _containers_of(w, "kvserve")}
    prefill = [n for n, r in roles.items() if r == "prefill"]
    decode = [n for n, r in roles.items() if r == "decode"]
    assert len(prefill) == 1 and len(decode) == 1, roles
    urls, seeds = set(), set()
    for name in prefill + decode:
        (c,) = _containers_of(workloads[name], "kvserve")
        env = _k8s_env(c)
        url = env["KVSERVE_KV_STORE_URL"]
        assert urlsplit(url).scheme == "redis"
        _, store = _service_for(*_host_port(url))
        assert _image(_pod(workloads[store])["containers"][0]["image"]) in ("redis", "valkey")
        urls.add(url)
        seed = env["KVSERVE_KV_HASH_SEED"]
        assert seed[0] == "ref", "the seed comes from a Secret"
        seeds.add(seed)
    assert len(urls) == 1 and len(seeds) == 1, (urls, seeds)


def test_k8s_disagg_router_targets_the_prefill_and_decode_services() -> None:
    workloads = _workloads()
    (args,) = _router_args("--vllm-pd-disaggregation")
    for flag, role in [("--prefill", "prefill"), ("--decode", "decode")]:
        urls = [u for u in _values(args, flag) if "://" in u]
        assert urls, flag
        for url in urls:
            host, port = _host_port(url)
            _, workload = _service_for(host, port)
            assert _k8s_role(workloads[workload]) == role, url


def test_k8s_replicas_router_lists_every_replica() -> None:
    services = _k8s("Service")
    ((sts_name, sts),) = _k8s("StatefulSet").items()
    assert _k8s_role(sts) == "both"
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and _selected(headless) == [sts_name]
    port = headless["spec"]["ports"][0]["port"]
    (args,) = _router_args("--worker-urls")
    urls = _values(args, "--worker-urls")
    expected = [
        f"http://{sts_name}-{i}.{sts['spec']['serviceName']}:{port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert sorted(urls) == expected


def test_k8s_routers_listen_where_they_are_probed_and_declared() -> None:
    routers = _containers("kvserve-router")
    assert len(routers) == 2
    for name, c in routers:
        args = c.get("args", [])
        assert _values(args, "--host") == ["0.0.0.0"], name
        port = int(_values(args, "--port")[0])
        assert port in [p["containerPort"] for p in c["ports"]], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == port, (name, probe)


# ---- the router's own parser ---------------------------------------------------------------------


def _all_router_commands() -> list[tuple[str, list[str]]]:
    out = [(n, [str(a) for a in _compose(n)["router"]["command"]]) for n in ROUTED]
    out += [(name, c.get("args", [])) for name, c in _containers("kvserve-router")]
    return out


@pytest.mark.parametrize("source,args", _all_router_commands())
def test_router_commands_parse_with_vllm_router(source, args) -> None:
    """Each router command is one the pinned vllm-router accepts (flags, policy names)."""
    launch = pytest.importorskip("vllm_router.launch_router")
    try:
        parsed = launch.parse_router_args(args)
    except SystemExit:
        pytest.fail(f"{source}: vllm-router rejects {args}")
    parsed._validate_router_args()
    assert parsed.host == "0.0.0.0" and parsed.prometheus_host == "0.0.0.0", source
    if parsed.vllm_pd_disaggregation:
        assert parsed.prefill_urls and parsed.decode_urls, source
    else:
        assert len(parsed.worker_urls) >= 2, source
