# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO ?= fixtures/profiles/comm_4gpu.sqlite.zst

.PHONY: install demo test bench clean nsys

$(BIN)/profclass: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/profclass

demo: install
	$(BIN)/profclass diagnose $(DEMO)

# nsys (for .nsys-rep inputs and the nsys stats/analyze cross-checks): installed once from the
# sibling shared/ folder when it is there and /opt/nsys is not; tests that need it skip otherwise
GET_NSYS ?= $(CURDIR)/../shared/nsys/get-nsys.sh
nsys:
	@if [ -x "$$(command -v nsys)" ] || [ -n "$$NSYS" ] || [ -e /opt/nsys ] || [ ! -f "$(GET_NSYS)" ]; then :; \
	else echo "installing nsys with $(GET_NSYS)"; bash "$(GET_NSYS)" /opt/nsys || echo "nsys install failed: tests that need it will skip"; fi

test: install nsys
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
