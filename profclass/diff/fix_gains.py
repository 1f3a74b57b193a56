"""``diff`` closes the loop on fixes: when the candidate differs from the base by a known fix
(a flag, environment or configuration change, or a kernel family appearing), the gain the
base profile predicted for that fix stands next to the gain the step realized.

Which change applies which fix is data: ``applied_when`` of each ``[[fix]]`` in
``data/fixes.toml``, one condition a line (any one detects the fix):

    on:FLAG            FLAG (or environment variable, or its Hydra override: ``config.parse_overrides``)
                       absent/false on the base, set on the candidate
    off:FLAG           set on the base, absent (or "0") on the candidate
    change:KEY=A->B    configuration KEY from A to B (pp_p2p: an interleaved schedule's P2P mode, read off its kernels)
    up:FLAG            FLAG's number grows; the realized gain is then per the base's work
                       (the candidate's step / the work ratio, ``work.step_work``; where no measure
                       of the work is known on both sides, / the flag's growth)
    kernels:fp8        FP8 GEMM kernels appear
    kernels:grouped    grouped GEMM kernels appear (``kernels.GROUPED_GEMM``)
    overlap:dp         the data-parallel gradient reductions, after the backward on the base (under
                       DP_OVERLAP_SEEN of their time beside compute), run beside it on the candidate
    overlap:dp_gather  the same of the distributed optimizer's parameter all-gathers (the next forward)
    balance:ep         the routing load is uneven on the base (``stragglers.routing_uneven``: a rank late
                       for its token load, or an EP work spread of at least ROUTING_IMBALANCE_MIN of the
                       step) and balanced on the candidate, which still runs EP collectives
                       (``routing_balanced``: the spread's share of the step fell by ROUTING_BALANCED_FALL
                       or more, to under the minimum): balanced by whatever means (force balance, a
                       capacity factor, an expert bias, the aux loss)
    library:NAME       a communication library's kernels appear (deepep, hybridep)
    graphs             CUDA graph launches appear
    inputs:pinned      the batches' host-to-device copies, from pageable memory on the base, are all
                       from pinned memory on the candidate
    inputs:gpu         the base copies batches in from the host, the candidate none (built on the GPU), or
                       the base copies an attention mask with its batches, the candidate none
    churn:gone         the base frees device memory at least once a step (``features.free_calls`` over
                       its iterations, the GPUs' mean: an emptying every step), the candidate under once
    pauses:gone        the base's window holds collector pauses (GC ranges, ``features.gc_ns``, else the
                       host's unmarked pauses, ``pause_ns``), the candidate's none where it could show
                       them (``_pauses_gone``): the collector taken off the steps, as --manual-gc does;
                       only where no setting changed (flags, overrides, the layout's sizes, the
                       configuration items) and no other fix is recognised (``ALONE_ONLY``)
    syncs:gone         a MoE job's dispatcher stopped syncing on the token counts (``_syncs_gone``): MoE
                       on both sides, the same micro-batches a step of the same rows, and the base's
                       host syncs a step fall by at least one a micro-batch (one MoE layer's), to half
                       or fewer: its expert inputs padded to capacity, as drop-and-pad does; only
                       where no other fix is recognised (``ALONE_ONLY``: recompute off, DeepEP or CUDA
                       graphs end such syncs too, and are recognised by their own signs)
    transfer:faster    the same collectives (type and group, as many calls a step) move their data at
                       least 1 / FABRIC_FASTER times faster on the candidate (``_fabric_faster``): their
                       transfers crossed a faster fabric (NVLink for PCIe or host memory: NCCL's P2P
                       allowed again, however it was set)

Where a flag is absent its value may come from the layout (``_LAYOUT_FLAGS``: the micro-batch
count and VPP read off the timeline); where ``--micro-batch-size`` is, the rows a normalisation
kernel covers stand in for it (``ROWS``: a micro-batch's tokens, ``compute.norm_rows``). The
predicted gain is the replay's price of the change the pair made on the base
(``replay.run.price_requests`` on the base's replayer, which ``diff`` shares with the step's
split: a schedule change by the sizes both sides ran, ``_schedule_change``), as ``diagnose``
prices the fixes it lists; the fix's share model where the replay cannot price it (no transform,
or a stored base without its replay inputs).
"""
from __future__ import annotations

import numpy as np

from ..analyzers.communication import DP_OVERLAP_SEEN, DP_REDUCTIONS, beside_compute
from ..analyzers.stragglers import EP_IMBALANCE, routing_balanced, routing_uneven
from ..config import RUN_FLAG_ITEMS, run_flags
from ..fixes import load_table, predict_by_id, request_text
from ..kernels import GROUPED_GEMM
from ..replay import critical_path
from ..replay.run import price_requests
from . import work

_ABSENT = (None, False, "0", "false", "False")


# the schedule's sizes as the layout read them (off the launch line, or off the timeline where a
# wrapper, a config file or a Bridge recipe kept Megatron's flags off it), standing in for the
# flags that would have said them: a flagless pair that changed the micro-batches or interleaved
# is recognised as one that did it by flag
_LAYOUT_FLAGS = {"microbatches": "--num-microbatches", "vpp": "--virtual-pipeline-model-parallel-size"}
PP_P2P = "pp_p2p"  # the settings key of an interleaved schedule's P2P mode (``change:pp_p2p=batched->overlapped``)
# the settings key of a micro-batch's rows (tokens) off the normalisation kernels' grids, where no
# --micro-batch-size says the size: their growth is the micro-batch's (``up:micro_batch_rows``)
ROWS = work.ROWS


def side_settings(d) -> dict:
    """Configuration values and command-line flags of one side, one flat dict (with the layout's
    schedule sizes where no flag says them: ``_LAYOUT_FLAGS``)."""
    out = {k: (v or {}).get("value") for k, v in d.config.items() if k not in RUN_FLAG_ITEMS}
    out.update(run_flags(d.config))
    sizes = (getattr(d, "layout", None) or {}).get("sizes") or {}
    for key, flag in _LAYOUT_FLAGS.items():
        if out.get(flag) is None and sizes.get(key):
            # VPP 1 is no interleaving: absent, as an unset flag
            out[flag] = None if key == "vpp" and sizes[key] == 1 else sizes[key]
    # how an interleaved schedule's exchanges ran, read off its kernels (no flag need say it)
    pipe = getattr(d, "pipeline", None) or {}
    if (pipe.get("virtual_stages") or 1) > 1 and pipe.get("p2p"):
        out[PP_P2P] = pipe["p2p"]
    rows = [dv["features"].get("norm_rows") or 0 for dv in getattr(d, "devices", None) or []]
    if out.get("--micro-batch-size") is None and any(rows):
        out[ROWS] = float(np.median([r for r in rows if r]))
    return out


def _routing(d) -> tuple[bool, float, str | None] | None:
    """One side's routing load off its report: (uneven, ``stragglers.routing_uneven``; the EP
    work spread's evidence row as a share of the mean step; the first straggler's reason); None
    where it runs no EP collective (nothing to balance: EP turned off is no balancing)."""
    if not any(c.get("group") == "EP" for c in getattr(d, "collectives", None) or []):
        return None
    reason = d.stragglers[0].get("reason") if d.stragglers else None
    spread = next((e["value"] for e in d.evidence if e.get("metric") == EP_IMBALANCE), 0.0) or 0.0
    step = d.window["step_ms"]["mean"]
    return routing_uneven(reason, spread, step), spread / step, reason


def balanced_routing(rb, rc) -> bool:
    """``balance:ep`` on two sides' ``_routing``: the base's uneven, the candidate's balanced against it."""
    return rb is not None and rc is not None and rb[0] and routing_balanced(rb[1], rc[1], rc[2])


def _timeline_signs(d) -> dict:
    feature = lambda key: any((dv["features"].get(key) or 0) > 0 for dv in d.devices)  # noqa: E731
    collectives = getattr(d, "collectives", None) or []
    return dict(fp8=any(k["is_fp8"] for k in d.kernels), libraries={k["library"] for k in d.kernels if k["library"]},
                grouped=any(GROUPED_GEMM.search(k["name"]) for k in d.kernels),
                graphs=feature("graph_launches"), inputs=feature("input_bytes"),
                pageable=feature("input_pageable_bytes"),
                masks=feature("input_mask_bytes"),
                # the share of the DP reductions (overlap:dp) and parameter gathers (overlap:dp_gather)
                # compute ran beside (``communication.beside_compute``)
                dp=beside_compute(collectives, DP_REDUCTIONS), dp_gather=beside_compute(collectives, ("all_gather",)),
                routing=_routing(d),  # balance:ep compares the two (``balanced_routing``)
                frees=_per_step(d.devices, "free_calls"),  # churn:gone: device frees a step
                pauses=_pauses(d),  # pauses:gone
                syncs=_syncs(d),  # syncs:gone
                transfers=_transfers(d))  # transfer:faster


def _per_step(devices: list[dict], key: str) -> float:
    """The GPUs' mean of ``features[key]`` a step (over each GPU's iterations); 0 without GPUs."""
    per = [(dv["features"].get(key) or 0) / max(dv["features"].get("iterations") or 1, 1) for dv in devices]
    return float(np.mean(per)) if per else 0.0


# conditions read off what comes and goes with the run by itself (a collection caught in one short
# window and not the other), or off what other changes also make (syncs ended by recompute off,
# DeepEP, CUDA graphs): they name their fix only where no other fix is recognised, since beside a
# recognised change they are likelier chance or that change's (pauses:gone also only where no
# setting changed either: ``_applied``)
ALONE_ONLY = ("pauses:gone", "syncs:gone")


def _pauses(d) -> tuple[float, bool, int]:
    """One side's collector pauses: (their ns a step, the GPUs' mean; whether any GPU's were
    marked by GC ranges, ``features.gc_ns``, else the unmarked pauses, ``pause_ns``; the fewest
    steps a GPU's window holds)."""
    devs = getattr(d, "devices", None) or []
    marked = any(dv["features"].get("gc_ns") for dv in devs)
    fewest = min((dv["features"].get("iterations") or 0 for dv in devs), default=0)
    return _per_step(devs, "gc_ns" if marked else "pause_ns"), marked, fewest


def _pauses_gone(b: tuple[float, bool, int], c: tuple[float, bool, int]) -> bool:
    """``pauses:gone``: the base's window holds collector pauses, the candidate's none where it
    could show them: its GC ranges are marked as the base's were (the same job marks its
    collections), or it holds the 3 steps ``host_pauses`` needs to tell a pause from the rhythm."""
    return b[0] > 0 and c[0] == 0 and (b[1] or c[2] >= 3)


def _syncs(d) -> tuple[bool, float, int, float]:
    """One side's host syncs as ``syncs:gone`` reads them: (MoE, ``config.moe``; the GPUs' mean host
    syncs a step, ``features.sync_calls``; the micro-batches a step, the layout's; the rows a
    micro-batch, ``features.norm_rows``, the GPUs' median)."""
    moe = bool(((getattr(d, "config", None) or {}).get("moe") or {}).get("value"))
    m = ((getattr(d, "layout", None) or {}).get("sizes") or {}).get("microbatches") or 1
    rows = [dv["features"].get("norm_rows") or 0 for dv in getattr(d, "devices", None) or []]
    return moe, _per_step(getattr(d, "devices", None) or [], "sync_calls"), int(m), float(np.median(rows) if rows else 0)


def _syncs_gone(b: tuple[bool, float, int, float], c: tuple[bool, float, int, float]) -> bool:
    """``syncs:gone``: both MoE, the work split alike (micro-batches a step, rows a micro-batch),
    and the base's syncs a step fall by at least one a micro-batch (a dropless dispatcher waits on
    its token counts once per MoE layer and micro-batch: Megatron-Core's alltoall dispatcher's
    ``d2h_event.synchronize``, none when padded to capacity) to half or fewer."""
    return b[0] and c[0] and b[2:] == c[2:] and b[1] - c[1] >= b[2] and c[1] <= b[1] / 2


# the fix's transform's low end (data/fixes.toml comm_nvlink_domain: factor 0.3 at the low-gain
# point): the same collectives moving their data at least that much faster crossed a faster fabric;
# routing balance moves an all-to-all's by its mean/max load (0.87-1.06 on the corpus's balanced
# pairs), a DP overlap none of it
FABRIC_FASTER = 0.3
# under this share of the step the matched transfers are a few launch latencies, whose ratio says
# nothing about a fabric
FABRIC_SEEN = 0.01


def _transfers(d) -> tuple[dict, float]:
    """One side's collectives as ``transfer:faster`` reads them: {(type, group): (calls a step,
    transfer ms a step)} and its mean step, ms."""
    its = max(d.window.get("iterations") or 1, 1)
    rows = {(c["collective"], c["group"]): (c["instances"] / its, c["transfer_ms_per_step"])
            for c in getattr(d, "collectives", None) or []}
    return rows, d.window["step_ms"]["mean"]


def _fabric_faster(b: tuple[dict, float], c: tuple[dict, float]) -> bool:
    """``transfer:faster``: the candidate runs every collective (type and group) of the base, each
    as many calls a step (within 10%), and their transfers a step, a measurable share of the base's
    step, fall to ``FABRIC_FASTER`` of the base's or less."""
    (rb, step), (rc, _) = b, c
    if not rb or set(rb) != set(rc) or any(abs(rc[k][0] - n) > 0.1 * n for k, (n, _) in rb.items()):
        return False
    tb, tc = sum(t for _, t in rb.values()), sum(t for _, t in rc.values())
    return tb >= FABRIC_SEEN * step and tc <= FABRIC_FASTER * tb


def _applied(cond: str, sb: dict, sc: dict, kb: dict, kc: dict) -> tuple[bool, float]:
    """Whether one ``applied_when`` condition holds, and the work ratio (candidate / base)."""
    kind, _, arg = cond.partition(":")
    if kind == "on":
        return sb.get(arg) in _ABSENT and sc.get(arg) not in _ABSENT, 1.0
    if kind == "off":
        return sb.get(arg) not in _ABSENT and sc.get(arg) in _ABSENT, 1.0
    if kind == "change":
        key, _, move = arg.partition("=")
        a, _, b = move.partition("->")
        return str(sb.get(key)) == a and str(sc.get(key)) == b, 1.0
    if kind == "up":
        vb, vc = work.number(sb.get(arg)), work.number(sc.get(arg))
        return bool(vb and vc and vc > vb), (vc / vb) if vb and vc else 1.0
    if kind == "kernels":
        return not kb[arg] and kc[arg], 1.0
    if kind == "library":
        return arg not in kb["libraries"] and arg in kc["libraries"], 1.0
    if kind == "overlap":  # overlap:dp, overlap:dp_gather
        b, c = kb[arg], kc[arg]
        return b is not None and c is not None and b < DP_OVERLAP_SEEN <= c, 1.0
    if kind == "balance":  # balance:ep
        return balanced_routing(kb["routing"], kc["routing"]), 1.0
    if kind == "graphs":
        return not kb["graphs"] and kc["graphs"], 1.0
    if kind == "inputs":
        if arg == "pinned":
            return kb["pageable"] and kc["inputs"] and not kc["pageable"], 1.0
        if arg == "gpu":  # every batch, or its attention mask, now built on the GPU
            return kb["inputs"] and (not kc["inputs"] or (kb["masks"] and not kc["masks"])), 1.0
    if kind == "churn":  # churn:gone, as memory.facts' frees_every_step
        return kb["frees"] >= 1 > kc["frees"], 1.0
    if kind == "pauses":  # pauses:gone, where no setting either side shows changed
        return _pauses_gone(kb["pauses"], kc["pauses"]) and sb == sc, 1.0
    if kind == "syncs":  # syncs:gone
        return _syncs_gone(kb["syncs"], kc["syncs"]), 1.0
    if kind == "transfer":  # transfer:faster
        return _fabric_faster(kb["transfers"], kc["transfers"]), 1.0
    raise ValueError(f"fixes.toml applied_when: unknown condition {cond!r}")


# flags whose growth factor a gain model or a replay transform takes (``predict_by_id``'s
# ``change``; the replay's request: pp_schedule's ``microbatches`` is the factor the count grew)
_FACTOR_INPUTS = {"--micro-batch-size": "microbatch_factor", ROWS: "microbatch_factor",
                  "--num-microbatches": "microbatches", "--global-batch-size": "microbatches"}


def _change(cond: str, sb: dict, sc: dict) -> dict:
    """What the detected change was, for a model that prices it (a micro-batch 1 -> 4 is 4x)."""
    kind, _, arg = cond.partition(":")
    vb, vc = work.number(sb.get(arg)), work.number(sc.get(arg))
    if kind != "up" or arg not in _FACTOR_INPUTS or not (vb and vc):
        return {}
    return {_FACTOR_INPUTS[arg]: vc / vb}


def _schedule_change(b, c) -> dict:
    """The schedule change a pair made, as a ``pp_schedule`` transform takes it: VPP's and the
    micro-batch count's factors (candidate over base, whole numbers only) and the candidate's
    P2P mode, from the pipeline sections (the layout's sizes, the pipeline analyzer's mode)."""
    pb, pc = getattr(b, "pipeline", None) or {}, getattr(c, "pipeline", None) or {}
    out = {}
    for key, name in (("virtual_stages", "vpp"), ("microbatches", "microbatches")):
        vb, vc = pb.get(key), pc.get(key)
        if vb and vc and vc != vb and vc % vb == 0:
            out[name] = vc // vb
    if out and pc.get("p2p"):
        out["p2p"] = pc["p2p"]
    return out


def _replayed(rb, wanted: list[tuple[str, dict]], traced: bool = False) -> dict:
    """The replay's price of each (fix, change) on the base, by request: the fixes priced as
    ``diagnose`` prices its own (without the profiler; ``traced``: on the captured step, the
    profiler kept), on the base's replayer ``rb`` (None: the base was not diagnosed here with its
    replay inputs, or cannot be replayed); {} without one."""
    return price_requests(rb, tuple(dict.fromkeys(request_text(i, ch) for i, ch in wanted)),
                          {f["id"]: f for f in load_table()}, traced)


def _predicted(fix_id: str, b, change: dict, replayed: dict) -> dict:
    """The base's prediction for the change made: the replay's (``replayed``) where it priced
    it, else the fix's share model on the base's numbers when it was diagnosed here, else its
    stored fixes list (a saved diagnosis: the model's stated default change), else unknown."""
    p = replayed.get(request_text(fix_id, change))
    if p is not None:
        return dict(expected_gain_ms=p.best_ms, gain_low_ms=p.low_ms, gain_high_ms=p.high_ms, gain_basis=p.basis)
    step = b.window["step_ms"]["mean"]
    if getattr(b, "numbers", None) is not None:
        return predict_by_id(fix_id, b.numbers, step, change)
    stored = next((f for f in b.fixes if f.get("id") == fix_id), {})
    return {k: stored.get(k) for k in ("expected_gain_ms", "gain_low_ms", "gain_high_ms", "gain_basis")}


def fix_gains(b, c, settings: tuple[dict, dict], base_ms: float, candidate_ms: float, rb=None,
              step_work: dict | None = None) -> list[dict]:
    """One row per known fix the candidate applies: predicted (on the base, by its replayer
    ``rb`` where there is one) next to realized, per the base's work: the candidate's step over
    ``step_work``'s ratio (``work.step_work``) where both sides' work is known, else a grown
    flag's (``up:``) own growth. ``settings``: each side's ``side_settings``."""
    (sb, sc), kb, kc = settings, _timeline_signs(b), _timeline_signs(c)
    applied = []
    for fix in load_table():
        hits = [(cond, ratio) for cond in fix.get("applied_when", []) for ok, ratio in [_applied(cond, sb, sc, kb, kc)]
                if ok]
        if hits:
            on_schedule = (fix.get("transform") or {}).get("kind") == "pp_schedule"
            change = (on_schedule and _schedule_change(b, c)) or _change(hits[0][0], sb, sc)
            applied.append((fix, *hits[0], change))
    # a fix whose change another applied fix makes in whole (``subsumed_by``) is that fix's
    ids = {fix["id"] for fix, *_ in applied}
    applied = [a for a in applied if a[0].get("subsumed_by") not in ids]
    # a sign that comes and goes with the run names its fix only where it is the pair's one change
    if any(cond not in ALONE_ONLY for _, cond, *_ in applied):
        applied = [a for a in applied if a[1] not in ALONE_ONLY]
    wanted = [(fix["id"], change) for fix, _, _, change in applied]
    # the price the job banks (untraced), and the one two traced captures can show
    replayed, traced = _replayed(rb, wanted), _replayed(rb, wanted, traced=True)
    # the wall the candidate's own replayed path holds most of: what the fix left next, as captured
    walls_c = (getattr(c, "replay", None) or {}).get("critical_path_ms")
    wall_c = critical_path.largest(walls_c) if walls_c else None
    rows = []
    for fix, cond, ratio, change in applied:
        if step_work:  # whatever the fix, a step that does more work is judged per the base's
            ratio = step_work["ratio"]
        realized = base_ms - candidate_ms / ratio
        p = _predicted(fix["id"], b, change, replayed)
        est, lo, hi = p.get("expected_gain_ms"), p.get("gain_low_ms"), p.get("gain_high_ms")
        kept = traced.get(request_text(fix["id"], change))
        rows.append(dict(fix=fix["id"], title=fix["title"], detected_by=cond,
                         predicted_gain_ms=est, gain_low_ms=lo, gain_high_ms=hi, gain_basis=p.get("gain_basis"),
                         predicted_gain_traced_ms=None if kept is None else kept.best_ms,
                         predicted_wall_after=None if kept is None else kept.wall_after, candidate_wall=wall_c,
                         realized_gain_ms=round(realized, 3),
                         realized_per="base work" if ratio != 1.0 else "step",
                         within_range=None if lo is None or hi is None else bool(lo <= realized <= hi)))
    return rows


def without_pauses(rows: list[dict], split: dict | None, table: dict) -> list[dict]:
    """Each row with ``realized_without_pauses_ms``: its realized gain with both sides' collector
    pauses taken out (the split's ``pauses`` part: what they cost each side's replayed step),
    where the split has one, the row is per step and its fix is not the collector's own; else
    None. A change can move a generation-2 collection into or out of a short window, which the
    realized gain then carries. ``table``: the fixes by id."""
    part = next((p for p in (split or {}).get("parts", []) if p["kind"] == "pauses"), None)
    # fixes whose gain is the pauses themselves (manual GC): nothing is left without them
    on_pauses = {i for i, f in table.items() if (f.get("transform") or {}).get("kind") == "remove_gc"}
    out = []
    for r in rows:
        steady = None
        if part is not None and r["realized_per"] == "step" and r["fix"] not in on_pauses:
            # a side too short to show pauses counts none: what the part itself took out
            steady = round(r["realized_gain_ms"] - (part.get("base_ms") or 0.0) + (part.get("candidate_ms") or 0.0), 3)
        out.append({**r, "realized_without_pauses_ms": steady})
    return out


# what a change read off the timeline, with no flag to say it, cannot tell apart from it
# (``diff``'s notes, one a condition that matched)
TIMELINE_CAVEATS = {
    f"up:{ROWS}": "a bigger micro-batch read off the normalisation kernels' rows (no --micro-batch-size on a "
                  "launch line): a longer sequence grows them the same way",
    "pauses:gone": "the collector's pauses gone, read off the host timeline (no --manual-gc on a launch line): a "
                   "window that caught no collection by chance, or a smaller heap, reads the same",
    "balance:ep": "balanced routing read off the EP work spread (no routing flag on a launch line): learned "
                  "routing that evened out by itself between the two captures reads the same",
    "syncs:gone": "drop-and-pad read off the host syncs (no capacity flag on a launch line): the dispatcher's "
                  "per-micro-batch token-count syncs gone; any other change that ends them reads the same",
    "transfer:faster": "a faster fabric read off the collectives' transfers (no NCCL setting on a launch line): "
                       "the same calls moving their data at least 3x faster; smaller messages (a smaller hidden "
                       "size or sequence) read the same",
}


def caveats(rows: list[dict]) -> list[str]:
    """The notes of the rows detected off the timeline where the change they read is ambiguous."""
    out = []
    for r in rows:
        text = TIMELINE_CAVEATS.get(r["detected_by"])
        if text and f"{r['fix']}: {text}" not in out:
            out.append(f"{r['fix']}: {text}")
    return out


def fix_gain_lines(rows: list[dict]) -> list[str]:
    """The rows in words, for the text and Markdown renderers."""
    out = []
    for r in rows:
        pred = ("not priced on the base" if r["predicted_gain_ms"] is None else
                f"predicted {r['predicted_gain_ms']:.1f} ms/step [{r['gain_low_ms']:.1f}, {r['gain_high_ms']:.1f}]")
        where = "" if r["within_range"] is None else (" (inside the range)" if r["within_range"] else " (outside the range)")
        per = " per the base's work" if r["realized_per"] == "base work" else ""
        kept = r.get("predicted_gain_traced_ms")
        kept = "" if kept is None else f" ({kept:.1f} with the profiler kept, as these captures ran)"
        steady = r.get("realized_without_pauses_ms")
        steady = "" if steady is None else f", {steady:.1f} without the collector's pauses"
        nxt = r.get("predicted_wall_after")
        nxt = "" if nxt is None else f"; then the {nxt} wall predicted, the candidate's path: {r.get('candidate_wall') or '?'}"
        timed = r.get("realized_gain_timer_ms")
        timed = "" if timed is None else (f"; by the runs' timers {timed:.1f}"
                                          + ("" if r["within_range_timer"] is None else
                                             " (inside the range)" if r["within_range_timer"] else " (outside the range)"))
        out.append(f"{r['title']} ({r['detected_by']}): {pred}{kept}; realized {r['realized_gain_ms']:.1f} ms/step"
                   f"{per}{where}{steady}{timed}{nxt}")
    return out
