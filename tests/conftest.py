"""Shared fixtures: loopback-only ICE, a spoken WAV made with espeak-ng, the tiny checkpoint; and how
the suite splits over its two xdist workers. Shared helpers (not fixtures) live in tests/support/."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# `make test` runs two xdist workers (scripts/run_tests.sh: -n 2 --dist loadscope
# --no-loadscope-reorder). The inductor compiles are one core's work for about ten minutes, while
# the real-time tests mostly wait on paced media (they used 81% of one core); side by side on this
# 2-core machine the suite took 16 min 36 s, against 23 min 07 s in one process (same day).
# - Each test module is one unit of work, so that its module-scoped agent starts once.
# - The modules that compile the engine's steps share one unit: they run in one worker, one after
#   another, and each later compile is a hit in the inductor cache the first one filled (the
#   `compiled_options` fixture).
# - Units are handed out in collection order, longest first: the compiles, then the long call
#   loops; the short modules fill in around them.
COMPILING = (
    "tests/unit/test_compiled.py",
    "tests/unit/test_gemv.py",
    "tests/unit/test_streaming_exact.py",
    "tests/unit/test_sampling_exact.py",
    "tests/unit/test_quantized.py",
)
LONG = (
    "tests/integration/test_call_leaks.py",
    "tests/integration/test_ray_serve.py",
    "tests/integration/test_real_checkpoint.py",
)


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = COMPILING + LONG
    items.sort(key=lambda item: first.index(_module(item.nodeid)) if _module(item.nodeid) in first else len(first))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "compile" if module in COMPILING else module

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def loopback_ice():
    # Every test peer gathers 127.0.0.1 only: no packet may leave loopback. The lent GPU machine
    # runs the `-m gpu` tests without aiortc installed: no peer can exist there, nothing to pin.
    if importlib.util.find_spec("aiortc") is None and os.environ.get("CI") != "true":
        yield
        return
    from agent.transport.consent import install_consent_freshness
    from agent.transport.ice import restrict_ice_hosts

    restrict_ice_hosts(["127.0.0.1"])
    install_consent_freshness()  # the test peers made with a bare RTCPeerConnection, too
    yield


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory) -> Path:
    """About 1.5 s of English speech, 16 kHz mono, with 0.3 s of lead-in silence."""
    import numpy as np
    from support.speech import espeak_at, write_wav

    out = tmp_path_factory.mktemp("speech") / "hello.wav"
    # espeak-ng speaks at 22.05 kHz: linear resample to 16 kHz is plenty for VAD and the tiny model.
    pcm16 = espeak_at("Hello agent, what do you see?", out.with_name("raw.wav"), 16000)
    lead = np.zeros(int(0.3 * 16000))
    return write_wav(out, np.concatenate([lead, pcm16]), 16000)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni written with save_pretrained, built once per test session."""
    from agent.engine.checkpoints.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("model") / "tiny-qwen3-omni")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    """The tiny model loaded the real way (from_pretrained), once per test module."""
    import torch

    from agent.engine.checkpoints.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_model_dir))


@pytest.fixture
def eager_to_end(loaded):
    """Make the thinker want <|im_end|> at every step (the 1-token reply seen in the field)."""
    im_end = loaded.ids.im_end

    def push_eos(module, args, logits):
        logits = logits.clone()
        logits[..., im_end] += 1e4
        return logits

    handle = loaded.model.thinker.lm_head.register_forward_hook(push_eos)
    yield
    handle.remove()


@pytest.fixture(scope="session")
def compiled_options(tmp_path_factory) -> dict:
    """StreamingRunner options for the compiled per-frame path on CPU, shared by every test that
    compiles: one inductor cache for the session and the same shapes (slots, context), so that
    a step compiled by one test is an on-disk cache hit for the next."""
    from agent.engine.compile.wiring import GraphConfig

    # OMNI_AGENT_TEST_COMPILE_CACHE keeps the cache across runs (a developer's re-runs: seconds).
    cache = os.environ.get("OMNI_AGENT_TEST_COMPILE_CACHE") or tmp_path_factory.mktemp("inductor")
    return {
        "graphs": GraphConfig(mode="off", compile="on", compile_cache=Path(cache)),
        "max_sessions": 16,
        "context_limit": 1024,
    }
