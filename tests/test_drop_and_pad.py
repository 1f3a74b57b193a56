"""Drop-and-pad (``moe_drop_and_pad``, transform ``static_shapes``) and the experts' phase of a job
with no EP all-to-all (``collectives.varying_stretches``), on committed captures."""
from __future__ import annotations

import math
import re
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import profile_path
from profclass import diagnose
from profclass.formatting import plan_steps, trade_off_text, what_if_lines
from profclass.replay import collectives, routing, shapes
from profclass.replay.run import replayer_of
from profclass.replay.scenario import captured
from profclass.replay.trace import COMM, COMPUTE, MEMSET

ROOT = Path(__file__).resolve().parent.parent
TIMERS = ROOT / "fixtures" / "timers.tar.xz"


def _traces(name: str):
    return replayer_of(diagnose(str(profile_path(name)), keep_replay=True).extra.replay_inputs).traces


def _unique_stretches(t) -> np.ndarray:
    """The same reading by another route: each stream cut at the attention and softmax kernels,
    and the router's top-k, each stretch's GEMMs as a tuple of (kernel, CTAs) in start order, and the
    ops of the stretches whose tuple no other stretch has, less the cuts (no hashing)."""
    df = pd.DataFrame({"stream": t.ops.stream, "start": t.ops.start, "name": t.ops.name, "grid": t.ops.grid,
                       "gemm": t.ops.gemm & (t.ops.kind != COMM),
                       "cut": t.ops_named(lambda n: collectives.DENSE_PART.search(n)
                                          or collectives.MOE_ROUTER.search(n))}).sort_values(["stream", "start"])
    df["stretch"] = (df["cut"] | (df["stream"] != df["stream"].shift())).cumsum()
    g = df[df["gemm"]]
    sig = g.groupby("stretch").apply(lambda x: tuple(zip(x["name"], x["grid"])), include_groups=False)
    once = sig[sig.map(sig.value_counts()) == 1].index
    out = np.zeros(t.n_ops, bool)
    out[df.index[df["stretch"].isin(once) & ~df["cut"]]] = True
    return out


def test_a_one_gpu_moe_jobs_varying_stretches_are_its_unrepeated_gemm_sequences():
    """On a one-GPU MoE capture (every expert local: no all-to-all marks the experts) the experts'
    phase is most of its GEMMs, no attention kernel, and exactly the stretches a plain tuple
    comparison finds unrepeated."""
    t = _traces("compute_1gpu")[0]
    phase = collectives.varying_stretches(t)
    assert (t.ops.gemm & phase).sum() > (t.ops.gemm & ~phase).sum() > 0
    assert not (phase & t.ops_named(collectives.ATTENTION.search)).any()
    assert (phase == _unique_stretches(t)).all()


@pytest.mark.parametrize("name", ["mcore_1gpu_dense_small", "graphs_base_1gpu"])
def test_a_job_with_no_router_has_no_varying_stretch(name):
    """A dense model, or a stack of MLPs with no attention kernel to cut its stream, has no experts:
    nothing is read as their phase (before the router check, the MLP stack read whole)."""
    assert not any(collectives.varying_stretches(t).any() for t in _traces(name))


def test_drop_and_pad_is_offered_on_a_one_gpu_moe_job_and_prices_more_than_its_loads(diagnosis):
    """The fix follows the loads (one GPU, no EP spread to read), and static shapes remove the loads
    and more: its replayed price is above host_kernel_loads' on the same capture."""
    d = diagnosis("compute_1gpu")
    fixes = {f["id"]: f for f in d.fixes}
    assert {"moe_drop_and_pad", "host_kernel_loads"} <= set(fixes)
    pad, loads = fixes["moe_drop_and_pad"]["expected_gain_ms"], fixes["host_kernel_loads"]["expected_gain_ms"]
    assert pad > loads > 0


def test_drop_and_pad_is_not_offered_where_nothing_is_loaded(diagnosis):
    assert "moe_drop_and_pad" not in [f["id"] for f in diagnosis("mcore_ep4_base").fixes]


def test_with_ep_all_to_alls_drop_and_pad_prices_at_least_balance_and_the_unblocked_syncs_together():
    """Where the experts sit between EP all-to-alls, static_shapes is routing balance and the
    dispatcher's unblocked syncs, with every launch of the experts' phase fixed, not its GEMMs'
    alone: at each point at least what the two fixes replay together."""
    path = str(profile_path("mcore_ep4_unbalanced"))
    asked = ("moe_drop_and_pad", "ep_balance_routing+host_moe_token_sync")
    r = diagnose(path, price_fixes=asked).replay["requested"]
    assert r[asked[0]]["best_ms"] > 0
    for k in ("low_ms", "best_ms", "high_ms"):
        assert r[asked[0]][k] >= r[asked[1]][k] - 0.05, k


def test_fixed_shapes_cut_only_launches_inside_the_experts_phase_and_never_add():
    t = _traces("compute_1gpu")[0]
    w = captured(t)
    after = shapes.fixed_shapes(t, w, None, None, 1.0)
    cut = w.c_gap - after.c_gap
    assert (cut >= 0).all() and cut.sum() > 0
    inside = (t.ops.launch >= 0) & collectives.expert_phase(t, None, None)
    allowed = np.zeros(len(cut), bool)
    allowed[t.ops.launch[inside]] = True
    assert not cut[~allowed].any()
    # the GEMM launches' rule cuts a part of it
    assert (w.c_gap - shapes.repeat_shapes(t, w, None, None, 1.0).c_gap).sum() <= cut.sum()



def test_a_kind_only_the_phase_runs_is_cut_to_its_threads_typical_launch_gap():
    """On call IA's dropless capture, launches in the experts' phase whose kind (a GEMM, a memset,
    else the kernel's name) runs nowhere else on their thread are cut to that thread's median gap
    before its launches outside the phase, never below it; some of those kinds are the dropless
    path's own, which the padded twin does not run at all."""
    (t,) = _traces("mcore_moe1_dropless")
    w = captured(t)
    after = shapes.fixed_shapes(t, w, None, None, 1.0)
    launch, tid = t.ops.launch, t.calls.c_tid
    launched = launch >= 0
    inside = launched & collectives.varying_stretches(t)
    kind = np.where(t.ops.gemm, -2, np.where(t.ops.kind == MEMSET, -3, t.ops.name))
    outside_kinds = set(zip(tid[launch[launched & ~inside]], kind[launched & ~inside]))
    lone = np.flatnonzero(inside & np.array([(a, b) not in outside_kinds for a, b in zip(tid[launch], kind)]))
    assert len(lone) > 50
    typical = {th: np.median(w.c_gap[launch[launched & ~inside & (tid[launch] == th)]]) for th in set(tid)}
    cap = np.array([typical[tid[launch[i]]] for i in lone])
    got, had = after.c_gap[launch[lone]], w.c_gap[launch[lone]]
    assert (got <= np.maximum(cap, had) + 1).all() and (got >= np.minimum(cap, had) - 1).all()
    assert (had - got).sum() > 0.1 * (had.sum())
    padded = set(_traces("mcore_moe1_padded")[0].names)
    assert {t.names[t.ops.name[i]] for i in lone if t.ops.name[i] >= 0} - padded

# ---- what capacity factor 1.0 drops: the fix's trade-off (replay/routing.py) ------------------------------
ROUTING = re.compile(r"^ROUTING it=(\d+) call=(\d+) rank=(\d+) counts=([\d,]+)$", re.M)
ROUTING_LOGS = ("fa_learned", "fa_skew05", "fa_skew15", "fb_e16_skew10", "fb_aux0",
                "ff_e16", "ff_top4", "ff_skew025", "fg_bal_small", "fg_bal", "fg_bal_e16")
CAPTURED_STEPS = range(12, 16)  # the configs' trace_from..trace_to


def _capacity_dropped_pct(text: str, steps) -> float:
    """Megatron-Core's drop (apply_router_token_dropping) recomputed from the ROUTING lines: on each
    source rank, each router call keeps ceil(tokens x top-k / experts) tokens per expert (a call's
    counts sum to its tokens x top-k); the rest of each expert's count is dropped."""
    dropped = routed = 0
    for it, _, _, counts in ROUTING.findall(text):
        if int(it) in steps:
            c = np.array([int(x) for x in counts.split(",")])
            cap = math.ceil(c.sum() / len(c))
            dropped, routed = dropped + np.clip(c - cap, 0, None).sum(), routed + c.sum()
    return 100.0 * dropped / routed


@pytest.fixture(scope="module")
def capacity_truth() -> dict[str, float]:
    with tarfile.open(TIMERS, "r:xz") as tar:
        logs = {k: tar.extractfile(f"fixtures/timers/s45/{k}.log").read().decode() for k in ROUTING_LOGS}
    return {k: _capacity_dropped_pct(text, CAPTURED_STEPS) for k, text in logs.items()}


def _doc_rows() -> dict[str, tuple[float | None, float, float]]:
    """docs/fixes.md's table: stage -> (bound registered before its lines were read, or None; bound
    profclass reads at HEAD; dropped per the ROUTING lines)."""
    text = (ROOT / "docs" / "fixes.md").read_text()
    block = text.split("<!-- capacity-drops:begin -->")[1].split("<!-- capacity-drops:end -->")[0]
    return {m[0]: (None if m[1] == "-" else float(m[1]), float(m[2]), float(m[3]))
            for m in re.findall(r"^\| `(\w+)` \|[^|]*\| (-|[\d.]+) \| ([\d.]+) \| ([\d.]+) \|", block, re.M)}


def test_the_documented_capacity_drops_are_the_routing_lines_and_every_bound_stays_below_them(capacity_truth):
    """Calls FA, FB, FF and FG (docs/fixes.md, 'What drop-and-pad drops'): what capacity 1.0 drops,
    recomputed from the packed job logs, is the table's; profclass's bounds, read from each stage's
    export at HEAD and registered (FB's and FF's, in docs/notes.md before their lines were read),
    are below it on every stage."""
    rows = _doc_rows()
    assert set(rows) == set(ROUTING_LOGS)
    for stage, (registered, bound, documented) in rows.items():
        assert documented == pytest.approx(capacity_truth[stage], abs=0.05), stage
        assert 0 <= bound <= capacity_truth[stage], stage
        assert registered is None or 0 <= registered <= capacity_truth[stage], stage
    notes = (ROOT / "docs" / "notes.md").read_text()
    registered = dict(re.findall(r"^\| F[BF]\d `(\w+)` .*\| [0-9a-f]{16} \| ([\d.]+) \|$", notes, re.M))
    assert set(registered) == {"fb_e16_skew10", "fb_aux0", "ff_e16", "ff_top4", "ff_skew025"}
    assert all(float(v) == rows[k][0] for k, v in registered.items())


def test_the_bound_reads_a_skewed_router_and_next_to_nothing_on_a_force_balanced_one():
    """A router biased towards rank 0's experts (`imbalance_4gpu`) gives a bound many times a
    force-balanced job's (`mcore_ep4_base`: every expert the same count, give or take sampling)."""
    asked = [diagnose(str(profile_path(n)), price_fixes=("moe_drop_and_pad",))
             for n in ("imbalance_4gpu", "mcore_ep4_base")]
    skewed, even = (d.replay["requested"]["moe_drop_and_pad"]["trade_off"]["at_least_pct"] for d in asked)
    assert skewed > 10 * even and even < 2
    # --what-if says the trade beside the price
    assert what_if_lines(asked[0])[0].endswith(f"at least {skewed:.1f}% at the captured routing)")


def test_without_ep_all_to_alls_the_trade_off_is_named_and_not_measured(diagnosis):
    """One GPU: the experts' loads are not on the timeline; the trade-off is still said, with no number."""
    f = {x["id"]: x for x in diagnosis("compute_1gpu").fixes}["moe_drop_and_pad"]
    assert f["trade_off"]["at_least_pct"] is None and f["trade_off"]["basis"].startswith("not measured")
    assert trade_off_text(f) == "trade-off: routed tokens dropped at capacity factor 1.0, not measured on this profile"
    d = diagnosis("imbalance_4gpu")
    step = plan_steps(d)[[p["id"] for p in d.plan].index("moe_drop_and_pad")]
    assert step.endswith(f"({trade_off_text({x['id']: x for x in d.fixes}['moe_drop_and_pad'])})")


def test_per_expert_reading_splits_phases_two_and_four_gemms_an_expert_and_never_reads_less_than_the_ranks():
    """On a Megatron-Core EP 4 capture with learned routing (local experts as their own GEMMs): the
    phases split into experts two GEMMs apiece forward and four backward (recomputed here by a plain
    walk over each phase's GEMMs), and per phase the experts' share above their mean is at least
    the ranks' (an expert's excess can only add, never cancel, inside its rank)."""
    r = replayer_of(diagnose(str(profile_path("mcore_ep4_unbalanced")), keep_replay=True).extra.replay_inputs)
    seg, groups = r.ctx.ep_segments, r.ctx.op_groups
    frames = []
    for gi, (t, w, s) in enumerate(zip(r.traces, r.captured, seg)):
        sel = collectives.expert_phase(t, s, groups[gi]) & (t.ops.kind == COMPUTE) & (s >= 0) & t.ops.gemm
        frames.append(routing._expert_work(t, w, s, sel, gi))
        phases: dict[int, list[int]] = {}
        for i in sorted(np.flatnonzero(sel), key=lambda i: (s[i], t.ops.start[i])):
            phases.setdefault(int(s[i]), []).append(int(w.op_dur[i]))
        sizes = sorted({len(v) for v in phases.values()})
        c = max((n for n in sizes if n % 2 == 0 and 2 * n in sizes),
                key=lambda n: sum(len(v) in (n, 2 * n) for v in phases.values()))
        walked: dict[tuple[int, int], int] = {}
        for k, v in phases.items():
            for j, d in enumerate(v if len(v) in (c, 2 * c) else ()):
                key = (k, j // (2 if len(v) == c else 4))
                walked[key] = walked.get(key, 0) + d
        got = frames[-1].groupby(["seg", "expert"])["work"].sum()
        assert {(int(a), int(b)): int(x) for (a, b), x in got.items()} == walked
        assert c >= 4  # EP 4 of 8 experts or more: two local experts at least
    work = np.array([np.bincount(s[(s >= 0)], weights=np.where(
        collectives.expert_phase(t, s, groups[gi]) & (t.ops.kind == COMPUTE) & t.ops.gemm, w.op_dur, 0)[(s >= 0)],
        minlength=max(int(x.max()) for x in seg) + 1) for gi, (t, w, s) in enumerate(zip(r.traces, r.captured, seg))])
    ranks = (work > 0).sum(axis=0)
    by_expert, resolved = routing._expert_shares(pd.concat(frames), ranks)
    by_rank = np.clip(work - work.sum(axis=0) / np.maximum(ranks, 1), 0, None).sum(axis=0) / np.maximum(work.sum(0), 1)
    assert resolved.sum() > (ranks >= 2).sum() // 2  # most experts' phases split
    assert (by_expert[resolved] >= by_rank[resolved] - 1e-9).all()
    assert (by_expert[resolved] > by_rank[resolved] + 1e-3).any()
