"""Exports whose rows are in no particular order diagnose as the ordered ones do. Nsight Systems
2025.6's release notes: "It cannot be assumed that rows will continue to be exported in any
particular order, including timestamp order" (SQLite, Arrow and Parquet exports alike). Every
table of a real export is copied with its rows shuffled (tables keyed by an INTEGER PRIMARY KEY,
such as StringIds, come back in key order whatever the insert order: SQLite scans them by key), and
the diagnosis, replay and plan included, must not change."""
from __future__ import annotations

import json
import random
import sqlite3

import pytest
from conftest import profile_path

import profclass

PROFILES = ["graphs_base_1gpu",  # one GPU, host-paced, CUDA graphs absent: the launch order matters
            "mcore_wrapped_tp2_pp2_ep2"]  # TP 2 x PP 2 x EP 2, flagless: collectives matched across ranks


def _shuffled_copy(src: str, dst: str, seed: int) -> int:
    """``src``'s tables into ``dst`` with each table's rows in a random order; the rows moved."""
    rng = random.Random(seed)
    moved = 0
    with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as s, sqlite3.connect(dst) as d:
        tables = s.execute("SELECT name, sql FROM sqlite_master WHERE type='table' AND sql IS NOT NULL "
                           "AND name NOT LIKE 'sqlite_%'").fetchall()
        for name, sql in tables:
            d.execute(sql)
            rows = s.execute(f'SELECT * FROM "{name}"').fetchall()
            rng.shuffle(rows)
            if rows:
                d.executemany(f'INSERT INTO "{name}" VALUES ({",".join("?" * len(rows[0]))})', rows)
                moved += len(rows)
    return moved


def _comparable(d) -> dict:
    out = json.loads(d.to_json())
    for key in ("inputs", "input_sha256"):
        out.pop(key, None)
    for dev in out.get("devices", []):
        dev.pop("file", None)
    return out


@pytest.mark.parametrize("name", PROFILES)
def test_a_shuffled_export_diagnoses_as_the_ordered_one(name, tmp_path):
    from profclass.inputs import resolve
    with resolve([str(profile_path(name))]) as files:
        ordered = str(files[0].sqlite)
        shuffled = str(tmp_path / f"{name}_shuffled.sqlite")
        assert _shuffled_copy(ordered, shuffled, seed=7) > 10_000
        with sqlite3.connect(shuffled) as con:  # the kernels really are out of time order
            starts = [r[0] for r in con.execute("SELECT start FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 200")]
        assert starts != sorted(starts)
        a, b = profclass.diagnose(ordered), profclass.diagnose(shuffled)
    assert a.replay and a.plan is not None
    assert _comparable(a) == _comparable(b)
