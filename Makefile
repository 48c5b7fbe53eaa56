# The two commands of the README.  Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean serve-cpu

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --no-cache-dir --upgrade pip
	# --no-cache-dir: SGLang's wheels are ~5 GB; keeping a second copy in pip's cache can fill a small disk
	$(BIN)/python -m pip install --no-cache-dir -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/xshare-sglang demo

# SGLang's real server on this machine's CPU: the shipped tiny MoE model, pruned by xshare, on port 30000
serve-cpu: $(STAMP)
	$(BIN)/python -m xshare_sglang.testing.cpu_server --port 30000 --enable-metrics \
		--moe-pruner xshare --moe-pruner-k0 1 --moe-pruner-budget 4 --moe-pruner-log-interval 10

# One pytest worker per core (at most 4); the tests that start CPU servers (tests/test_live_*.py) run
# in one worker (tests/conftest.py), so no two servers share the cores.  TEST_WORKERS=0 runs in one process.
# At the end pytest prints where the time went (the slowest tests, per module, per worker) and writes it
# to .pytest_cache/time-report.json (tests/time_report.py).
TEST_WORKERS ?= auto
test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --time-report .pytest_cache/time-report.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
