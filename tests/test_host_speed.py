"""The host's speed read from the capture (load.tables.read_host_probe, analyzers/host.py):
the median own time of a fixed-work driver call, its corpus reference, and the principle the
evidence row states, checked on the corpus's own twin: one 1-GPU job captured on an H200 host
and on an H100 host (docs/replay.md, "The host's speed")."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from profclass.analyzers.host import MIN_PROBE_CALLS, PROBE_NS_CORPUS
from profclass.load.schema import Schema
from profclass.load.tables import PROBE_CALLS_READ, read_host_probe

SNAPS = Path(__file__).parent / "snapshots"
METRIC = "the host's speed"


def _speed(d) -> float | None:
    rows = [e["value"] for e in (d["evidence"] if isinstance(d, dict) else d.evidence)
            if e["metric"].startswith(METRIC)]
    return rows[0] if rows else None


def _export(path: Path, calls: list[tuple[str, int]]) -> sqlite3.Connection:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, nameId INTEGER, "
                "globalTid INTEGER, correlationId INTEGER)")
    names = sorted({n for n, _ in calls})
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names)))
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, 0, 0)",
                    [(i * 1000, i * 1000 + d, names.index(n)) for i, (n, d) in enumerate(calls)])
    con.commit()
    return con


def test_the_probe_is_the_median_of_that_call_alone(tmp_path):
    calls = [("cuKernelGetName", 100 + i % 7) for i in range(301)] + [("cudaLaunchKernel", 9000)] * 50 \
        + [("cuKernelGetAttribute", 5)] * 400
    con = _export(tmp_path / "x.sqlite", calls)
    want = int(np.median([100 + i % 7 for i in range(301)]))
    assert read_host_probe(con, Schema(con), "StringIds") == (want, 301)


def test_no_probe_calls_no_probe(tmp_path):
    con = _export(tmp_path / "x.sqlite", [("cudaLaunchKernel", 9000)] * 10)
    assert read_host_probe(con, Schema(con), "StringIds") is None


def test_the_read_is_bounded(tmp_path):
    con = _export(tmp_path / "x.sqlite", [("cuKernelGetName", 100)] * (PROBE_CALLS_READ + 5))
    assert read_host_probe(con, Schema(con), "StringIds") == (100, PROBE_CALLS_READ)


def test_the_corpus_reference_is_the_snapshots_spread():
    """PROBE_NS_CORPUS: the 10th, 50th and 90th percentile of every corpus capture's probe."""
    values = []
    for f in sorted(SNAPS.glob("*.json")):
        if f.name.startswith("diff__"):
            continue
        v = _speed(json.loads(f.read_text()))
        if v is not None:
            values.append(v)
    assert len(values) >= 60
    q = np.percentile(values, [10, 50, 90])
    assert tuple(int(round(x)) for x in q) == PROBE_NS_CORPUS
    assert MIN_PROBE_CALLS <= PROBE_CALLS_READ


@pytest.mark.parametrize("name", ["host_1gpu", "host_1gpu_h100"])
def test_every_host_bound_twin_shows_its_probe(diagnosis, name):
    assert _speed(diagnosis(name)) is not None


def test_the_twins_host_time_goes_as_their_probes(diagnosis):
    """One job (moe_train.py, launch-bound) on an H200 host and an H100 host: the ratio of their
    probes is the ratio of their steps without the profiler, within 5%; a constant per-call cost
    or no host model at all would leave the two steps apart by the step's host share only."""
    fast, slow = diagnosis("host_1gpu"), diagnosis("host_1gpu_h100")
    probe = _speed(slow) / _speed(fast)
    step = slow.replay["untraced_step_ms"] / fast.replay["untraced_step_ms"]
    assert probe > 1.2  # the twins' hosts do differ
    assert probe == pytest.approx(step, rel=0.05)
