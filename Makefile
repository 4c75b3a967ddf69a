# Entry points, each self-contained on a fresh machine (Python 3.11 + a C++ compiler):
#   make demo    the main job: build, then `hetero-comm demo` (every hook on 2 local workers)
#   make test    build, then build the docs (mkdocs --strict) and run the full test suite
#   make bench   the kernel, hook and heterogeneous-rank benchmarks
# Both create .venv, install torch 2.13.0 (CPU) and build hetero_comm from source into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SOURCES := pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*.cpp csrc/*.h csrc/kernels/*.h cuda/*.cu cuda/*.cuh hetero_comm/*.py hetero_comm/*/*.py)

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned torch>=2.13 could resolve to a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python $(SOURCES)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet ".[test]"
	touch $@

# pytest (not `python -m pytest`) from the repo root keeps the source tree off sys.path, so the
# installed package with its compiled _C is the one under test.
# The documentation first: mkdocs --strict fails on a stale link or a page missing from the nav.
test: $(VENV)/.installed
	$(BIN)/mkdocs build --strict --quiet
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest tests

demo: $(VENV)/.installed
	$(BIN)/hetero-comm demo

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_kernels.py
	$(BIN)/python benchmarks/bench_hooks.py
	$(BIN)/python benchmarks/bench_hetero.py

clean:
	rm -rf $(VENV) build *.egg-info
