# rayspeed: every target sets up .venv on first use (make setup is idempotent and fast when done).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/tiny-cpu.yaml
ARGS ?=
RAY_NUM_CPUS ?= 8
MLFLOW_PORT ?= 5000
MLFLOW_UI_PORT ?= 5001
SERVICES := $(CURDIR)/.services
# Where the job was launched from: `ray job submit --working-dir` runs the driver from a temporary copy.
export RAYSPEED_HOME := $(CURDIR)
export PATH := $(BIN):$(PATH)

.PHONY: setup examples lint train test test-unit test-slow test-multinode up down submit plan mlflow-ui bench retrain schedule unschedule clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,eval]'
	@touch $@

setup: $(STAMP)

# The shipped examples' prepared inputs (made here, nothing is downloaded), in runs/examples/. A job file that reads
# from runs/examples/ gets them made first by `make train` and `make submit`.
EXAMPLE_INPUTS := runs/examples/tiny-chat/.made runs/examples/tiny-llama/.made runs/examples/tiny-sum/.made \
	runs/examples/tiny-vision/.made
examples: $(EXAMPLE_INPUTS)
runs/examples/tiny-llama/.made: scripts/make_tiny_hf_model.py $(STAMP)
	$(BIN)/python scripts/make_tiny_hf_model.py runs/examples/tiny-llama --tokenizer
	@touch $@
runs/examples/tiny-chat/.made: scripts/make_tiny_chat_model.py $(STAMP)
	$(BIN)/python scripts/make_tiny_chat_model.py runs/examples/tiny-chat
	@touch $@
runs/examples/tiny-sum/.made: scripts/make_tiny_sum_model.py $(STAMP)
	$(BIN)/python scripts/make_tiny_sum_model.py runs/examples/tiny-sum
	@touch $@
runs/examples/tiny-vision/.made: scripts/make_tiny_vision_model.py $(STAMP)
	$(BIN)/python scripts/make_tiny_vision_model.py runs/examples/tiny-vision
	@touch $@
# Read by make itself, never through a shell: CONFIG is the user's text (see the scheduling targets below).
NEEDS_EXAMPLES = $(if $(wildcard $(value CONFIG)/.),,$(if $(findstring runs/examples/,$(file <$(value CONFIG))),examples))

train: setup $(NEEDS_EXAMPLES)
	$(BIN)/python jobs/train.py --config $(CONFIG) $(ARGS)

# The habits of a kept codebase: lint and import order, the layering contract, types of the pure-Python core.
lint: setup
	$(BIN)/ruff check platform jobs scripts tests
	cd platform && $(BIN)/lint-imports --config ../pyproject.toml
	$(BIN)/mypy

# Test modules run in TEST_WORKERS processes (pytest-xdist), a module's tests together in one: a Ray job's test
# waits on process starts and failure detection much of its time (37% of the CPU idle over a serial `make test`),
# which the other process fills (make test and make test-slow). Set TEST_WORKERS=0 to run in this process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: lint
	$(BIN)/python -m pytest -q --durations=15 $(XDIST) -m "not slow" --ignore=tests/train/test_multinode.py tests

# The fast inner loop: no lint, no Ray Train runs (tests marked ray), no drills.
test-unit: setup
	$(BIN)/python -m pytest -q -m "not slow and not ray" --ignore=tests/train/test_multinode.py tests

# Heavier end-to-end drills (kill points and kill drills, elastic node loss, tracking outage); CI runs them after `make test`.
test-slow: setup
	$(BIN)/python -m pytest -q --durations=15 $(XDIST) -m slow --ignore=tests/train/test_multinode.py tests

# The multi-host drill (CI runs it after `make test`): three Ray nodes in network namespaces (root, ip netns).
test-multinode: setup
	$(BIN)/python -m pytest -q -s tests/train/test_multinode.py

plan: setup
	$(BIN)/rayspeed plan $(CONFIG) $(ARGS)

# Local Ray head (token auth, dashboard and Jobs API on 127.0.0.1:8265) and an MLflow server on
# 127.0.0.1:$(MLFLOW_PORT) (SQLite backend, artifacts on disk). `make down` stops exactly these two.
up: setup
	@mkdir -p $(SERVICES)/mlflow
	@if [ -f $(SERVICES)/ray.pid ] && kill -0 $$(cat $(SERVICES)/ray.pid) 2>/dev/null; then echo "ray head already up"; else \
	  RAY_AUTH_MODE=token setsid $(BIN)/ray start --head --block --dashboard-host 127.0.0.1 --dashboard-port 8265 \
	    --dashboard-agent-listen-port $$($(BIN)/python scripts/wait_services.py --free-port) \
	    --num-cpus $(RAY_NUM_CPUS) --disable-usage-stats > $(SERVICES)/ray.log 2>&1 & echo $$! > $(SERVICES)/ray.pid; fi
	@if [ -f $(SERVICES)/mlflow.pid ] && kill -0 $$(cat $(SERVICES)/mlflow.pid) 2>/dev/null; then echo "mlflow server already up"; else \
	  setsid $(BIN)/mlflow server --host 127.0.0.1 --port $(MLFLOW_PORT) \
	    --backend-store-uri sqlite:///$(SERVICES)/mlflow/mlflow.db --artifacts-destination $(SERVICES)/mlflow/artifacts \
	    > $(SERVICES)/mlflow.log 2>&1 & echo $$! > $(SERVICES)/mlflow.pid; fi
	@$(BIN)/python scripts/wait_services.py --ray http://127.0.0.1:8265 --mlflow http://127.0.0.1:$(MLFLOW_PORT) --timeout 120
	@echo "Ray dashboard/Jobs API: http://127.0.0.1:8265 (token auth)   MLflow: http://127.0.0.1:$(MLFLOW_PORT)"

down:
	@for s in ray mlflow; do \
	  if [ -f $(SERVICES)/$$s.pid ]; then pid=$$(cat $(SERVICES)/$$s.pid); \
	    kill -TERM -- -$$pid 2>/dev/null || kill -TERM $$pid 2>/dev/null; \
	    for i in $$(seq 1 60); do kill -0 $$pid 2>/dev/null || break; sleep 0.5; done; \
	    kill -KILL -- -$$pid 2>/dev/null; rm -f $(SERVICES)/$$s.pid; echo "stopped $$s"; fi; done

# The working-dir copy has no .git: the commit travels to the run's mlflow.source.git.commit tag as an env var.
GIT_COMMIT = $(shell git rev-parse HEAD 2>/dev/null)
submit: setup $(NEEDS_EXAMPLES)
	RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265 $(BIN)/ray job submit --working-dir . \
	  --runtime-env-json '{"env_vars": {"MLFLOW_TRACKING_URI": "http://127.0.0.1:$(MLFLOW_PORT)", "RAYSPEED_HOME": "$(CURDIR)", "RAYSPEED_GIT_COMMIT": "$(GIT_COMMIT)"}, "excludes": [".venv", "runs", "mlartifacts", ".services", "mlflow.db", ".git"]}' \
	  -- python jobs/train.py --config $(CONFIG) $(ARGS)

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(MLFLOW_UI_PORT)

bench: setup
	$(BIN)/python scripts/bench.py

# The values of the scheduling targets reach rayspeed through the environment, unexpanded ($(value ...)): neither
# make nor bash ever parses CRON, CONFIG, ARGS or RETRAIN_LOG (a cron line is installed from them), rayspeed
# validates them, and ARGS is split like a shell would split it, without running anything (`--args`).
# One retraining cycle (warm start from the champion, train, evaluate, register, promote on improvement).
# `rayspeed retrain` exits 0 promoted, 3 skipped, 4 rejected, 1 failed, 2 bad input (make reports it as "Error N").
retrain schedule unschedule: export RAYSPEED_MAKE_CONFIG = $(value CONFIG)
retrain schedule: export RAYSPEED_MAKE_ARGS = $(value ARGS)
retrain: setup
	$(BIN)/rayspeed retrain --config "$$RAYSPEED_MAKE_CONFIG" --args="$$RAYSPEED_MAKE_ARGS"

# One crontab line (marker "# rayspeed-retrain <repo>:<config>") running `make retrain`, logs to runs/retrain.log.
# Idempotent: re-running replaces the line for this repo + config. DRY_RUN=1 prints it only.
CRON ?=
DRY_RUN ?=
RETRAIN_LOG ?= runs/retrain.log
schedule: export RAYSPEED_MAKE_CRON = $(value CRON)
schedule: export RAYSPEED_MAKE_LOG = $(value RETRAIN_LOG)
schedule: setup
	@$(BIN)/rayspeed schedule install --cron "$$RAYSPEED_MAKE_CRON" --config "$$RAYSPEED_MAKE_CONFIG" \
	  --repo "$(CURDIR)" --log "$$RAYSPEED_MAKE_LOG" --args="$$RAYSPEED_MAKE_ARGS" \
	  $(if $(filter 1 yes true,$(value DRY_RUN)),--dry-run)

# Removes this repository's rayspeed-retrain lines (only CONFIG's when CONFIG is given on the command line).
unschedule: setup
	@$(BIN)/rayspeed schedule remove --repo "$(CURDIR)" \
	  $(if $(filter command line,$(origin CONFIG)),--config "$$RAYSPEED_MAKE_CONFIG") \
	  $(if $(filter 1 yes true,$(value DRY_RUN)),--dry-run)

clean:
	rm -rf runs mlartifacts mlflow.db .pytest_cache
