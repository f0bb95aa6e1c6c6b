# Two commands on a fresh machine: `make run` serves the agent, `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# apt needs root; use sudo when we are not root and it exists.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)

.PHONY: run test install system-deps bench-engine

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 resolves to the CPU wheel on this kind of machine (see pyproject.toml).
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/omni-agent serve $(ARGS)

# Debian packages the tests drive: Chromium (browser test), espeak-ng (spoken WAVs),
# sox (the browser's fake-capture WAV), promtool from prometheus (alert rules check).
system-deps:
	@need=""; \
	command -v chromium >/dev/null || need="$$need chromium"; \
	command -v espeak-ng >/dev/null || need="$$need espeak-ng"; \
	command -v promtool >/dev/null || need="$$need prometheus"; \
	command -v sox >/dev/null || need="$$need sox"; \
	if [ -n "$$need" ]; then \
	  echo "installing:$$need"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$need; \
	fi

test: $(STAMP) system-deps
	VENV=$(VENV) sh scripts/run_tests.sh $(ARGS)

bench-engine: $(STAMP)
	$(PY) scripts/bench_engine.py $(ARGS)
