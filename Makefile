# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Each builds .venv and installs what that command uses, showing pip's progress:
#   demo  -> kvxfer[cli]           (numpy, pydantic, typer, rich: no torch, triton or nixl)
#   test  -> kvxfer[$(EXTRAS)]     (every backend the tests exercise; torch pinned to the CPU wheel)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PIP_FLAGS ?= --progress-bar on
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= dev,cli,torch,triton,cuda,nixl,viz
DEMO_EXTRAS ?= cli

.PHONY: demo test lint bench venv docs notebook clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) --upgrade pip

# everything the test suite exercises (torch first, pinned, so nothing pulls a CUDA build)
$(BIN)/.installed: pyproject.toml Makefile | $(BIN)/python
	@echo "== installing kvxfer[$(EXTRAS)] with $(TORCH_PIN) into $(VENV) (a few minutes on a fresh machine) =="
	$(PIP) install $(PIP_FLAGS) "$(TORCH_PIN)"
	$(PIP) install $(PIP_FLAGS) -e ".[$(EXTRAS)]" "$(TORCH_PIN)"
	touch $@ $(BIN)/.installed-demo

# what `kvxfer demo` imports: the planner, the NumPy executor and the CLI
$(BIN)/.installed-demo: pyproject.toml Makefile | $(BIN)/python
	@echo "== installing kvxfer[$(DEMO_EXTRAS)] into $(VENV) =="
	$(PIP) install $(PIP_FLAGS) -e ".[$(DEMO_EXTRAS)]"
	touch $@

venv: $(BIN)/.installed

demo: $(BIN)/.installed-demo
	$(BIN)/kvxfer demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check .

bench: $(BIN)/.installed-demo
	$(BIN)/kvxfer bench

# ---- docs and the example notebook (output under build/, git-ignored) ----------------------------------------
# API reference for every package in pyproject's package-dir except the CLI (packages added later are picked up)
DOC_MODULES = $(shell $(BIN)/python -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print(*[m for m in d["tool"]["setuptools"]["package-dir"] if m != "kvxfer.cli"])')

docs: $(BIN)/.installed
	$(BIN)/python -m pdoc --docformat google -o build/docs $(DOC_MODULES)
	@echo "API reference: build/docs/index.html"

# executes the example notebook (nbclient + ipykernel) and renders it to HTML (nbconvert)
notebook: $(BIN)/.installed
	$(BIN)/python -m nbconvert --execute --to notebook --ExecutePreprocessor.timeout=600 \
		--output-dir build examples/inspect_plans.ipynb
	$(BIN)/python -m nbconvert --to html --output-dir build build/inspect_plans.ipynb
	@echo "executed notebook: build/inspect_plans.ipynb, rendered: build/inspect_plans.html"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
