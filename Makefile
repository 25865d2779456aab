# One-command set-up: every target creates (once) and reuses a local virtualenv in .venv.
# TORCH_SPEC pins the CPU build found on our CI machines; override it for your own torch,
# e.g. `make test TORCH_SPEC="torch>=2.4"`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
# The extras `make install` installs (.ci/run adds ray, so that the Ray Serve test runs, not skips).
EXTRAS ?= dev
# With JUNIT_DIR set (.ci/run sets it), each pytest stage writes JUNIT_DIR/<stage>.xml.
JUNIT_DIR ?=
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1).xml)
# --no-compile, then compileall on both cores: pip byte-compiles every installed module on one
# core (torch's alone ~40 s). The .pyc files must exist: with PYTHONDONTWRITEBYTECODE set (as on
# our CI machines) a process would otherwise compile every module it imports, at every start.
PIP_INSTALL := -m pip install -q --no-compile
# compileall's exit status also counts files no Python 3 reads (packages' test data), as pip ignores them
COMPILE_VENV = $(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

.PHONY: install ops demo test test-fast test-ci test-slow test-all test-docs docs bench wheel-check proto clean

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PY) $(PIP_INSTALL) -e ".[$(EXTRAS)]"
	$(COMPILE_VENV)
	touch $@

install: $(VENV)/.installed

# DeepSpeed's CPU ops the slow tests use (CPU Adam, FusedAdam), JIT-built now rather than inside
# the first test that needs them (~3 CPU-minutes each on 2 cores); PATH as test-ci's, or they rebuild.
ops: export PATH := $(abspath $(VENV))/bin:$(PATH)
ops: install
	$(PY) tests/build_ops.py

# The venv's bin first on PATH, as for bench: the deepspeed launcher starts ranks with the
# interpreter it finds there (and offload configs' CPU Adam op is rebuilt when PATH changes).
demo: export PATH := $(abspath $(VENV))/bin:$(PATH)
demo: install
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) $(VENV)/bin/gmeta-ds train --config examples/synthetic/config.yaml --overwrite

# The developer's default: unit tests, tests/distributed and tests/launch (equality tests on the
# warm rank pool, tests/pool.py; one real launch per launch path).
test: install
	$(PY) -m pytest -q -m "not slow and not gpu and not docs" $(call junit,test)

# The inner loop: unit tests only (no launcher, no rank pool).
test-fast: install
	$(PY) -m pytest -q -m "not slow and not gpu and not docs" tests/unit $(call junit,test-fast)

# What .ci/run runs: make test's tests and the docs check in one pytest session (make test-slow
# runs the slow ones: further cases of covered paths, left out of CI for its 30-minute budget)
# (one rank pool, session fixtures built once). The venv's bin first on PATH, as for demo.
test-ci: export PATH := $(abspath $(VENV))/bin:$(PATH)
test-ci: install
	$(PY) -m pytest -q -m "not gpu and not slow" $(call junit,test-ci)

# Every shell command of the README, docs/*.md and examples/*/README.md, run at small sizes in a
# copy of the tree (tests/docs/test_doc_commands.py; each distinct command once). The venv's bin
# first on PATH, as for demo.
test-docs: export PATH := $(abspath $(VENV))/bin:$(PATH)
test-docs: install
	$(PY) -m pytest -q -m docs tests/docs $(call junit,test-docs)

# Tests marked slow: further cases of paths the default run already covers (29 tests).
test-slow: export PATH := $(abspath $(VENV))/bin:$(PATH)
test-slow: install
	$(PY) -m pytest -q -m "slow and not gpu" $(call junit,test-slow)

# The documentation site (mkdocs.yml) into site/ (ignored): the docs extra into the venv, then a
# strict build, where a broken link, anchor or API reference fails.
docs: install
	$(PY) $(PIP_INSTALL) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d site/

test-all: install
	$(PY) -m pytest -q

# A wheel that works anywhere: build it, install it (not editable) into a fresh virtualenv with
# TORCH_SPEC, and run gmeta-ds validate / train (CTR and text) from a directory outside the
# checkout (tests/wheel/check_wheel.sh; ~2 min on 2 cores, half of it pip installing the dependencies).
wheel-check:
	TORCH_SPEC="$(TORCH_SPEC)" tests/wheel/check_wheel.sh

# The benchmark suite (~45 min on 2 cores, 30 of them benchmarks/scaling.py): tables on stdout, JSON under benchmarks/results/,
# charts under docs/img/ (docs/performance.md). The venv's bin first on PATH, as for demo.
bench: export PATH := $(abspath $(VENV))/bin:$(PATH)
bench: install
	$(PY) benchmarks/inner_loop.py
	$(PY) benchmarks/embedding_comm.py
	$(PY) benchmarks/meta_io.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/scaling_model.py
	$(PY) benchmarks/zero_tuning.py --stages 2 3 --configs demo
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/comm_model.py
	$(PY) benchmarks/lookup.py
	$(PY) benchmarks/plots.py

# The OIP v2 gRPC modules (gmeta_ds/serving/proto/*_pb2*.py) again from grpc_predict_v2.proto, with
# the dev extra's grpcio-tools; tests/unit/test_serving_grpc.py fails while they are out of date.
proto: install
	$(PY) -m gmeta_ds.serving.proto.generate

clean:
	rm -rf $(VENV) runs .pytest_cache
