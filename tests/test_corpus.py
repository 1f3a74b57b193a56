"""Behaviour on the real, labelled corpus (fixtures/corpus.toml): verdicts, wall shares,
stragglers, iteration sources, and the command line's JSON contract and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CORPUS, GC2_WINDOW, GC_WINDOW, PROFILES, profile_path, with_marks
from profclass.inputs import resolve
from profclass.load import load

NAMES = list(PROFILES)
# profiles with a wall built in (or measured by a counterfactual run); label "" asserts none
LABELLED = [n for n, p in PROFILES.items() if p["label"]]
WALLS = ("compute", "communication", "host", "memory")
MULTI_GPU = [n for n, p in PROFILES.items() if p["gpus"] > 1]
GRAPH_LEVEL_TRACED = {"graphs_cand_1gpu"}  # a CUDA-graphed step at nsys's default graph-level trace


def shares(d) -> dict[str, float]:
    return {w: d.walls[w]["share"] for w in WALLS}


@pytest.mark.parametrize("name", NAMES)
def test_profile_opens_and_holds_kernels(name, request):
    path = profile_path(name)
    if path.suffix == ".nsys-rep":
        request.getfixturevalue("nsys")
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    assert len(files) == (PROFILES[name]["gpus"] if "per rank" in PROFILES[name]["layout"] else 1)
    one_rank_of_many = PROFILES[name]["layout"] == "rank 0 only"
    with resolve([str(f) for f in files]) as inputs:
        for f in inputs:
            prof = load(f.sqlite)
            # a few hundred: the GEMM-heavy and GC pair bases run ~70-90 large kernels a step (3
            # captured steps: 268 on fp82_base_1gpu); under nsys's default graph-level CUDA-graph
            # trace one row per graph replay (10 captured)
            assert len(prof.kernels) > (10 if name in GRAPH_LEVEL_TRACED else 200), f.given
            assert prof.nsys_version.startswith("2024.2.3"), f.given
            assert (prof.kernels["end"] >= prof.kernels["start"]).all()
            gpus_in_file = prof.kernels.groupby(["pid", "device"]).ngroups
            expected = 1 if len(files) > 1 else PROFILES[name]["gpus"]
            assert gpus_in_file == expected, f.given


def test_every_label_has_a_basis_independent_of_profclass():
    """A verdict test compares profclass with the workload's construction, never with itself:
    every asserted label is the wall the workload was built to hit (issue 31: five labels that
    were profclass's own answer are "" now)."""
    assert LABELLED and all(PROFILES[n]["label"] == PROFILES[n].get("construction") for n in LABELLED)


@pytest.mark.parametrize("name", LABELLED)
def test_verdict_matches_label(name, diagnosis):
    d = diagnosis(name)
    assert d.verdict["wall"] == PROFILES[name]["label"], d.verdict["summary"]
    assert len(d.devices) == PROFILES[name]["gpus"]
    assert sum(shares(d).values()) == pytest.approx(1.0, abs=0.002)


@pytest.mark.parametrize("name", LABELLED)
def test_label_wall_has_the_share_to_back_it(name, diagnosis):
    s = shares(diagnosis(name))
    label = PROFILES[name]["label"]
    if label == "compute":
        assert s["compute"] >= 0.5
        assert s["compute"] == max(s.values())
    else:
        d = diagnosis(name)
        if label == "memory" and d.memory["memory_bound"]:
            # the seeds' memory wall is decided by fitting only with recompute, not by the largest
            # share: what it costs is the measured recompute, a tenth of the step or more
            from profclass.classify import MEMORY_BOUND_MIN_SHARE
            assert s[label] >= MEMORY_BOUND_MIN_SHARE
        else:  # the label's wall is the largest of the non-compute walls
            assert s[label] == max(s[w] for w in WALLS if w != "compute")
            assert s[label] >= 0.3


# loose but meaningful floors/ceilings on the shares each construction must produce
KEY_SHARES = [
    ("comm_4gpu", "communication", ">", 0.6),
    ("comm_4gpu_nonvtx", "communication", ">", 0.6),
    ("comm_4gpu_2xdispatch", "communication", ">", 0.6),
    ("dpnooverlap_4gpu", "communication", ">", 0.5),
    ("compute_1gpu", "compute", ">", 0.6),
    ("compute_4gpu", "compute", ">", 0.6),
    ("imbalance_4gpu", "compute", ">", 0.7),
    ("host_1gpu", "host", ">", 0.8),
    ("host_1gpu_h100", "host", ">", 0.8),
    ("host_1gpu_nonvtx", "host", ">", 0.8),
    ("tiny_host_1gpu", "host", ">", 0.8),
    ("host_1gpu", "compute", "<", 0.1),
    ("memory_offload_1gpu", "memory", ">", 0.5),
    ("compute_1gpu", "memory", "<", 0.05),
    ("comm_4gpu", "memory", "<", 0.05),
]


@pytest.mark.parametrize("name,wall,op,bound", KEY_SHARES, ids=[f"{n}-{w}{o}{b}" for n, w, o, b in KEY_SHARES])
def test_key_shares(name, wall, op, bound, diagnosis):
    share = diagnosis(name).walls[wall]["share"]
    assert share > bound if op == ">" else share < bound


@pytest.mark.parametrize("pair", CORPUS["pair"], ids=[f"{p['base']}->{p['candidate']}" for p in CORPUS["pair"]])
def test_pairs_move_the_changed_wall(pair, diagnosis):
    base = diagnosis(pair["base"]).walls[pair["wall"]]["ms_per_step"]
    cand = diagnosis(pair["candidate"]).walls[pair["wall"]]["ms_per_step"]
    if pair["kind"] == "regression":
        assert cand > base * 1.1
    else:
        assert cand < base * 0.9


@pytest.mark.parametrize("name", ["imbalance_4gpu", "imbalance_4gpu_perrank"])
def test_imbalance_straggler_is_rank0_and_others_wait(name, diagnosis):
    d = diagnosis(name)
    (s,) = d.stragglers
    assert s["rank"] == 0 and s["reason"] == "imbalance"
    step = d.window["step_ms"]["mean"]
    assert s["others_wait_ms_per_step"] > 0.3 * step
    assert s["blame_share"] > 0.8
    a2a = next(c for c in d.collectives if c["collective"] == "all_to_all")
    assert a2a["wait_ms_per_step"] > 5 * a2a["transfer_ms_per_step"]
    by_rank = {dv["rank"]: dv for dv in d.devices}
    hot_wait = by_rank[0]["comm"]["wait_ns"]
    assert all(by_rank[r]["comm"]["wait_ns"] > 5 * hot_wait for r in (1, 2, 3))


def test_host_straggler_is_rank1(diagnosis):
    d = diagnosis("hoststraggler_4gpu")
    assert d.verdict["wall"] == "host"
    assert [(s["rank"], s["reason"]) for s in d.stragglers] == [(1, "host")]
    by_rank = {dv["rank"]: dv for dv in d.devices}
    idle = {r: dv["walls"]["host"]["ms_per_step"] for r, dv in by_rank.items()}
    assert idle[1] > 2 * max(idle[r] for r in (0, 2, 3))


@pytest.mark.parametrize("name", ["compute_4gpu", "comm_4gpu", "comm_4gpu_2xdispatch", "comm_4gpu_nonvtx",
                                  "dpnooverlap_4gpu", "dpoverlap_4gpu"])
def test_balanced_jobs_have_no_straggler(name, diagnosis):
    assert diagnosis(name).stragglers == []


@pytest.mark.parametrize("name", [n for n in MULTI_GPU if "per rank" in PROFILES[n]["layout"]])
def test_per_rank_reports_are_clock_aligned(name, diagnosis):
    clock = diagnosis(name).clock
    assert clock["aligned_sources"] == PROFILES[name]["gpus"] - 1
    # collectives end together on every rank: after alignment they agree to within 0.1 ms
    assert all(0 <= v < 100_000 for v in clock["residual_skew_ns"].values())


def expected_window_source(profile: dict) -> str:
    """'nvtx' where the workload emits iteration ranges, else 'periodicity' (from the command)."""
    cmd = profile["command"]
    if "iteration_marks" in profile:  # megatron_layouts.py: the marks it emits, per the corpus
        return "periodicity" if profile["iteration_marks"] == "none" else "nvtx"
    if "--no-nvtx" in cmd or ("megatron_moe.py" in cmd and "--nvtx" not in cmd.split()):
        return "periodicity"
    return "nvtx"


@pytest.mark.parametrize("name", with_marks(NAMES, {"gc_cand_1gpu": GC_WINDOW, "gc2_base_1gpu": GC2_WINDOW}))
def test_window_source(name, diagnosis):
    d = diagnosis(name)
    want = expected_window_source(PROFILES[name])
    assert d.window["source"] == want
    # every GPU found that source, or took the job's step found by it (``job``)
    assert set(d.window["sources"].values()) <= {want, "job"} and want in d.window["sources"].values()
    assert d.window["iterations"] >= 2
    # the steady step is close to the workload's own timer (it measures the same loop); the
    # timer's figure is a mean, and where a long pause comes every few steps (gc_base_1gpu: a
    # 200 ms collection every 2-3 steps of 25 ms) only the mean, not the median, can match it
    timer = PROFILES[name]["workload_step_ms"]
    step = d.window["step_ms"]
    assert step["median"] == pytest.approx(timer, rel=0.35) or step["mean"] == pytest.approx(timer, rel=0.35)


# ---------------------------------------------------------------------------------------------
# the command line

def cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("profclass")
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", "from profclass.cli import main; main()"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)


REQUIRED_KEYS = {
    "verdict": {"wall", "confidence", "runner_up", "summary", "scores"},
    "walls": set(WALLS),
    "window": {"source", "iterations", "step_ms"},
    "devices": None, "stragglers": None, "collectives": None, "fixes": None, "evidence": None,
    "missing": None, "config": None, "pitfalls": None,
}


def test_cli_json_has_every_required_key(diagnosis):
    proc = cli("diagnose", str(profile_path("imbalance_4gpu")), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(REQUIRED_KEYS) <= set(out)
    for key, sub in REQUIRED_KEYS.items():
        if sub is not None:
            assert sub <= set(out[key]), key
    for key in ("devices", "stragglers", "collectives", "fixes", "evidence", "missing", "pitfalls"):
        assert isinstance(out[key], list), key
    assert isinstance(out["config"], dict)
    for wall in WALLS:
        assert set(out["walls"][wall]) >= {"share", "ms_per_step"}
    assert set(out["window"]["step_ms"]) >= {"mean", "median", "std", "min", "max", "per_iteration"}
    assert out["verdict"]["wall"] == "compute"
    assert out["stragglers"][0]["rank"] == 0
    # the JSON is the library's Diagnosis, not a separate computation
    d = diagnosis("imbalance_4gpu")
    assert out["walls"] == json.loads(d.to_json())["walls"]
    assert len(out["devices"]) == 4 and out["fixes"] and out["evidence"]


def test_cli_fail_on_exits_3_only_for_the_named_walls():
    path = str(profile_path("host_1gpu"))
    hit = cli("diagnose", path, "--fail-on", "memory,host")
    assert hit.returncode == 3, hit.stderr
    assert "host" in hit.stdout  # the report is still printed
    miss = cli("diagnose", path, "--fail-on", "compute", "--format", "json")
    assert miss.returncode == 0, miss.stderr
    assert json.loads(miss.stdout)["verdict"]["wall"] == "host"
