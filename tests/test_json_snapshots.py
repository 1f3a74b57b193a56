"""The JSON of `diagnose` and `diff` on every committed fixture, against snapshots.

A refactor must not change what users and hooks parse. The snapshots in tests/snapshots/ were
written from the code before a refactor; a deliberate output change regenerates them with

    PROFCLASS_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_json_snapshots.py

and the diff of the snapshot files is then part of that commit, for review.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CORPUS, PROFILES, profile_path

SNAP_DIR = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("PROFCLASS_UPDATE_SNAPSHOTS") == "1"
# fields that name where the input was read from (absolute paths differ between checkouts)
PATH_FIELDS = ("inputs", "file")


def _portable(obj, root: str):
    """The JSON with the checkout's absolute path cut from file names."""
    if isinstance(obj, dict):
        return {k: _portable(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith(root):
        return obj[len(root):].lstrip("/")
    return obj


def _check(name: str, payload: str) -> None:
    root = str(Path(__file__).resolve().parents[1])
    text = json.dumps(_portable(json.loads(payload), root), indent=1, sort_keys=False) + "\n"
    snap = SNAP_DIR / f"{name}.json"
    if UPDATE or not snap.exists():
        if not UPDATE:
            pytest.fail(f"no snapshot {snap.name}: run with PROFCLASS_UPDATE_SNAPSHOTS=1 to write it")
        snap.write_text(text)
        return
    expected = snap.read_text()
    if text != expected:
        # the first differing line, so a failure says what moved
        for i, (a, b) in enumerate(zip(text.splitlines(), expected.splitlines())):
            if a != b:
                pytest.fail(f"{name}: JSON differs from {snap.name} at line {i + 1}: {a.strip()!r} != {b.strip()!r}")
        pytest.fail(f"{name}: JSON length differs from {snap.name}")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_diagnose_json_matches_snapshot(name, diagnosis):
    if profile_path(name).suffix == ".nsys-rep" and not UPDATE and not (SNAP_DIR / f"{name}.json").exists():
        pytest.skip("no snapshot of the .nsys-rep fixture")
    _check(name, diagnosis(name).to_json())


@pytest.mark.parametrize("pair", CORPUS["pair"], ids=[f"{p['base']}->{p['candidate']}" for p in CORPUS["pair"]])
def test_diff_json_matches_snapshot(pair, diagnosis):
    from profclass.diff import diff
    r = diff(diagnosis(pair["base"]), diagnosis(pair["candidate"]))
    _check(f"diff__{pair['base']}__{pair['candidate']}", r.to_json())
