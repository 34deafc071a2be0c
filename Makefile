# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Both build .venv first. torch is pinned to the CPU wheel so no CUDA build is downloaded.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= dev,cli,torch,triton,cuda,nixl,viz

.PHONY: demo test lint bench venv clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_PIN)"
	touch $@

venv: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/kvxfer demo
	$(BIN)/python examples/offload_loop.py

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m mypy --strict planner

bench: $(BIN)/.installed
	$(BIN)/kvxfer bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
