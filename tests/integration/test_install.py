"""A non-editable install of the project serves the page: the web files ship inside the wheel.

Pins: a wheel built from the project's sources holds every file under agent/web/; installed
(not editable) into a fresh virtual environment, its `omni-agent serve`, run from a folder
outside the repository, imports `agent` from that environment (not from the checkout) and
answers GET / with the page, client.js next to it (as JavaScript: the page loads it as an ES module), and /readyz 200 once the (tiny) model
is loaded.

Nothing is downloaded: the wheel is built with --no-build-isolation from this environment's
setuptools, and the fresh environment sees this one's packages (torch, aiohttp, ...) through a
.pth path line, which adds the folder to sys.path without running the .pth files inside it (so
the checkout's editable-install hook does not come along).
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest
from support.loopback import free_port, serve_args

from agent.client.client import NotReady, wait_ready

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "agent" / "web"


def _run(*cmd: str | Path, cwd: Path, timeout: float = 120) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_clean_env(cwd)
    )
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _clean_env(home: Path) -> dict[str, str]:
    # No PYTHONPATH (it could point at the checkout), caches in the test's own folder.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMNI_AGENT_CACHE=str(home / "cache"), OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    return env


def _build_wheel(tmp: Path) -> Path:
    """A wheel of the project, built from a copy of its sources (a build in the checkout would
    leave build/ and egg-info behind in the working tree)."""
    src = tmp / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "agent", src / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        dist,
        src,
        cwd=tmp,
        timeout=180,
    )
    (wheel,) = dist.glob("omni_agent-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel installed (no deps) and this environment's
    packages visible behind it. Returns its bin/ folder."""
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    # Sorted after the venv's own site-packages (a .pth appends): the installed `agent` wins.
    Path(purelib, "zz_project_deps.pth").write_text("\n".join(ours) + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    return venv / "bin"


async def test_a_wheel_install_serves_the_page(tiny_model_dir: Path, tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("agent/web/")}
    expected = {f"agent/web/{p.relative_to(WEB).as_posix()}" for p in WEB.rglob("*") if p.is_file()}
    assert expected and shipped == expected, f"web files missing from the wheel: {sorted(expected - shipped)}"

    bin_dir = _fresh_venv(tmp_path, wheel)
    outside = tmp_path / "elsewhere"  # the working directory: no agent/ package here
    outside.mkdir()
    where = _run(bin_dir / "python", "-c", "import agent, sys; print(agent.__file__); print(sys.prefix)", cwd=outside)
    module_file, prefix = where.split()
    assert Path(module_file).is_relative_to(tmp_path / "venv"), f"agent imported from {module_file}"
    assert not Path(module_file).is_relative_to(REPO) and Path(prefix) == tmp_path / "venv"

    port = free_port()
    log = tmp_path / "agent.log"  # a file, not a pipe nobody reads: a full pipe would stall the agent
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(bin_dir / "omni-agent"),
                *serve_args(port, tiny_model_dir),
            ],
            cwd=outside,
            env=_clean_env(outside),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            await wait_ready(url, timeout_s=90, proc=proc)  # a fresh process loads torch and the model
        except NotReady as exc:
            pytest.fail(f"{exc}: {log.read_text(errors='replace')[-3000:]}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"{url}/") as resp:
                assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
                assert await resp.text() == (WEB / "index.html").read_text()
            async with http.get(f"{url}/client.js") as resp:
                assert resp.status == 200 and await resp.read() == (WEB / "client.js").read_bytes()
                # index.html loads client.js as an ES module: the browser refuses any non-JS MIME type.
                assert resp.content_type in ("text/javascript", "application/javascript"), resp.content_type
            async with http.get(f"{url}/readyz") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
