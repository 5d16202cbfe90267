# Quick start: `make serve` creates .venv with the runtime only; `make test` (and `make install`)
# add the test and deploy tooling (the `dev` extra). Each installs only what is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# setuptools says on every editable build that a folder named like a package may shadow it:
# here that folder is the package itself
PIP    := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip
RUNTIME_STAMP := $(VENV)/.tandem-runtime
STAMP  := $(VENV)/.tandem-installed
# CPU-only machines take the CPU build of torch; an unpinned `torch` would pull the CUDA build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH  ?= $(if $(HAS_GPU),torch,torch==2.13.0)
# There, Triton only runs its interpreter (CI's kernel tests): pin the release whose interpreter
# tests/conftest.py's fast path was written against (about 2x on the kernel tests; another
# release falls back to Triton's own path, ~19 min for the suite). GPU machines take the Triton
# their torch pins.
TRITON ?= $(if $(HAS_GPU),,triton==3.9.*)
ARGS   ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core; most tests are single-threaded Python (Triton's
# interpreter, tiny models), so two cores run the suite in about half the time.
TEST_WORKERS ?= auto
# A module runs in one process (its module-scoped servers and engines start once), modules in
# collection order: the heavy ones first (tests/conftest.py), not reordered by test count.
TEST_DIST ?= --dist loadscope --no-loadscope-reorder
# pip quiet: progress and "already satisfied" lines off, errors still shown
PIP_Q  := -q --disable-pip-version-check

.PHONY: install runtime tools serve test test-unit test-e2e test-gpu hopper-check clean

install: $(STAMP)

runtime: $(RUNTIME_STAMP)

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(RUNTIME_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(PIP_Q) "$(TORCH)"
	$(PIP) install $(PIP_Q) -e .
	touch $(RUNTIME_STAMP)

$(STAMP): pyproject.toml $(RUNTIME_STAMP)
	$(PIP) install $(PIP_Q) -e '.[dev]' $(if $(TRITON),'$(TRITON)')
	touch $(STAMP)

# Debian's prometheus package (prometheus + promtool) for the deploy/ tests, installed only when
# missing and only where apt runs as root (CI). Elsewhere those tests skip (and fail under CI=true).
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "note: prometheus not installed (needs apt as root): the deploy tests that run it skip"; fi; }

serve: $(RUNTIME_STAMP)
	$(VENV)/bin/tandem serve $(ARGS)

test: $(STAMP) tools
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(TEST_DIST) --junitxml=$(VENV)/junit.xml tests $(PYTEST_ARGS)
	$(PY) tests/check_junit.py $(VENV)/junit.xml

test-unit: $(STAMP) tools
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-e2e: $(STAMP) tools
	$(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

# Every kernel variant the engine launches, compiled for the H200 (sm_90) on a machine without a
# GPU, with this venv's Triton and with the GPU machine's (GPU_TRITON, put under .cache on first
# use): tests/helpers/hopper_compile.py. CI runs the first half (tests/unit/gpu_worker/kernels/test_kernels_compile_hopper.py).
# SHAPES=1 records at the benchmark models' widths instead of the tiny test models' (~12 min).
GPU_TRITON ?= 3.6.0
HOPPER := .cache/hopper
SHAPES ?=
hopper-check: $(STAMP)
	test -d .cache/triton-$(GPU_TRITON) || $(PIP) install -q --no-deps --target .cache/triton-$(GPU_TRITON) triton==$(GPU_TRITON)
	rm -rf $(HOPPER) && mkdir -p $(HOPPER)
	TRITON_INTERPRET=1 $(PY) -m tests.helpers.hopper_compile \
	  $(if $(SHAPES),record-shapes,record) $(HOPPER)/launches.json $(HOPPER)/models
	env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$(HOPPER)/cache $(PY) -m tests.helpers.hopper_compile compile $(HOPPER)/launches.json $(HOPPER)/venv.json >/dev/null
	env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=.cache/triton-$(GPU_TRITON) TRITON_CACHE_DIR=$(HOPPER)/cache-gpu $(PY) -m tests.helpers.hopper_compile compile $(HOPPER)/launches.json $(HOPPER)/gpu.json >/dev/null

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .cache
