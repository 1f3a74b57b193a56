"""The step change split into its causes by the replay (``step.split`` of the diff JSON).

The base's captured step is replayed (its dependency graph, profclass.replay) with the
candidate's measured costs put in one class at a time:

- ``compute``: compute kernels, per GPU and normalised kernel name;
- ``<group> transfers``: collectives per GPU, group (TP, EP, DP, PP, ...) and kernel name: a
  collective matched across ranks by its transfer (its waiting stays an outcome of the
  replay), an unmatched one (PP send/recv, peers outside the profile) by its duration;
- ``host``: per GPU, the CPU work of the launching threads (calls' own time, the time between
  calls); their hand-offs (a thread waking after another's call) scale with it, but are waits,
  not work, so they do not count in its time;
- ``memory``: copies and memsets per GPU and name, and allocator calls per GPU.

Each key's cost per step is scaled to the candidate's (its time per step over the base's):
the candidate's mean per op where the counts match; where they differ, the name's time per
step follows the candidate's (a kernel run fewer times costs less), spread over the base's ops.

A recognised configuration change (``fix_gains``) whose transform changes the step's
structure (``STRUCTURAL_KINDS``: ops or calls that no longer run, waits that go, launches
merged into graphs) is replayed first. The collector's pauses (host stretches outside the
steps' rhythm: GC ranges, else ``host.host_pauses``) are then taken out of both sides, and their
part is what they cost the candidate's replayed step less what they cost the base's: a change of
code can move a generation-2 collection into or out of a short window, and in the host's rate it
would read as a slower or faster host. The classes are measured on top of both. The
classes' parts are Shapley values over the 2**n subsets of classes (at most ``MAX_CLASSES``),
so they add up to the all-together replay whatever the order. What the base's graph cannot
express (kernels only the candidate runs, a changed order or overlap) is the rest: the
measured change minus every part, "not explained by per-op costs", with the op counts as
evidence. The parts are changes of the replayed step, so a cost that moved off the critical
path counts for nothing.
"""
from __future__ import annotations

from dataclasses import replace
from math import factorial

import numpy as np
import pandas as pd

from ..replay import transforms
from ..replay.run import Replayer
from ..replay.trace import ALLOC, COMM, COMPUTE

# fix transforms that change what runs (not what it costs): per-op costs cannot express them
STRUCTURAL_KINDS = ("drop_recomputed", "unblock", "cuda_graphs")
# 2**6 = 64 replays at most (about 20 ms each on a 4-GPU corpus capture); more collective
# groups than fit are merged into one class
MAX_CLASSES = 6
HOST, MEMORY, CALLS = "host", "memory", "(calls)"


def split_step(b, c, measured_ms: float, applied: list[dict], table: dict, rb: Replayer | None = None) -> dict:
    """The ``step.split`` section: parts, what is not explained, evidence, and ``missing``.
    ``rb``: the base's replayer where the caller built one (``diff`` prices the fixes on it)."""
    missing = _cannot_split(b, c)
    if missing:
        return _empty(measured_ms, missing)
    rb, rc = rb or Replayer(b.extra.replay_inputs), Replayer(c.extra.replay_inputs)
    pairing = _pairing(rb.inp.ranks, rc.inp.ranks)
    weights, parts = _configuration(rb, applied, table)
    weights, cand_weights, pauses = _collector(rb, rc, weights)
    parts += pauses
    base_rows = _cost_rows(rb, weights, np.arange(len(rb.traces)))
    cand_rows = _cost_rows(rc, cand_weights, pairing)
    _phases(base_rows, cand_rows)
    classes = _classes(base_rows)
    factors = _factors(base_rows, cand_rows, classes)
    values = _subset_values(rb, weights, factors, len(classes))
    shapley, alone = _shapley(values, len(classes))
    parts += [dict(cause=_label(k), kind="cost", cls=k, delta_ms=round(float(v), 3), alone_ms=round(float(a), 3))
              for k, v, a in zip(classes, shapley, alone)]
    rest = round(measured_ms - sum(p["delta_ms"] for p in parts), 3)
    return dict(method=f"shapley over {len(classes)} cost classes ({2 ** len(classes)} replays)"
                + (", after the recognised change replayed first" if any(p["kind"] == "configuration" for p in parts)
                   else "")
                + (", both sides' collector pauses taken out first" if any(p["kind"] == "pauses" for p in parts)
                   else ""),
                measured_delta_ms=round(measured_ms, 3),
                replayed_delta_ms=round(sum(p["delta_ms"] for p in parts), 3), parts=parts,
                not_explained_ms=rest, evidence=_evidence(base_rows, cand_rows, rb, rc),
                summary=_summary(measured_ms, parts, rest), missing=[])


def _empty(measured_ms: float, missing: list[str]) -> dict:
    return dict(method=None, measured_delta_ms=round(measured_ms, 3), replayed_delta_ms=None, parts=[],
                not_explained_ms=None, evidence=None, summary=None, missing=missing)


def _cannot_split(b, c) -> list[str]:
    """Why the replay cannot split this pair (empty: it can)."""
    out = []
    for name, d in (("base", b), ("candidate", c)):
        inp = getattr(getattr(d, "extra", None), "replay_inputs", None)
        if inp is None:
            out.append(f"split: the {name} has no replay inputs (a stored diagnosis, or diagnosed without "
                       "keep_replay): the step change is not split into its causes")
        elif not any(t.n_ops for t in inp.traces):
            out.append(f"split: the {name} has no steady step with GPU work to replay")
        elif any(t.ops.name is None for t in inp.traces):
            out.append(f"split: the {name}'s replay traces hold no kernel names")
    if out:
        return out
    nb, nc = len(b.extra.replay_inputs.traces), len(c.extra.replay_inputs.traces)
    if nb != nc:
        return [f"split: different GPU counts ({nb} vs {nc}): the base's graph cannot take the candidate's "
                "costs GPU by GPU"]
    rb, rc = b.extra.replay_inputs.ranks, c.extra.replay_inputs.ranks
    if None not in rb and None not in rc and sorted(rb) != sorted(rc):
        return ["split: the runs hold different ranks: the base's graph cannot take the candidate's costs GPU by GPU"]
    return []


def _pairing(ranks_b, ranks_c) -> np.ndarray:
    """For each candidate GPU, the base GPU it stands for: the same rank, else the same place."""
    if None in ranks_b or None in ranks_c:
        return np.arange(len(ranks_c))
    where = {r: i for i, r in enumerate(ranks_b)}
    return np.array([where[r] for r in ranks_c], np.int64)


def _configuration(r: Replayer, applied: list[dict], table: dict) -> tuple[list, list[dict]]:
    """The base's weights after each recognised structural change, replayed in turn, and the
    parts those replays give."""
    weights, parts = r.captured, []
    for row in applied:
        spec = (table.get(row["fix"]) or {}).get("transform")
        if not spec or spec.get("kind") not in STRUCTURAL_KINDS:
            continue
        after = transforms.apply(spec, "best", r.traces, weights, r.ctx)
        if after is None:
            continue
        delta = r.step_ms(r.replay(after)) - r.step_ms(r.replay(weights))
        parts.append(dict(cause=f"{row['fix']} (the recognised change, replayed with its transform)",
                          kind="configuration", cls=row["fix"], delta_ms=round(delta, 3), alone_ms=round(delta, 3)))
        weights = after
    return weights, parts


def _collector(rb: Replayer, rc: Replayer, weights: list) -> tuple[list, list, list[dict]]:
    """(the base's weights, the candidate's, the parts): each side's collector pauses taken out
    (the ``remove_gc`` transform, all of them), and one part, their cost to the candidate's
    replayed step less their cost to the base's, where either side has any."""
    free = {"kind": "remove_gc", "removed": 1.0}
    b_free = transforms.apply(free, "best", rb.traces, weights, rb.ctx)
    c_free = transforms.apply(free, "best", rc.traces, rc.captured, rc.ctx)
    if b_free is None and c_free is None:
        return weights, rc.captured, []

    def cost(r: Replayer, w: list, w_free: list | None) -> float:
        return 0.0 if w_free is None else r.step_ms(r.replay(w)) - r.step_ms(r.replay(w_free))

    def seen(r: Replayer) -> int:
        return min(t.iterations for t in r.traces)  # host_pauses needs 3 steps to tell a pause from the rhythm

    def said(name: str, r: Replayer, ms: float) -> str:
        return f"{name} {ms:.1f}" if seen(r) >= 3 else f"{name} not seen in a {seen(r)}-step window"

    b_ms, c_ms = cost(rb, weights, b_free), cost(rc, rc.captured, c_free)
    delta = round(c_ms - b_ms, 3)
    return b_free or weights, c_free or rc.captured, [dict(
        cause=f"collector pauses (ms/step: {said('base', rb, b_ms)}, {said('candidate', rc, c_ms)})", kind="pauses",
        cls="pauses", delta_ms=delta, alone_ms=delta, base_ms=round(b_ms, 3) if seen(rb) >= 3 else None,
        candidate_ms=round(c_ms, 3) if seen(rc) >= 3 else None)]


def _cost_rows(r: Replayer, weights: list, gpu_of: np.ndarray) -> pd.DataFrame:
    """Every cost the classes scale: one row per op (its class, key name, ns) and two per GPU
    for its calls (host time, allocator time), with the window's iterations. A collective's key
    is its collective type (all_reduce, all_to_all), so a bucketed all-reduce is the same key
    in other kernels. ``gpu_of``: the base GPU each stands for."""
    frames = []
    for gi, (t, w, xfer, kd) in enumerate(zip(r.traces, weights, r.transfer, r.groups)):
        names = np.asarray(t.names + ("",), object)[np.where(t.ops.name >= 0, t.ops.name, len(t.names))]
        cls = np.where(t.ops.kind == COMPUTE, "compute", MEMORY).astype(object)
        group, coll = np.full(t.n_ops, "", object), np.full(t.n_ops, "", object)
        group[kd["op"]], coll[kd["op"]] = kd["group"], kd["collective"]
        comm = t.ops.kind == COMM
        cls[comm] = np.where(group[comm] == "", "ungrouped", group[comm]).astype(object)
        names[comm] = np.where(coll[comm] == "", names[comm], coll[comm])
        ns = np.where(xfer >= 0, xfer * w.transfer_scale, w.op_dur).astype(np.float64)
        alloc = t.calls.c_kind == ALLOC
        host = float(w.c_gap.sum() + w.c_dur[~alloc].sum())  # CPU work: hand-off lags scale with it, not in it
        frames.append(pd.DataFrame(dict(gpu=int(gpu_of[gi]), cls=np.append(cls, [HOST, MEMORY]),
                                        name=np.append(names, [CALLS + " host", CALLS + " allocator"]),
                                        ns=np.append(ns, [host, float(w.c_dur[alloc].sum())]),
                                        its=float(max(t.iterations, 1)),
                                        count=np.append(np.ones(t.n_ops), [0.0, 0.0]))))
    return pd.concat(frames, ignore_index=True)


def _phases(base: pd.DataFrame, cand: pd.DataFrame) -> None:
    """Where every GPU runs as many EP all-to-alls in both windows, a compute kernel's or an EP
    collective's key includes its phase (how many all-to-alls came before it on its GPU): the
    k-th all-to-all on both sides is the same point of the same program, so routing that loaded
    other ranks in a phase moves with it; else no phases."""
    counts = []
    for rows in (base, cand):
        a2a = (rows["cls"] == "EP") & (rows["name"] == "all_to_all")
        rows["phase"] = a2a.astype(np.int64).groupby(rows["gpu"]).cumsum()
        counts.append(a2a.groupby(rows["gpu"]).sum())
    if not counts[0].equals(counts[1]) or not counts[0].any():
        base["phase"], cand["phase"] = -1, -1
    else:  # only compute and the EP collectives follow the routing: a collective of another
        # group that moved between phases (overlapped with the backward) is the same cost
        for rows in (base, cand):
            rows.loc[~rows["cls"].isin(["compute", "EP"]) | rows["name"].str.startswith(CALLS), "phase"] = -1


def _classes(rows: pd.DataFrame) -> list[str]:
    """compute, the collective groups (by their time, largest first; beyond MAX_CLASSES the
    smallest merged into one), host, memory."""
    fixed = ("compute", HOST, MEMORY)
    comm = rows[~rows["cls"].isin(fixed)]
    groups = (comm["ns"] / comm["its"]).groupby(comm["cls"]).sum().sort_values(ascending=False)
    keep = list(groups.index[:MAX_CLASSES - len(fixed)])
    if len(groups) > len(keep):
        keep[-1] = "other groups"
    return ["compute", *keep, HOST, MEMORY]


def _class_of(cls: pd.Series, classes: list[str]) -> pd.Series:
    """Each row's class (a collective group beyond MAX_CLASSES: "other groups")."""
    return cls.where(cls.isin(classes), "other groups")


def _factors(base: pd.DataFrame, cand: pd.DataFrame, classes: list[str]) -> dict:
    """class -> per base row (``_cost_rows``' order): the factor that scales its (GPU, class,
    name, phase) key's time per step to the candidate's. A key the candidate lacks costs
    nothing; one the base spends no time on keeps its cost (the rest shows it)."""
    key = ["gpu", "cls", "name", "phase"]
    tb = (base["ns"] / base["its"]).groupby([base[k] for k in key], sort=False).sum().rename("b")
    tc = (cand["ns"] / cand["its"]).groupby([cand[k] for k in key], sort=False).sum().rename("c")
    k = pd.concat([tb, tc], axis=1, join="outer").reindex(tb.index).fillna({"c": 0.0})
    k["f"] = np.where(k["b"] > 0, k["c"] / k["b"].where(k["b"] > 0, 1.0), 1.0)
    f = base.join(k["f"], on=key)["f"].fillna(1.0).to_numpy()
    owner = _class_of(base["cls"], classes).to_numpy()
    return {cl: np.where(owner == cl, f, 1.0) for cl in classes}


def _scaled(r: Replayer, weights: list, factor: np.ndarray) -> list:
    """The weights with one class's factors applied (``factor`` in ``_cost_rows``'s order)."""
    out, at = [], 0
    for t, w, xfer in zip(r.traces, weights, r.transfer):
        f = factor[at:at + t.n_ops]
        fh, fa = factor[at + t.n_ops], factor[at + t.n_ops + 1]
        at += t.n_ops + 2
        alloc = t.calls.c_kind == ALLOC
        matched = xfer >= 0
        out.append(replace(
            w, op_dur=np.where(matched, w.op_dur, np.rint(w.op_dur * f)).astype(np.int64),
            transfer_scale=np.where(matched, w.transfer_scale * f, w.transfer_scale),
            c_dur=np.rint(w.c_dur * np.where(alloc, fa, fh)).astype(np.int64),
            c_gap=np.rint(w.c_gap * fh).astype(np.int64), h_lag=np.rint(w.h_lag * fh).astype(np.int64)))
    return out


def _subset_values(r: Replayer, weights: list, factors: dict, n: int) -> np.ndarray:
    """The replayed step change with each subset of the classes (bit i: class i) applied."""
    per_class = list(factors.values())
    start = r.step_ms(r.replay(weights))
    values = np.zeros(2 ** n)
    for mask in range(1, 2 ** n):  # one replay per subset: 2**n <= 64
        f = np.prod([per_class[i] for i in range(n) if mask >> i & 1], axis=0)
        values[mask] = r.step_ms(r.replay(_scaled(r, weights, f))) - start
    return values


def _shapley(values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class's Shapley value (its marginal change averaged over every order of the
    classes) and its change alone."""
    masks = np.arange(2 ** n)
    size = np.array([bin(m).count("1") for m in masks])
    phi = np.zeros(n)
    for i in range(n):
        without = masks[(masks >> i & 1) == 0]
        w = np.array([factorial(s) * factorial(n - s - 1) / factorial(n) for s in size[without]])
        phi[i] = float(np.sum(w * (values[without | (1 << i)] - values[without])))
    return phi, values[1 << np.arange(n)]


def _label(cls: str) -> str:
    return {"compute": "compute kernels", HOST: "host", MEMORY: "memory ops"}.get(cls, f"{cls} transfers")


def _evidence(base: pd.DataFrame, cand: pd.DataFrame, rb: Replayer, rc: Replayer) -> dict:
    """What per-op costs cannot carry: the ops per step (mean over GPUs) and the names only one
    side runs, with their time per step."""
    def per_step(rows: pd.DataFrame, gpus: int) -> pd.DataFrame:
        ops = rows[~rows["name"].str.startswith(CALLS)]
        return (ops[["count", "ns"]].div(ops["its"], axis=0).groupby(ops["name"]).sum()) / max(gpus, 1)

    by_b, by_c = per_step(base, len(rb.traces)), per_step(cand, len(rc.traces))
    new = by_c.loc[by_c.index.difference(by_b.index)]
    gone = by_b.loc[by_b.index.difference(by_c.index)]
    return dict(ops_per_step=dict(base=round(float(by_b["count"].sum()), 1),
                                  candidate=round(float(by_c["count"].sum()), 1)),
                only_in_candidate=dict(names=int(len(new)), ops_per_step=round(float(new["count"].sum()), 1),
                                       ms_per_step=round(float(new["ns"].sum()) / 1e6, 3)),
                only_in_base=dict(names=int(len(gone)), ops_per_step=round(float(gone["count"].sum()), 1),
                                  ms_per_step=round(float(gone["ns"].sum()) / 1e6, 3)))


def _summary(measured_ms: float, parts: list[dict], rest: float) -> str:
    body = ", ".join(f"{p['cause'].split(' (replayed')[0]} {p['delta_ms']:+.1f}" for p in parts)
    return f"step change {measured_ms:+.1f} ms: {body}, not explained {rest:+.1f}"


def split_lines(split: dict | None) -> list[str]:
    """The split in words, for the text and Markdown renderers: the parts, how they were
    combined, the evidence for what is not explained, or why there is no split."""
    if not split:
        return []
    if split["summary"] is None:
        return ["No replayed split of the step change: " + m.removeprefix("split: ") for m in split["missing"]]
    ev = split["evidence"]
    new, gone = ev["only_in_candidate"], ev["only_in_base"]
    return [f"Replayed causes: {split['summary']} ms/step ({split['method']}; each part is the change of the "
            f"base's replayed step, so a cost off the critical path counts for nothing)",
            f"Not explained by per-op costs {split['not_explained_ms']:+.1f} ms/step: ops per step "
            f"{ev['ops_per_step']['base']:.0f} -> {ev['ops_per_step']['candidate']:.0f}; "
            f"{new['names']} name(s) only in the candidate ({new['ops_per_step']:.0f} ops, "
            f"{new['ms_per_step']:.1f} ms/step), {gone['names']} only in the base ({gone['ops_per_step']:.0f} ops, "
            f"{gone['ms_per_step']:.1f} ms/step)"]
