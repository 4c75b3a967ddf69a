# Entry points, each self-contained on a fresh machine (Python 3.11 + a C++ compiler):
#   make demo    the main job: build, then benchmarks/demo.py (dense, the recipe, PowerSGD on 2 local workers)
#   make test    build, then the documentation (mkdocs --strict) and every test tier
#   make quick   the default test tier only (kernels, the hooks' laws, the one call, bad input)
#   make misuse  the misuse tier: wrong calls on gloo ranks, each a clear error on every rank
#   make bench   the kernel, hook and heterogeneous-rank benchmarks
# Each creates .venv, installs torch 2.13.0 (CPU) and builds hetero_comm into it as an editable
# install: the compiled hetero_comm/_C*.so lands next to the sources, so `import hetero_comm`
# finds the compiled kernels from the repository root as from anywhere else.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SOURCES := pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*.cpp csrc/*.h csrc/kernels/*.h cuda/*.cu cuda/*.cuh)

.PHONY: demo test quick misuse bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned torch>=2.13 could resolve to a multi-GB CUDA build.
# The package and its extension are built once, and again only when $(SOURCES) change; Python
# sources need no reinstall (the install is editable).
$(VENV)/.installed: $(BIN)/python $(SOURCES)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

# One stamp per extra: only the extra's requirements, which pip reads from the installed
# package's metadata (pyproject.toml's as of that build), so nothing is rebuilt.
$(VENV)/.installed-%: $(VENV)/.installed
	$(BIN)/pip install --quiet "hetero_comm[$*]"
	touch $@

# The documentation first: mkdocs --strict fails on a stale link or a page missing from the nav.
# -m "": every tier (pyproject.toml's default leaves out the slow and build tiers).
test: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict --quiet
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m "" tests

quick: $(VENV)/.installed-test
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest tests

misuse: $(VENV)/.installed-test
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m misuse tests

demo: $(VENV)/.installed-demo
	$(BIN)/python benchmarks/demo.py

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/bench_kernels.py
	$(BIN)/python benchmarks/bench_hooks.py
	$(BIN)/python benchmarks/bench_hetero.py

clean:
	rm -rf $(VENV) build *.egg-info hetero_comm/_C*.so
