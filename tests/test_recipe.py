"""``nsys recipe profclass`` with the installed Nsight Systems 2024.2.3, run by the Python of the
``recipe`` extra (numpy<2, pandas<2.3, pyarrow<17: the versions the framework works with;
``make recipe-venv``): in each of the framework's modes its JSON is ``profclass diagnose``'s
(made here, in the test venv's numpy 2 / pandas 3) for one report and for per-rank reports."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, profile_path
from profclass.recipe import recipe_dir, recipe_path

RECIPE_VENV = Path(os.environ.get("PROFCLASS_RECIPE_VENV", ROOT / ".venv-recipe"))
MODES = ["none", "concurrent", "dask-futures"]


@pytest.fixture(scope="session")
def recipe_bin() -> Path:
    """The recipe venv's bin folder (made with ``make recipe-venv`` when missing)."""
    py = RECIPE_VENV / "bin" / "python"
    if not py.exists():
        proc = subprocess.run(["make", "-C", str(ROOT), "recipe-venv", f"RECIPE_VENV={RECIPE_VENV}"],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"could not make the recipe venv: {(proc.stderr or proc.stdout).strip()[-300:]}")
    versions = subprocess.run([str(py), "-c", "import numpy, pandas, pyarrow; print(numpy.__version__, "
                               "pandas.__version__, pyarrow.__version__)"], capture_output=True, text=True)
    numpy_v, pandas_v, arrow_v = versions.stdout.split()
    # the environment the framework needs: the point of this venv
    assert int(numpy_v.split(".")[0]) < 2 and tuple(map(int, pandas_v.split(".")[:2])) < (2, 3) \
        and int(arrow_v.split(".")[0]) < 17, versions.stdout
    return RECIPE_VENV / "bin"


def run_recipe(nsys, bin_dir, inputs, out, *args, cwd=None, env_extra=None):
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NSYS_RECIPE_PATH": recipe_path(),
           "NSYS_DASK_N_WORKERS": "2", "NSYS_CONCURRENT_MAX_WORKERS": "2", **(env_extra or {})}
    return subprocess.run([nsys, "recipe", "profclass", "--input", *map(str, inputs), "--output", str(out), *args],
                          capture_output=True, text=True, env=env, cwd=cwd or ROOT, timeout=600)


def diagnose_json(paths) -> dict:
    import profclass
    return json.loads(profclass.diagnose([str(p) for p in paths]).to_json())


def test_recipe_path_holds_the_metadata_of_this_package():
    out = subprocess.run([sys.executable, "-m", "profclass", "recipe-path"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == recipe_path()
    meta = json.loads((Path(recipe_path()) / "profclass" / "metadata.json").read_text())
    assert Path(recipe_dir()) == Path(recipe_path()) / "profclass"
    # the framework imports "<recipe name>.<module_name>": this package's module
    assert f"profclass.{meta['module_name']}" == "profclass.recipe.job"
    assert (ROOT / "profclass" / "recipe" / "job.py").exists()


@pytest.mark.parametrize("mode", MODES)
def test_per_rank_reports_give_diagnose_json_in_every_mode(mode, nsys, recipe_bin, tmp_path):
    given = profile_path("imbalance_4gpu_perrank")  # four per-rank exports of one real job
    out = tmp_path / "out"
    proc = run_recipe(nsys, recipe_bin, [given], out, "--mode", mode)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((out / "profclass.json").read_text())
    want = diagnose_json([given])
    assert got["verdict"] == want["verdict"] and got["verdict"]["wall"] == "compute"
    assert got == want  # the whole JSON, inputs included: the same paths given
    assert {p.name for p in out.iterdir()} == {"profclass.json", "profclass.md", "profclass.html",
                                                 "out.nsys-analysis"}
    analysis = json.loads((out / "out.nsys-analysis").read_text())
    assert analysis["Mode"] == mode and analysis["Verdict"] == "compute"
    assert (out / "profclass.md").read_text().startswith("## profclass: **compute** wall")
    assert "Not drawn: this report was made from per-rank summaries" in (out / "profclass.html").read_text()
    assert got["verdict"]["wall"] in proc.stdout  # its one log line


def test_one_report_holding_every_rank(nsys, recipe_bin, tmp_path):
    given = profile_path("mcore_pp4_m4")  # one export, four ranks (a compressed SQLite export)
    proc = run_recipe(nsys, recipe_bin, [given], tmp_path / "out", "--mode", "concurrent")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "profclass.json").read_text()) == diagnose_json([given])


def test_nsys_rep_reports_one_and_per_rank(nsys, recipe_bin, tmp_path, monkeypatch):
    """.nsys-rep inputs: each worker exports its report (into profclass's cache, nothing beside
    the report). Per rank: the one real report copied as ranks 0 and 1 (its only .nsys-rep)."""
    monkeypatch.setenv("PROFCLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NSYS", nsys)
    rep = profile_path("tiny_host_1gpu")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for k in range(2):
        shutil.copy(rep, ranks / f"rank{k}.nsys-rep")
    for given, mode in (([rep], "none"), ([ranks], "dask-futures")):
        out = tmp_path / f"out-{mode}"
        proc = run_recipe(nsys, recipe_bin, given, out, "--mode", mode)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got, want = json.loads((out / "profclass.json").read_text()), diagnose_json(given)
        assert got["verdict"]["wall"] == want["verdict"]["wall"] == "host"
        assert got == want
    assert sorted(p.name for p in ranks.iterdir()) == ["rank0.nsys-rep", "rank1.nsys-rep"]
    assert len(json.loads((tmp_path / "out-dask-futures" / "profclass.json").read_text())["devices"]) == 2


def test_bad_input_is_one_line_and_no_output(nsys, recipe_bin, tmp_path):
    missing = tmp_path / "nothing.sqlite"
    proc = run_recipe(nsys, recipe_bin, [missing], tmp_path / "out")
    assert proc.returncode != 0  # nsys reports the recipe's exit 2 as 1
    assert proc.stderr.strip() == f"profclass: error: {missing}: no such file or directory"
    assert not (tmp_path / "out").exists()


def test_python_without_profclass_gets_one_clear_error(nsys, recipe_bin, tmp_path):
    """The framework's packages but no profclass (the recipe venv's site-packages on a bare venv's
    path, without its .pth files: the editable profclass is not importable): the stand-in
    module's one line says what to install."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    site = next((bare / "lib").glob("python3*/site-packages"))
    recipe_site = next((RECIPE_VENV / "lib").glob("python3*/site-packages"))
    (site / "framework-packages.pth").write_text(f"{recipe_site}\n")
    proc = run_recipe(nsys, bare / "bin", [profile_path("compute_1gpu")], tmp_path / "out", cwd=tmp_path)
    assert proc.returncode != 0
    # (nsys has the framework log to stdout)
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "profclass is not installed in the Python that nsys recipe runs" in errors[0]
    assert "pip install 'profclass[recipe]'" in errors[0]
