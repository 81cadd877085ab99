# Quartermaster: `make run` for the embedded portal, `make test` for the suite.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml gracetrap/pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)

# Where make run serves the portal.
RUN_BIND ?= 127.0.0.1:8000
TEST_DATABASE_URL ?= postgres://quartermaster:quartermaster@127.0.0.1:5432/quartermaster
TEST_BROKER_URL ?= redis://127.0.0.1:6379/0
# What is tested, benchmarked and shipped is the compiled engine (fairshare/native.py).
TEST_ENV := DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) QM_VAR_DIR=$(CURDIR)/var/test QM_ENGINE=compiled
# The embedded default's database: the pages, the API, the exports and the scheduling
# cycle run a second time on SQLite, as make run serves them (tests/sqlite_settings.py).
SQLITE_TESTS ?= tests/portal/pages tests/portal/api tests/preemption/test_cycle_writes.py \
	tests/preemption/test_cycle_requests.py tests/preemption/test_decide_act.py \
	tests/preemption/test_reconcile_writes.py tests/preemption/test_resize_cycle.py \
	tests/preemption/test_reconcile_collector.py tests/preemption/test_gave_way.py \
	tests/core/test_rows.py tests/e2e \
	--deselect tests/e2e/test_e2e_portal.py::test_gracetrap_wheel_downloads_and_installs_into_a_fresh_venv
SQLITE_TEST_ENV := DATABASE_URL=sqlite:///$(CURDIR)/var/test/sqlite/portal.sqlite3 \
	QM_SQLITE_TEST_NAME=$(CURDIR)/var/test/sqlite/test.sqlite3 QM_VAR_DIR=$(CURDIR)/var/test/sqlite QM_ENGINE=compiled
JUNIT := var/test/junit
# pytest-xdist workers for the PostgreSQL and the SQLite runs. Most tests wait on real
# processes, signals and timers rather than compute, so more workers than cores pay.
TEST_WORKERS ?= 4
SQLITE_TEST_WORKERS ?= 2
BUILD_ENGINE := QM_ENGINE=python $(PY) -c 'from fairshare.native import main; main()'

.PHONY: run test lint bench bench-kueue venv services engine k8s wheel image drill drill-elastic drill-real helm-real clean

$(STAMP): pyproject.toml gracetrap/pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[train,dev]' -e ./gracetrap
	@rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP)

## run: set everything up and serve the portal at http://127.0.0.1:8000 (Ctrl-C stops it all);
## DEBUG stays off (WhiteNoise serves the static files); QM_DEBUG=1 make run turns Django's debug pages on
run: venv
	@bin/runner-user $(PY)
	@$(BUILD_ENGINE) || echo "make run: the engine runs from its Python sources (not compiled, see above)"
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py seed_demo --if-empty
	$(PY) manage.py serve_embedded --bind $(RUN_BIND)

services:
	@bin/test-services

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## engine: compile the fair-share engine with mypyc (a minute; cached by its sources outside the clone)
engine: venv
	@$(BUILD_ENGINE)

## k8s: build the test control plane and Helm from the Go module proxy (cached by version)
k8s: venv
	@bash tools/k8s/build.sh
	@bash tools/k8s/build-kubelet.sh
	@bash tools/k8s/build-coredns.sh
	@bash tools/k8s/build-helm.sh

wheel: venv
	@mkdir -p var/wheels && $(PY) -m pip wheel -q --no-deps --no-build-isolation ./gracetrap -w var/wheels && ls var/wheels

## image: build the Containerfile without a registry (a Debian base from mmdebstrap, buildah's
## layer cache) into an OCI archive for ctr images import, cached by its inputs outside the clone
image: venv
	$(PY) -m tools.k8s.portal_image

## test: set everything up (PostgreSQL, Redis, the Kubernetes control plane) and run the whole suite
test: venv services lint engine k8s
	$(TEST_ENV) $(PY) manage.py makemigrations --check --dry-run
	@rm -rf $(JUNIT) var/test/sqlite && mkdir -p $(JUNIT) var/test/sqlite
	@# Three pytest runs at once, apart (their own databases and QM_VAR_DIRs): the suite on
	@# PostgreSQL on xdist workers, its Kubernetes tests in one process of their own (one
	@# control plane and its nodes per machine), and the SQLite run. The last two print
	@# their output, from their logs, once the first has ended. A PYTEST_ARGS that picks
	@# only Kubernetes tests, or none, leaves one of the PostgreSQL runs nothing to run (5).
	@$(TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider --ignore=tests/smoke -m "k8s and not real_drill and not real_helm" --durations=5 \
		--junitxml=$(JUNIT)/kubernetes.xml $(PYTEST_ARGS) > $(JUNIT)/kubernetes.log 2>&1 & kubernetes=$$!; \
	$(SQLITE_TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider --ds tests.sqlite_settings -n $(SQLITE_TEST_WORKERS) \
		--durations=5 --junitxml=$(JUNIT)/sqlite.xml $(SQLITE_TESTS) > $(JUNIT)/sqlite.log 2>&1 & sqlite=$$!; \
	echo "The Kubernetes tests and the SQLite run go on beside this run (their output follows it)"; \
	$(TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider --ignore=tests/smoke -m "not k8s" -n $(TEST_WORKERS) \
		--junitxml=$(JUNIT)/postgresql.xml $(PYTEST_ARGS); postgresql=$$?; \
	wait $$kubernetes; kubernetes=$$?; wait $$sqlite; sqlite=$$?; \
	test $$postgresql = 5 && postgresql=0; test $$kubernetes = 5 && kubernetes=0; \
	echo "== the Kubernetes tests on PostgreSQL (-m k8s), from $(JUNIT)/kubernetes.log"; \
	cat $(JUNIT)/kubernetes.log; \
	echo "== the SQLite run (--ds tests.sqlite_settings), from $(JUNIT)/sqlite.log"; \
	cat $(JUNIT)/sqlite.log; \
	test $$postgresql = 0 && test $$kubernetes = 0 && test $$sqlite = 0
	QM_VAR_DIR=$(CURDIR)/var/test/smoke $(VENV)/bin/pytest -p no:cacheprovider --durations=0 --junitxml=$(JUNIT)/make-run.xml tests/smoke
	@$(PY) tools/test_totals.py $(JUNIT)/postgresql.xml $(JUNIT)/kubernetes.xml $(JUNIT)/sqlite.xml $(JUNIT)/make-run.xml

## bench: print the benchmarks' figures
bench: export QM_ENGINE := compiled
bench: venv services engine k8s
	$(PY) bench/bench_fairshare.py
	$(PY) bench/bench_gracetrap.py
	$(PY) bench/bench_simulation.py
	DATABASE_URL=$(TEST_DATABASE_URL) $(PY) bench/bench_pages.py
	DATABASE_URL=$(TEST_DATABASE_URL) $(PY) bench/bench_cycle.py
	$(PY) bench/bench_submit.py
	$(PY) bench/bench_k8s.py
	$(PY) bench/bench_sandbox.py
	@# On two real nodes: the portal's image built and installed with Helm, then the drill
	@# with and without the notice; each a test that prints its figures (about 15 minutes).
	$(MAKE) --no-print-directory helm-real drill-real

## bench-kueue: Kueue's own scalability test (built from the Go module proxy) and Quartermaster
## on the same generator config, in one run, as one side-by-side table (bench/README.md);
## KUEUE_CONFIG=tas (the topology-aware one) or KUEUE_CONFIG=path/to/generator.yaml picks another
## config; KUEUE_ARGS passes more options (--no-reclaim, --scale 0.2: both sides on the same scaled copy)
KUEUE_CONFIG ?= baseline
KUEUE_ARGS ?=
bench-kueue: venv services engine k8s
	@bash tools/kueue/build.sh
	$(TEST_ENV) $(PY) bench/bench_kueue.py --config $(KUEUE_CONFIG) $(KUEUE_ARGS)

## drill-real: the drill on two real nodes, with and without the checkpoint notice
## (tests/k8s/realnodes/test_real_drill.py; about 10 minutes, so make test leaves it out
## and make bench runs it), printing its figures
drill-real: venv services engine k8s
	$(TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider -m real_drill -s tests/k8s/realnodes/test_real_drill.py

drill: venv engine
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py drill --ranks 16 --notice both --json var/drill.json

## drill-elastic: an elastic job shrunk by a reclaim and grown back, checked sample for sample
drill-elastic: venv engine
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py drill --elastic --ranks 8 --json var/drill-elastic.json

clean:
	rm -rf var/test var/runs var/broker

## helm-real: the portal image built here and the chart installed on two real nodes, one
## job preempted and resumed through the installed portal (tests/k8s/realnodes/
## test_real_helm_install.py; about 4 minutes). make test leaves it out: its image build
## and pods beside the PostgreSQL run took make test from about 25 to 31 minutes.
helm-real: venv services engine k8s
	$(TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider -m real_helm -s tests/k8s/realnodes/test_real_helm_install.py
