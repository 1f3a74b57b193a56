"""The shipped per-call tracing cost (``TRACED_CALL_NS``) is what its probes measured: derived
here from the raw lines packed in fixtures/timers.tar.xz, by the rule its comment states (per
host and probe, the traced runs' median per call less the untraced runs'; best the median host
for a launch and the hosts' mean for other calls, low and high the hosts' extremes; to 0.1 us)."""
from __future__ import annotations

import io
import json
import statistics
import tarfile
from pathlib import Path

import pytest

from profclass.replay.constants import TRACED_CALL_NS

TIMERS = Path(__file__).resolve().parent.parent / "fixtures" / "timers.tar.xz"


@pytest.fixture(scope="module")
def lines() -> dict[str, list[dict]]:
    out = {}
    with tarfile.open(TIMERS, "r:xz") as tar:
        for m in tar.getmembers():
            if m.name.endswith(".jsonl"):
                text = io.TextIOWrapper(tar.extractfile(m), encoding="utf-8").read()
                out[m.name.split("fixtures/timers/")[-1]] = [json.loads(x) for x in text.splitlines()
                                                             if x.startswith("{")]
    return out


def _diff(rows: list[dict], value: str, **match) -> float:
    sel = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    traced = [r[value] for r in sel if r["traced"]]
    untraced = [r[value] for r in sel if not r["traced"]]
    assert len(traced) >= 2 and len(untraced) >= 2, match
    return statistics.median(traced) - statistics.median(untraced)


def _hosts(lines) -> tuple[list[float], list[float]]:
    """(launch, other) ns per host."""
    h100 = lines["cupti_cost_h100.jsonl"]
    h200 = lines["s27/cupti_cost_h200.jsonl"]
    gap = lines["s27/gap_cost_h200.jsonl"]
    sync = lines["sync_cost_h200.jsonl"]
    launch = [
        statistics.median([_diff(h100, "median_ns", call="launch"), _diff(h100, "median_ns", call="memcpy_d2d")]),
        statistics.median([_diff(h200, "median_ns", call="launch"), _diff(h200, "median_ns", call="memcpy_d2d"),
                           _diff(gap, "launch_ns", case="none")]),
        _diff(sync, "next_launch_ns", kernels_before=0),
    ]
    other = [statistics.median([_diff(h, "median_ns", call=c) for c in ("event_record", "stream_wait_event")])
             for h in (h100, h200)]
    return launch, other


def _to_100ns(x: float) -> int:
    return int(round(x / 100.0)) * 100


def test_the_launch_cost_is_the_median_host_measured(lines):
    launch, _ = _hosts(lines)
    assert TRACED_CALL_NS["launch"] == (_to_100ns(min(launch)), _to_100ns(statistics.median(launch)),
                                        _to_100ns(max(launch)))


def test_the_other_calls_cost_is_the_hosts_mean(lines):
    _, other = _hosts(lines)
    assert TRACED_CALL_NS["other"] == (_to_100ns(min(other)), _to_100ns(statistics.mean(other)),
                                       _to_100ns(max(other)))


def test_the_hosts_differ_by_more_than_the_first_hosts_own_spread(lines):
    """Why one host's loop is not the constant: the H200 hosts add about twice the H100 host's."""
    launch, other = _hosts(lines)
    assert min(launch[1:]) > 1.8 * launch[0]
    assert other[1] > 1.5 * other[0]


def test_host_speed_is_the_profiler_probes_untraced_spread():
    """``HOST_SPEED`` by the rule its comment states: the largest ratio between the two untraced
    runs of one config in the profiler probe (timers/profcost, iterations 5..9), its square root
    either way, to 0.01."""
    import math
    import re

    from profclass.replay.constants import HOST_SPEED

    means = {}
    with tarfile.open(TIMERS, "r:xz") as tar:
        for m in tar.getmembers():
            hit = re.search(r"timers/profcost/pc_(\w+)_u([12])\.log$", m.name)
            if hit:
                text = io.TextIOWrapper(tar.extractfile(m), encoding="utf-8").read()
                steps = {int(a): float(b) for a, b in re.findall(r"STEP_MS it=(\d+) ms=([\d.]+)", text)}
                means.setdefault(hit.group(1), []).append(statistics.mean(steps[i] for i in range(5, 10)))
    assert sorted(means) == ["ep4_base", "pp4_m8", "tp2sp_ep2"] and all(len(v) == 2 for v in means.values())
    ratio = max(max(v) / min(v) for v in means.values())
    assert HOST_SPEED == (round(math.sqrt(ratio), 2), round(1 / math.sqrt(ratio), 2))
