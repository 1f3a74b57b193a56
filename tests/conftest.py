"""Shared fixtures: the labelled corpus, diagnoses cached per session, and nsys.

Each real diagnosis costs ~0.5 s on a small machine, and several test files ask about the
same profile, so ``diagnosis(name)`` runs ``profclass.diagnose`` once per profile per session.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = ROOT / "fixtures" / "profiles"
CORPUS = tomllib.loads((ROOT / "fixtures" / "corpus.toml").read_text())
PROFILES = {p["name"]: p for p in CORPUS["profile"]}
NSYS_DEFAULT = Path("/opt/nsys/usr/lib/nsight-systems/bin/nsys")
GET_NSYS = ROOT.parent / "shared" / "nsys" / "get-nsys.sh"


def profile_path(name: str) -> Path:
    return PROFILES_DIR / PROFILES[name]["path"]


# a gap an issue-30 candidate (capture_pairs.sh call2) shows on a real capture: a strict xfail
# on the corpus-wide tests, so each passes, and must be unmarked, once the gap is closed
GC_WINDOW = pytest.mark.xfail(strict=True, reason=(
    "gc_cand_1gpu: the steady window keeps 2 steps (22.5 ms) of the captured iterations 6..10, not "
    "the one holding the manual collection (310 ms), so neither its mean nor its median is the "
    "timer's 103.1 ms over 6..9"))
GC2_WINDOW = pytest.mark.xfail(strict=True, reason=(
    "gc2_base_1gpu: the steady window keeps 2 steps (19.4, 21.1 ms) of the captured iterations 6..9 "
    "and leaves out iteration 8's generation-2 collection (322 ms), so the window's step is not the "
    "timer's 113.1 ms"))


def with_marks(names, marks: dict) -> list:
    """``names`` as parametrize values, those in ``marks`` carrying their mark."""
    return [pytest.param(n, marks=marks[n]) if n in marks else n for n in names]


def decompress_fixture(src: Path, dst: Path) -> Path:
    """A committed fixture (.sqlite.zst or .sqlite.xz) written out as plain SQLite at ``dst``."""
    import lzma

    import zstandard
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        if src.name.endswith(".xz"):
            with lzma.open(fi) as x:
                shutil.copyfileobj(x, fo, 1 << 20)
        else:
            zstandard.ZstdDecompressor().copy_stream(fi, fo)
    return dst


def find_nsys() -> str | None:
    """nsys as profclass finds it: $NSYS, PATH, then the default install prefix."""
    env = os.environ.get("NSYS")
    if env and os.access(env, os.X_OK):
        return env
    return shutil.which("nsys") or (str(NSYS_DEFAULT) if os.access(NSYS_DEFAULT, os.X_OK) else None)


@pytest.fixture(scope="session")
def nsys() -> str:
    """The nsys binary; installed once with ../shared/nsys/get-nsys.sh when missing."""
    found = find_nsys()
    if found:
        return found
    if not GET_NSYS.exists():
        pytest.skip(f"nsys not found ($NSYS, PATH, {NSYS_DEFAULT}) and no installer at {GET_NSYS}")
    proc = subprocess.run(["bash", str(GET_NSYS), "/opt/nsys"], capture_output=True, text=True, timeout=900)
    found = find_nsys()
    if proc.returncode != 0 or not found:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"nsys could not be installed with {GET_NSYS} (exit {proc.returncode}: {last[0]})")
    return found


@pytest.fixture(scope="session")
def diagnosis(request):
    """``diagnosis(name)`` -> the profclass Diagnosis of a corpus profile (cached)."""
    import profclass

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            path = profile_path(name)
            if path.suffix == ".nsys-rep":
                request.getfixturevalue("nsys")  # a report needs nsys to export it
            cache[name] = profclass.diagnose(str(path), keep_replay=True)  # diff splits by replay
        return cache[name]

    return get


def relaunched(name: str, dst: Path, launch) -> str:
    """A copy of the committed export ``name`` at ``dst`` with each process's launch line
    replaced by ``launch(command, arguments)`` -> (command, arguments); the timelines untouched."""
    import sqlite3

    from profclass.inputs import resolve

    with resolve([str(profile_path(name))]) as files:
        shutil.copy(files[0].sqlite, dst)
    con = sqlite3.connect(dst)
    rows = con.execute("SELECT name, value FROM META_DATA_CAPTURE WHERE name LIKE 'PROCESS_%:COMMAND' "
                       "OR name LIKE 'PROCESS_%:ARGUMENT_%'").fetchall()
    per: dict[str, dict] = {}
    for key, value in rows:
        proc, _, field = key.partition(":")
        per.setdefault(proc, {})[field] = value
    con.execute("DELETE FROM META_DATA_CAPTURE WHERE name LIKE 'PROCESS_%:ARGUMENT_%'")
    for proc, fields in per.items():
        args = [fields[f"ARGUMENT_{i}"] for i in range(sum(f.startswith("ARGUMENT_") for f in fields))]
        command, args = launch(fields.get("COMMAND", ""), args)
        con.execute("UPDATE META_DATA_CAPTURE SET value = ? WHERE name = ?", (command, f"{proc}:COMMAND"))
        con.executemany("INSERT INTO META_DATA_CAPTURE(name, value) VALUES (?, ?)",
                        [(f"{proc}:ARGUMENT_{i}", a) for i, a in enumerate(args)])
    con.commit()
    con.close()
    return str(dst)
