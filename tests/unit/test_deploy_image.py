"""The container image and the KubeRay manifest agree with the project, as far as a file can say.

Docker cannot build here (no registry to pull the base from), so this pins what can be read:
- deploy/Dockerfile runs as a non-root numeric user, installs torch at the project's pin from
  PyTorch's index before the project, then the project not editable with its `gpu` and `serve`
  extras, puts HF_HOME and OMNI_AGENT_CACHE under a declared volume, and starts
  `omni-agent serve --host 0.0.0.0`; .dockerignore keeps what it copies in the build context;
- deploy/kuberay/rayservice.yaml names the image by the project's version (never `latest`),
  mounts a PersistentVolumeClaim it defines where the image's HF_HOME lies on every GPU worker,
  and gives the worker startup, readiness and liveness probes: startup and readiness on the
  agent's /readyz through the node's Serve proxy port (a route the app really serves), a
  generous startup window, and liveness on the Ray node's own health, not through the proxy
  (the manifest says why: Serve removes a node's proxy while its replica drains calls).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path, PurePosixPath

import yaml

from agent.config import Config
from agent.server import create_app

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's machines run 3.11+
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in _instructions():
        if word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def _manifest() -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    return by_kind["RayService"], by_kind.get("PersistentVolumeClaim", {})


def _app_get_paths() -> set[str]:
    app = create_app(Config(), engine=None)  # routes only: the engine is touched at startup
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET"}


def test_the_image_runs_as_a_non_root_user() -> None:
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {users[-1]}: numeric and not root (runAsNonRoot checks it)"


def test_the_image_installs_cuda_torch_first_then_the_project_with_gpu_and_serve() -> None:
    runs = [rest for word, rest in _instructions() if word == "RUN"]
    pin = next(d for d in _project()["dependencies"] if d.startswith("torch"))
    torch_at = next(i for i, r in enumerate(runs) if f"pip install {pin}" in r)
    assert "--index-url" in runs[torch_at] and "download.pytorch.org/whl/cu" in DOCKERFILE.read_text()
    project_at = next(i for i, r in enumerate(runs) if re.search(r"pip install \"?/tmp/src\[", r))
    assert torch_at < project_at
    extras = set(re.search(r"/tmp/src\[([^\]]*)\]", runs[project_at]).group(1).split(","))
    assert {"gpu", "serve"} <= extras and "test" not in extras
    assert extras <= set(_project()["optional-dependencies"])
    assert " -e " not in runs[project_at], "the image installs the project, not an editable checkout"


def test_the_gpu_extra_compiles_nothing() -> None:
    # flash-attn has no wheel on PyPI (only an sdist that needs nvcc): it must stay optional.
    gpu = _project()["optional-dependencies"]["gpu"]
    assert not any(d.replace("_", "-").startswith("flash-attn") for d in gpu), gpu


def test_the_caches_lie_in_a_volume_and_the_entrypoint_serves_on_all_interfaces() -> None:
    env = _env()
    volumes = [v for word, rest in _instructions() if word == "VOLUME" for v in yaml.safe_load(rest)]
    for key in ("HF_HOME", "OMNI_AGENT_CACHE"):
        assert any(PurePosixPath(env[key]).is_relative_to(v) for v in volumes), (key, env[key], volumes)
    (entrypoint,) = [yaml.safe_load(rest) for word, rest in _instructions() if word == "ENTRYPOINT"]
    (cmd,) = [yaml.safe_load(rest) for word, rest in _instructions() if word == "CMD"]
    argv = entrypoint + cmd
    assert argv[:2] == ["omni-agent", "serve"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    exposed = {p for word, rest in _instructions() if word == "EXPOSE" for p in rest.split()}
    assert argv[argv.index("--port") + 1] in exposed


def test_dockerignore_keeps_what_the_image_copies() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = {shlex.split(rest)[0].rstrip("/") for word, rest in _instructions() if word == "COPY"}
    assert copied == {"pyproject.toml", "agent"}
    if "*" in lines:  # everything ignored, then the copied paths let back in
        assert {f"!{c}" for c in copied} <= {line.rstrip("/") for line in lines}
    assert ".venv" in lines or "*" in lines


def test_the_manifest_pins_the_image_to_the_project_version() -> None:
    service, _ = _manifest()
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    images = {c["image"] for pod in pods for c in pod["containers"]}
    assert images == {f"omni-agent:{_project()['version']}"}, images


def test_every_gpu_worker_mounts_the_model_cache_where_hf_home_points() -> None:
    service, claim = _manifest()
    assert claim, "the manifest defines the model cache's PersistentVolumeClaim"
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every GPU node mounts it
    hf_home = PurePosixPath(_env()["HF_HOME"])
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        (container,) = pod["containers"]
        mounts = [m for m in container["volumeMounts"] if claims.get(m["name"]) == claim["metadata"]["name"]]
        assert any(hf_home.is_relative_to(m["mountPath"]) for m in mounts), (hf_home, mounts)
        assert pod["securityContext"]["fsGroup"] == 1000  # the image's user may write it


def test_the_gpu_workers_probes() -> None:
    service, _ = _manifest()
    serve_port = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"]
    served = _app_get_paths()
    assert {"/livez", "/readyz", "/healthz"} <= served
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        startup, ready, live = (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
        for probe in (startup, ready):
            assert probe["httpGet"]["path"] == "/readyz" and probe["httpGet"]["port"] == serve_port
        # A model load takes minutes (first start: a ~66 GiB download too): at least 30 allowed.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
        # Liveness must not go through the proxy, which Serve removes while the node's replica drains.
        assert live["httpGet"]["port"] != serve_port
        assert live["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}
