"""Analyzer: the pipeline (PP) bubble and stage imbalance.

A pipeline stage is busy when it computes or runs its own non-PP communication (TP, EP, DP
...). The rest of its step it is either blocked in a PP send/recv waiting for a neighbour
stage (its bubble, the PP part of the communication wall: ``|PP send/recv - busy|`` over the
steady window, per step) or idle with nothing launched (a host gap: the host wall's, not the
pipeline's). The job's bubble is the mean over stages. Megatron posts each receive before
the stage would idle, so a stage waiting for its neighbour sits inside a PP kernel. 1F1B theory (Megatron, Narayanan et al. 2021) puts it at
``(p - 1) / (v * m + p - 1)`` of the step for p stages, v virtual stages and m micro-batches
when the stages are balanced.

A stage busier than the mean keeps every other stage waiting: the slowest stage's extra
busy time is the *stage imbalance*. On the first or last stage it is the embedding or the
output layer and loss that the layer split did not account for.
"""
from __future__ import annotations

import numpy as np

from .. import intervals as iv
from ..kernels import FWD_BWD_PAIRS
from .job import GpuRecord, Job, evidence_row
from .layout import Layout
from .pp_program import captured_p2p
from .protocol import Analyzer
from .results import CommAnalysis, PipelineResult
from .sets import contains_per_distinct

# stage imbalance below this share of the step is run-to-run noise (captures of one config
# differ by 5-10% of the step: fixtures/corpus.toml); above it, it is named
IMBALANCE_MIN = 0.05
# per-layer kernels: every transformer layer runs two norms (before attention, before the MLP), so
# a stage's backward norm kernels per micro-batch are 2 L (2 L + 1 on the last stage: the final
# norm). Backward ones, because full recompute runs the forward twice. Attention's and softmax's
# backward kernels run once (attention; dense softmax) or three times (with a softmax router and
# its top-k) per layer: a count that is not a multiple of L means the norms count something else
# (QK norms, a model whose layers differ), and the stage's layers stay unknown
_NORM_BWD = next(b for name, _, b in FWD_BWD_PAIRS if name == "layer_norm")
_PER_LAYER_BWD = [b for name, _, b in FWD_BWD_PAIRS if name in ("attention", "softmax")]
COUNT_SLACK = 0.15  # a window's per-micro-batch count may miss a kernel at its edge


def stage_of(rank: int, groups: dict) -> int | None:
    pp = groups.get("PP")
    return pp.index(rank) if pp else None


def layers_per_microbatch(agg, micro_batches_in_window: float) -> int | None:
    """The transformer layers one rank runs per micro-batch (``agg``: its window's kernels by
    name with their count), from its backward norm kernels, checked against its attention and
    softmax ones; None where the counts disagree or there are none."""
    if agg is None or not micro_batches_in_window:
        return None
    counts = agg["count"].to_numpy(float)

    def per_mb(pattern) -> float:
        return float(counts[contains_per_distinct(agg["full_name"], pattern)].sum()) / micro_batches_in_window

    norms = per_mb(_NORM_BWD)
    if abs(norms - round(norms)) > COUNT_SLACK or round(norms) < 2:
        return None
    layers = int(round(norms)) // 2
    for pattern in _PER_LAYER_BWD:
        c = per_mb(pattern)
        if c and (abs(c - round(c)) > COUNT_SLACK or round(c) % layers):
            return None
    return layers


def _per_rank(rec: GpuRecord, kernels, groups: dict, m: int | None) -> dict:
    """One rank's busy time, PP bubble and idle, ms per step (``kernels``: its communication
    kernels with their group; ``groups``: its group -> member ranks)."""
    lo, hi = rec.gpu.window
    is_pp = (kernels["group"] == "PP").to_numpy()
    others = iv.union(kernels["start"].to_numpy()[~is_pp], kernels["end"].to_numpy()[~is_pp])
    compute = rec.gpu.compute
    busy = iv.clip(iv.union(np.r_[compute[0], others[0]], np.r_[compute[1], others[1]]), lo, hi)
    pp = iv.clip(iv.union(kernels["start"].to_numpy()[is_pp], kernels["end"].to_numpy()[is_pp]), lo, hi)
    its = rec.iterations
    blocked = iv.total(iv.subtract(pp, busy))
    return dict(stage=stage_of(rec.gpu.rank, groups), rank=rec.gpu.rank,
                busy_ms=round(iv.total(busy) / its / 1e6, 3), bubble_ms=round(blocked / its / 1e6, 3),
                idle_ms=round(((hi - lo) - iv.total(busy) - blocked) / its / 1e6, 3),
                sendrecv_per_step=sendrecv_per_step(rec, kernels),
                layers=layers_per_microbatch(rec.gpu.kernel_agg, its * m if m else 0))


def sendrecv_per_step(rec: GpuRecord, kernels) -> float:
    """One rank's PP send/recv kernels per step in its window (``kernels``: its communication
    kernels with their group; the PP all-reduce is not an exchange)."""
    lo, hi = rec.gpu.window
    starts = kernels["start"].to_numpy()
    sel = (kernels["group"] == "PP").to_numpy() & (kernels["collective"] != "all_reduce").to_numpy() \
        & (starts >= lo) & (starts < hi)
    return round(float(sel.sum()) / rec.iterations, 2)


def measure(records: list[GpuRecord], lay: Layout, comm: CommAnalysis) -> PipelineResult:
    """The pipeline stage: the pipeline section; empty (stages None or 1) without pipeline parallelism."""
    p = lay.size("pp") if lay else None
    sizes = dict(stages=p, virtual_stages=lay.size("vpp") if lay else None,
                 microbatches=lay.size("microbatches") if lay else None)
    if p and sizes["virtual_stages"] and sizes["microbatches"] and p > 1:
        sizes["theory_share"] = round((p - 1) / (sizes["virtual_stages"] * sizes["microbatches"] + p - 1), 4)
    if not p or p < 2 or not comm.kernels:
        return PipelineResult(**sizes)
    rows = [_per_rank(rec, kernels, groups, sizes["microbatches"])
            for rec, kernels, groups in zip(records, comm.kernels, comm.members)]
    step = float(np.mean([rec.analysis.window.window_ns / rec.iterations for rec in records])) / 1e6
    bubble = round(float(np.mean([x["bubble_ms"] for x in rows])), 3)
    busy = {}
    for x in rows:  # a stage's busy time: the mean over its ranks (TP/DP/EP replicas)
        busy.setdefault(x["stage"], []).append(x["busy_ms"])
    stage_busy = {s: float(np.mean(v)) for s, v in busy.items()}
    if len(stage_busy) > 1 and None not in stage_busy:
        slowest = max(stage_busy, key=stage_busy.get)
        sizes.update(slowest_stage=slowest, imbalance_at_end_stage=slowest in (0, p - 1),
                     stage_imbalance_ms=round(stage_busy[slowest] - float(np.mean(list(stage_busy.values()))), 3))
    if sizes["microbatches"] and None not in stage_busy:  # the mode whose calls' kernels the ranks launched
        sizes["p2p"] = captured_p2p(p, sizes["virtual_stages"] or 1, sizes["microbatches"],
                                    [x["stage"] for x in rows], [x["sendrecv_per_step"] for x in rows])
    return PipelineResult(**sizes, per_stage=sorted(rows, key=lambda x: (x["stage"] is None, x["stage"], x["rank"])),
                          bubble_ms_per_step=bubble, bubble_share=round(bubble / step, 4) if step else None)


# ---------------------------------------------------------------------------------------------
# job level

GAINS = {
    # more micro-batches / interleaving shrink the bubble toward its theory share; the measured
    # bubble above theory is imbalance, which a better layer split removes
    "pp_bubble": lambda n: n["pp_bubble_ms"],
    "pp_stage_imbalance": lambda n: n["stage_imbalance_ms"],
}


def numbers(job: Job) -> dict:
    r = job.pipeline
    return dict(pp_bubble_ms=(r.bubble_ms_per_step or 0.0) if r else 0.0,
                pp_stages=r.stages if r else None, pp_virtual_stages=r.virtual_stages if r else None,
                pp_microbatches=r.microbatches if r else None,
                exposed_pp_ms=(r.bubble_ms_per_step or 0.0) if r else 0.0,
                stage_imbalance_ms=(r.stage_imbalance_ms or 0.0) if r else 0.0)


def facts(job: Job, numbers: dict) -> dict:
    r, step = job.pipeline, job.step_ms
    has_pp = bool(r and r.stages and r.stages > 1)
    imbalanced = has_pp and numbers["stage_imbalance_ms"] >= IMBALANCE_MIN * step
    return dict(pp=has_pp, pp_interleaved=bool(has_pp and (r.virtual_stages or 1) > 1),
                pp_p2p_batched=bool(has_pp and r.p2p != "overlapped"),
                pp_bubble_exposed=has_pp and numbers["pp_bubble_ms"] >= IMBALANCE_MIN * step,
                pp_stage_imbalance=bool(imbalanced and r.imbalance_at_end_stage),
                # interleaving splits each stage's layers into virtual stages of at least one layer
                pp_interleavable=bool(has_pp and (fewest_layers(r) or 2) >= 2))


def fewest_layers(r: PipelineResult) -> int | None:
    """The fewest transformer layers any stage runs per micro-batch; None where a rank's count
    is unknown."""
    counts = [x.get("layers") for x in r.per_stage] if r and r.per_stage else []
    return min(counts) if counts and None not in counts else None


def evidence(job: Job, numbers: dict) -> list[dict]:
    r = job.pipeline
    if not r or not r.stages or r.stages < 2 or r.bubble_ms_per_step is None:
        return []
    theory = f"theory {100 * r.theory_share:.0f}%" if r.theory_share is not None else "theory unknown"
    ev = [evidence_row("communication", "pipeline bubble", r.bubble_ms_per_step, "ms/step",
                       f"{r.stages} stages x {r.virtual_stages} virtual, {r.microbatches} micro-batches: "
                       f"{100 * (r.bubble_share or 0):.0f}% of the step idle or in PP send/recv ({theory})")]
    if fewest_layers(r) == 1:
        ev.append(evidence_row("communication", "pipeline layers per stage", 1, "layers",
                               "a stage runs one transformer layer per micro-batch (its backward norm "
                               "kernels): interleaving, which needs a layer per virtual stage, is not offered"))
    if r.slowest_stage is not None:
        where = "first/last stage: embedding or output layer + loss" if r.imbalance_at_end_stage else "a middle stage"
        ev.append(evidence_row("communication", "pipeline stage imbalance", r.stage_imbalance_ms, "ms/step",
                               f"stage {r.slowest_stage} busiest ({where}); the others wait for it"))
    return ev


ANALYZER = Analyzer(name="pipeline_bubbles", about="the pipeline (PP) bubble and stage imbalance",
                    numbers=numbers, facts=facts, evidence=evidence, section="pipeline",
                    report=lambda job, numbers: job.pipeline.to_dict(), gains=GAINS)
