#!/bin/sh
# Run the suite where no packet can leave loopback: inside a fresh network namespace that
# has only `lo` (needs root and util-linux's unshare). Everything is installed beforehand,
# since the namespace has no route to the package registries either.
set -u
VENV=${VENV:-.venv}
# Style first (seconds): one format, one rule set (pyproject.toml [tool.ruff]).
"$VENV/bin/ruff" format --check agent tests scripts || exit 1
"$VENV/bin/ruff" check agent tests scripts || exit 1
# Two workers (pytest-xdist), a test module or the compiling modules to each unit of work:
# tests/conftest.py says why. TEST_WORKERS=0 runs the suite in one process.
PYTEST="$VENV/bin/python -m pytest -ra --durations=25 -p no:cacheprovider -n ${TEST_WORKERS:-2} --dist loadscope --no-loadscope-reorder $*"
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  echo "running tests in a loopback-only network namespace"
  exec unshare -n sh -c "ip link set lo up && $PYTEST"
fi
# Without a namespace, ICE is still pinned to 127.0.0.1 by tests/conftest.py and the server
# drops remote candidates outside 127.0.0.0/8 (agent/transport/ice.py).
echo "warning: not root or no unshare; running without a network namespace" >&2
exec $PYTEST
