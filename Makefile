# Quick start: `make serve` and `make test` each create .venv and install what is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
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

.PHONY: install tools serve test test-unit test-e2e test-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[dev]' $(if $(TRITON),'$(TRITON)')
	touch $(STAMP)

# Debian's prometheus package (prometheus + promtool) for the deploy/ tests, installed only when
# missing and only where apt runs as root (CI). Elsewhere those tests skip (and fail under CI=true).
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "note: prometheus not installed (needs apt as root): the deploy tests that run it skip"; fi; }

serve: $(STAMP)
	$(VENV)/bin/tandem serve $(ARGS)

test: $(STAMP) tools
	$(PY) -m pytest -q -p no:cacheprovider --junitxml=$(VENV)/junit.xml tests $(PYTEST_ARGS)
	$(PY) tests/check_junit.py $(VENV)/junit.xml

test-unit: $(STAMP) tools
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-e2e: $(STAMP) tools
	$(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
