# Every target does its own set-up: a virtualenv in .venv with the project installed
# (re-installed when pyproject.toml changes), Debian's PostgreSQL and the Kafka/Spark jars.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: help setup demo test lint typecheck pytest up down status clean bench-write bench-relay \
	bench-reconcile bench-table-health bench-consume bench-wal-probe chaos

help:
	@echo "make demo   run the outbox end to end on a local PostgreSQL + Kafka + Spark"
	@echo "make test   lint, type-check and run every test against the real servers"
	@echo "make up / make down / make status   the long-running local stack ('dev')"
	@echo "make dist   build the sdist and the wheel into dist/ (DIST_DIR=...)"
	@echo "make bench-write   write-path benchmark (BENCH_ARGS='--n 10000')"
	@echo "make bench-relay   relay benchmark (BENCH_ARGS='--n 100000' for a quick run)"
	@echo "make bench-reconcile   reconciliation benchmark (BENCH_ARGS='--sizes 100000,300000')"
	@echo "make bench-table-health   plain and partitioned outbox tables under steady load with retention running (BENCH_ARGS='--messages 300000')"
	@echo "make bench-consume   inbox consumer benchmark (BENCH_ARGS='--n 20000' for a quick run)"
	@echo "make bench-wal-probe   WAL-mode probes: write shapes and decoders (BENCH_ARGS='--messages 50000')"
	@echo "make chaos   a bounded fault run audited by the reconciliation (CHAOS_ARGS='--mode exactly-once')"

$(INSTALLED): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark]'
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(INSTALLED)
	$(BIN)/outbox dev prepare

demo: setup
	$(BIN)/python examples/demo.py

test: setup lint typecheck pytest

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# examples/ lies outside the package [tool.mypy] names, so it gets a run of its own.
typecheck: $(INSTALLED)
	$(BIN)/mypy
	$(BIN)/mypy examples

# The tests run on TEST_WORKERS parallel workers (pytest-xdist), each with a stack of its own:
# most of their time is spent waiting on servers, sleeps and timeouts. Tests marked `serial`
# assert wall-clock bounds and run afterwards, alone (exit code 5: PYTEST_ARGS chose none).
# PYTHONHASHSEED fixed: the relay's model test replays a failing seed exactly.
TEST_WORKERS ?= 4
pytest: $(INSTALLED)
	PYTHONHASHSEED=0 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not serial" --durations=20 $(PYTEST_ARGS)
	PYTHONHASHSEED=0 $(BIN)/pytest -m serial $(PYTEST_ARGS) || test $$? -eq 5

bench-write: setup
	$(BIN)/python -m bench.write_path $(BENCH_ARGS)

bench-relay: setup
	$(BIN)/python -m bench.relay_throughput $(BENCH_ARGS)

bench-reconcile: setup
	$(BIN)/python -m bench.reconcile $(BENCH_ARGS)

bench-table-health: setup
	$(BIN)/python -m bench.table_health $(BENCH_ARGS)

bench-consume: setup
	$(BIN)/python -m bench.consume $(BENCH_ARGS)

bench-wal-probe: setup
	$(BIN)/python -m bench.wal_probe $(BENCH_ARGS)

# The sdist, and the wheel built from it, as a release is (PEP 517, isolated). The sdist also
# carries examples/, docs/ and CHANGELOG.md (MANIFEST.in). Needs only Python: `build` goes
# into a virtualenv of its own (.venv-build), not the development set-up.
DIST_DIR ?= dist
BUILD_VENV := .venv-build
.PHONY: dist
dist:
	@test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	@$(BUILD_VENV)/bin/python -m pip install -q --disable-pip-version-check "build>=1.2"
	$(BUILD_VENV)/bin/python -m build --outdir $(DIST_DIR) .

chaos: setup
	$(BIN)/outbox chaos $(CHAOS_ARGS)

up: setup
	$(BIN)/outbox dev up

down: $(INSTALLED)
	$(BIN)/outbox dev down

status: $(INSTALLED)
	$(BIN)/outbox dev status

clean: down
	rm -rf .stack $(VENV)
