# Ratchet: `make demo` and `make test` work on a fresh clone; they create .venv and install what is missing.
# GPU users: make install TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
STAMP := $(VENV)/.ratchet-installed

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export MLFLOW_ENABLE_TELEMETRY ?= false
export TOKENIZERS_PARALLELISM ?= false
export LITELLM_LOCAL_MODEL_COST_MAP ?= True

.PHONY: install demo test test-all lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@# tests/test_wheel.py builds the wheel offline, without build isolation: the venv's own setuptools builds it
	$(PY) -m pip install -q 'setuptools>=69'
	@# the distribution was renamed ratchet -> ratchet-lineage (same `pipeline` package): drop the old editable one
	@$(PY) -m pip uninstall -q -y ratchet 2>/dev/null || true
	$(PY) -m pip install -q -e '.[dev,qlora]'
	@touch $(STAMP)

# Model-written code runs under bubblewrap; where it is not installed the demo (the tiny model's own code)
# says so and runs it as plain processes instead (RATCHET_SANDBOX=process, for trusted data only).
demo: install
	@command -v bwrap >/dev/null || echo "demo: bubblewrap not found (apt-get install bubblewrap); running model code as plain processes"
	$(if $(shell command -v bwrap),,RATCHET_SANDBOX=$${RATCHET_SANDBOX:-process}) $(VENV)/bin/ratchet demo

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=25 $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) bench/ingest.py
	$(PY) bench/train.py
	$(PY) bench/overhead.py
	$(PY) bench/serve.py
	$(PY) bench/sandbox.py
	$(PY) bench/gates.py
	$(PY) bench/methods.py
	$(PY) bench/dashboard.py --backend sqlite --cache .ratchet/cache

clean:
	rm -rf .ratchet .pytest_cache build *.egg-info
