# The two commands of the README: `make demo` and `make test`. Each sets up .venv first, from
# requirements.lock: every dependency at an exact version with its hashes, installed without
# resolution (--no-deps), so a fresh machine gets what CI tested. torch is the one package
# outside the lock: where python3 already has torch (a GPU machine) the venv uses that torch;
# elsewhere it installs torch==2.13.0, which on our CPU machines is a local CPU-only wheel (an
# unpinned torch would pull gigabytes of CUDA wheels). torch's own dependencies are locked.
# `make lock` refreshes the lock (uv pip compile, from pyproject.toml's ranges).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements.lock
CPU_TORCH := torch==2.13.0
# The lock is resolved against the CPU torch wheel (its dependencies carry no CUDA packages).
TORCH_WHEELS ?= /opt/wheels
LOCK_TORCH := torch==2.13.0+cpu
PIP := $(BIN)/pip install -q --disable-pip-version-check

.PHONY: demo test test-latest lock test-gpu gpu-wheels gpu-campaign bench-pipeline bench-switch bench-cycles bench-colocate bench-scheduler bench-serve sim-salus sim-serving clean

$(STAMP): pyproject.toml $(LOCK) Makefile
	rm -rf $(VENV)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "using the torch of $(PY)"; $(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV); \
	fi
	$(PIP) --require-hashes --no-deps -r $(LOCK)
	@if ! $(BIN)/python -c "import torch" >/dev/null 2>&1; then $(PIP) --no-deps "$(CPU_TORCH)"; fi
	$(PIP) --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	@touch $(STAMP)

# Refresh requirements.lock from pyproject.toml's ranges: the newest release of everything
# within them today. Commit the result after `make test` passes on it.
lock: $(STAMP)
	echo "$(LOCK_TORCH)" > $(VENV)/lock-torch.txt
	$(BIN)/uv pip compile pyproject.toml --extra dev --extra llm --generate-hashes --python-version 3.11 \
		--find-links $(TORCH_WHEELS) -c $(VENV)/lock-torch.txt --no-emit-package torch \
		--custom-compile-command "make lock" -o $(LOCK)

demo: $(STAMP)
	@$(BIN)/timeshare demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest

test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests/gpu -m cuda

# The GPU campaign (src/timeshare/bench/campaign.py): steps of a few minutes each, every one
# under its own time limit; results under bench/results/<device>/. It runs on the python3 that
# has CUDA torch (GPU machines have no package index), with the project from src/.
# make gpu-campaign STEP=tests,link   runs those steps only.
gpu-campaign:
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then \
		PYTHONPATH=src $(PY) -m timeshare.bench.campaign $(if $(STEP),--steps $(STEP)) $(if $(MAX_STEP_S),--max-step-s $(MAX_STEP_S)); \
	else \
		echo "make gpu-campaign needs a CUDA device: $(PY) has no torch that sees one (torch.cuda.is_available() is false)" >&2; \
		exit 2; \
	fi

bench-pipeline: $(STAMP)
	$(BIN)/timeshare bench pipeline --json bench/results/pipeline-$$(date +%Y%m%d).json

bench-switch: $(STAMP)
	$(BIN)/timeshare bench switch --json bench/results/switch-$$(date +%Y%m%d).json

bench-cycles: $(STAMP)
	$(BIN)/timeshare bench cycles --json bench/results/cycles-$$(date +%Y%m%d).json

bench-colocate: $(STAMP)
	$(BIN)/timeshare bench colocate --json bench/results/colocate-$$(date +%Y%m%d).json

bench-scheduler: $(STAMP)
	$(BIN)/timeshare bench scheduler --json bench/results/scheduler-$$(date +%Y%m%d).json

bench-serve: $(STAMP)
	$(BIN)/timeshare bench serve --json bench/results/serve-$$(date +%Y%m%d).json

sim-salus: $(STAMP)
	$(BIN)/timeshare sim salus --seeds 10 --out bench/results/sim/salus-table1.json --plot bench/results/sim/salus-table1.png

sim-serving: $(STAMP)
	$(BIN)/timeshare sim serving --json bench/results/sim-serving-cpu-costs.json --plot bench/results/sim-serving-cpu-costs.png

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
