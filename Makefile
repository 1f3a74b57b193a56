# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO ?= fixtures/profiles/comm_4gpu.sqlite.zst

.PHONY: install demo test bench clean

$(BIN)/profclass: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/profclass

demo: install
	$(BIN)/profclass diagnose $(DEMO)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
