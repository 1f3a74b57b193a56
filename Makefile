# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO ?= fixtures/profiles/comm_4gpu.sqlite.xz

.PHONY: install demo test bench calibrate clean nsys fuzz recipe-venv

$(BIN)/profclass: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@# bytecode now, as a wheel install would: with PYTHONDONTWRITEBYTECODE set, an editable
	@# install would compile every module from source on every run (~0.2 s of each start)
	$(BIN)/python -m compileall -q profclass
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

# nsys recipe profclass runs in the Python first on PATH, with the framework's packages at the
# versions it works with (numpy<2, pandas<2.3, pyarrow<17): a second venv, the `recipe` extra.
# tests/test_recipe.py runs nsys recipe with it (and makes it when missing)
RECIPE_VENV ?= .venv-recipe
$(RECIPE_VENV)/bin/profclass: pyproject.toml
	$(PY) -m venv $(RECIPE_VENV)
	$(RECIPE_VENV)/bin/pip install -q --upgrade pip
	$(RECIPE_VENV)/bin/pip install -q -e '.[recipe]'
	touch $@

recipe-venv: $(RECIPE_VENV)/bin/profclass

test: install nsys recipe-venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(RECIPE_VENV) build *.egg-info

# Long fuzzing run (tests/test_fuzz.py): FUZZ_EXAMPLES generated exports (split over two
# processes) and every committed fixture truncated at 20 points and byte-flipped at 100
# (first: real-fixture damage is what has found crashes so far).
# Counts go to build/fuzz-*.json and are summed at the end.
FUZZ_EXAMPLES ?= 10000
fuzz: install
	rm -f build/fuzz-*.json
	FUZZ_FULL=1 FUZZ_REPORT=build/fuzz-corrupt.json $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k corrupted
	FUZZ_EXAMPLES=$$(( ($(FUZZ_EXAMPLES) + 1) / 2 )) FUZZ_REPORT=build/fuzz-gen1.json $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k generated --hypothesis-seed=1 & p=$$!; \
	FUZZ_EXAMPLES=$$(( $(FUZZ_EXAMPLES) / 2 )) FUZZ_REPORT=build/fuzz-gen2.json $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k generated --hypothesis-seed=2; \
	s2=$$?; wait $$p; s1=$$?; test $$s1 -eq 0 -a $$s2 -eq 0
	$(BIN)/python -c "import json,glob; c={}; [c.__setitem__(k, max(c.get(k, 0), v) if k.endswith('_max_ms') else c.get(k, 0) + v) for f in sorted(glob.glob('build/fuzz-*.json')) for k, v in json.load(open(f)).items()]; print(json.dumps(dict(sorted(c.items())), indent=1))"

# Side-by-side benchmark (bench/bench.py): start-up (--help, explain, a cold diagnosis of the
# smallest fixture against nsys-ai), then profclass diagnose vs nsys stats vs nsys-ai on
# exports grown to 100 MB / 1 GB / 4 GB from a real fixture (built into bench/out/ when
# missing). BENCH_ARGS=--startup-only runs the first part alone.
BENCH_ARGS ?=
bench: install nsys
	$(BIN)/pip install -q -e '.[test,dask,bench]'
	$(BIN)/python bench/bench.py --out bench/out/results.md $(BENCH_ARGS)

# Refit the wall thresholds on the labelled corpus (scikit-learn comes with the calibrate extra)
calibrate: install
	$(BIN)/pip install -q -e '.[calibrate]'
	$(BIN)/python bench/calibrate.py --write
