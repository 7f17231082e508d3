# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when it is missing and installs the pinned, tested torch
# (constraints.txt) plus shardwise itself, then runs.
PY      := .venv/bin/python
STAMP   := .venv/.installed
STRATEGY ?=
WORKERS ?= 2

.PHONY: demo test test-all lint bench setup clean docs

# The lowbit extra (torchao) beside the venv, not in it: transformers imports torchao whenever it can
# (its quantizer), and on a CPU host torchao prints "Failed to load ..._C_mxfp8" at every import, which
# the examples' quiet checks read as a library's notice. tests/test_lowbit_optim.py puts .lowbit first.
# pip byte-compiles what it installs, and that stays: with --no-compile torch's install took 10 s against 22 s on
# a quiet host, but each later import compiles torch from source where PYTHONDONTWRITEBYTECODE is set (as on this
# host: `import torch` 2.9-3.2 s against 1.3-1.8 s, in every rank the suite starts), and byte-compiling after
# (`compileall -j 0`, 10 s) gives the time back.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,fast,bench,hf,integrations,docs]'
	$(PY) -m pip install -q -c constraints.txt --no-deps --upgrade --target .lowbit torchao
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m shardwise.demo $(if $(STRATEGY),--strategy $(STRATEGY),)

# Two pytest workers, whole files each (pytest-xdist): two launch-heavy files side by side took 0.64x the
# time of one after the other on 2 cores (tests/test_dist.py + test_exit.py: 54 s against 84 s, with the
# same CPU); each worker keeps its own pool of ranks. Files go out longest first (tests/conftest.py's
# LONGEST_FIRST; --no-loadscope-reorder keeps that order, where xdist would sort them by count of tests and
# the launch-heavy files of few tests ran last, on one worker). A third worker was slower on a fresh clone
# (21:41 of pytest against 18:03, with no CPU idle and 30% of it in the kernel): `make test WORKERS=3` to try.
test: $(STAMP)
	$(PY) -m ruff check src tests bench examples
	$(PY) -m pytest -q --durations=15 -n $(WORKERS) --dist loadfile --no-loadscope-reorder tests

test-all: $(STAMP)
	$(PY) -m ruff check src tests bench examples
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder tests -m "slow or not slow"

# The documentation site (mkdocs-material + mkdocstrings) into build/site; any warning fails it.
# `make test` checks the same build (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) bench/speed/strategies.py

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache
