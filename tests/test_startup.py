"""Start-up: the paths that read no profile import no analysis stack.

`profclass --help`, `explain` and `import profclass` must not pull pandas (or numpy, pyarrow,
matplotlib, rich, dask, scipy, adbc), and `diagnose --format json` must not import the rich
tables or matplotlib that only the text/markdown/html/picture outputs draw. This is a test on
the set of imported modules, in a fresh interpreter each; timings live in bench/bench.py.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import profile_path

HEAVY = ("pandas", "numpy", "pyarrow", "matplotlib", "rich", "dask", "distributed", "scipy", "sklearn",
         "adbc_driver_manager", "adbc_driver_sqlite")

# Runs main(argv) in a fresh interpreter and prints the heavy top-level packages it imported.
PROBE = """
import json, sys
from profclass.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(HEAVY))), file=sys.stderr)
"""


def imported_after(*argv: str) -> set[str]:
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    return set(json.loads(last))


@pytest.mark.parametrize("argv", [["--help"], ["explain"], ["explain", "--format", "json"],
                                  ["diagnose", "--help"], ["diff", "--help"], ["--version"]],
                         ids=lambda a: " ".join(a))
def test_no_heavy_imports_without_a_profile(argv):
    assert imported_after(*argv) == set()


def test_import_profclass_is_light():
    code = (f"import sys, profclass; from profclass import ProfileError; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_public_names_are_the_real_ones():
    """profclass.diff stays the function even when the profclass.diff module loads first."""
    code = ("import profclass\nfrom profclass.diff import diff as f, step_test\n"
            "from profclass.pipeline import diagnose, Diagnosis\nfrom profclass.hook import run_hook\n"
            "assert profclass.diff is f and profclass.diagnose is diagnose and profclass.Diagnosis is Diagnosis\n"
            "assert profclass.run_hook is run_hook and 'diff' in dir(profclass)\n"
            "from profclass import DiffResult, HookResult\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


def test_json_diagnosis_draws_nothing():
    """diagnose --format json needs pandas and the loader, not the rich tables or matplotlib."""
    mods = imported_after("diagnose", str(profile_path("compute_1gpu")), "--format", "json", "-q")
    assert "pandas" in mods
    assert not mods & {"matplotlib", "rich", "dask", "distributed", "scipy", "sklearn"}


def test_bad_input_is_refused_before_the_pipeline_loads(tmp_path):
    """A missing, empty or non-SQLite input is refused with the pipeline's one line, without
    importing pandas (a job hook or a typo should not wait a second of imports for it)."""
    empty, text = tmp_path / "empty.sqlite", tmp_path / "notes.sqlite"
    empty.write_bytes(b"")
    text.write_text("not a profile\n")
    for path, problem in [(tmp_path / "absent.sqlite", "no such file or directory"),
                          (empty, "empty file"), (text, "not an SQLite file")]:
        code = f"HEAVY = {HEAVY!r}\n" + PROBE
        p = subprocess.run([sys.executable, "-c", code, "diagnose", str(path), "--format", "json"],
                           capture_output=True, text=True, timeout=300)
        lines = p.stderr.strip().splitlines()
        assert lines[0].startswith(f"profclass: error: {path}: {problem}"), lines
        assert json.loads(lines[-1]) == [], f"{path.name} imported {lines[-1]}"


def test_version_is_the_package_version():
    """pyproject reads profclass.version.__version__ (profclass.__version__ is the same); the JSON stamps it without importlib.metadata."""
    from importlib.metadata import version

    import profclass
    from profclass.contract import profclass_version
    assert profclass_version() == profclass.__version__ == version("profclass")
