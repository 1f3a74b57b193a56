"""The layout stage (the job's parallel layout, from the command line or the traffic) and the
layout analyzer's job half (its fact, missing notes and the ``layout`` section). ``layout``
and ``layout_infer`` hold the rules; this module runs them over the job's per-GPU summaries."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ..config import parse_flags
from ..timeline import comm_kernels
from . import layout, layout_infer, pipeline_bubbles, pp_program
from .memory import MIN_RECOMPUTE_RATIO
from .job import Job
from .protocol import Analyzer


def job_layout(profiles, gpus) -> layout.Layout:
    """The layout from the command line, else (TP, PP, EP) from the traffic."""
    command = [a for p in profiles for a in p.command]
    env = {k: v for p in profiles for k, v in p.env.items()}
    lay = layout.build(parse_flags(command), command, env, len(gpus))
    per_report = max(Counter(g.source for g in gpus).values(), default=0)
    if lay.gpus_per_node is None and per_report > 1:
        lay.gpus_per_node = per_report  # one nsys report is one host: its GPUs share a node
    comm = [comm_kernels(g) for g in gpus]
    # kernels per SendRecv kernel over the whole capture: one program's shape, whatever the
    # steps each GPU's window holds (ranks' windows may differ; their captures do not)
    shape = [g.kernels_total / max(int((k["collective"] == "all_to_all").sum()), 1) for g, k in zip(gpus, comm)]
    aggs = [g.kernel_agg for g in gpus]
    gemms = [int(a.loc[a["is_gemm"].astype(bool), "count"].sum()) if a is not None else 0 for a in aggs]
    moe_router = any(a is not None and a["full_name"].str.contains(layout_infer.MOE_ROUTER).any() for a in aggs)
    layout_infer.infer(lay, comm, [g.rank for g in gpus], shape,
                       windows=[g.window for g in gpus], gemms=gemms, moe_router=moe_router,
                       alltoall_peers=[getattr(g, "alltoall_peers", None) for g in gpus])
    layout_infer.infer_passes(lay, [g.rank for g in gpus], [g.analysis.memory.forward_passes for g in gpus],
                              [g.analysis.memory.warmup_forwards for g in gpus])
    return lay


def with_exchanges(lay: layout.Layout, records, comm) -> layout.Layout:
    """The layout with VPP and the micro-batch count read from each stage's PP send/recv kernels
    per step (``pp_program.exchange_fits``, ``chosen_size``), where no command line said them and the
    forward passes could not: a GPU recomputes (full recompute re-runs forwards in the backward,
    and with few layers a stage a re-run layer reads as a forward pass: PP 2 at 4 micro-batches
    was read as 1), or they showed nothing. Needs every PP stage; otherwise the layout as it is."""
    s, src = lay.sizes, lay.source
    p = s.get("pp")
    told = [k for k in ("vpp", "microbatches") if src.get(k) not in (None, "inferred", layout.BRIDGE_DEFAULT)
            and not str(src.get(k)).startswith(layout.UNDETERMINED)]
    recomputes = any(r.analysis.memory.recompute_ratio >= MIN_RECOMPUTE_RATIO for r in records)
    if not p or p < 2 or told or not comm.kernels or (s.get("microbatches") and not recomputes):
        return lay
    stage = [pipeline_bubbles.stage_of(r.gpu.rank, g) for r, g in zip(records, comm.members)]
    if set(stage) != set(range(p)):
        return lay
    counts = [pipeline_bubbles.sendrecv_per_step(r, k) for r, k in zip(records, comm.kernels)]
    # the passes' chunks choose between programs that launch alike; a misread count fits none
    chunks = s["microbatches"] * (s.get("vpp") or 1) if s.get("microbatches") else None
    fits = pp_program.exchange_fits(p, stage, counts)
    found = pp_program.chosen_size(fits, chunks)
    if found is not None:
        return replace(lay, sizes={**s, "vpp": found[0], "microbatches": found[1]},
                       source={**src, "vpp": "inferred", "microbatches": "inferred"})
    if len(fits) < 2 or not recomputes:
        return lay
    # programs that launch alike, and passes that re-run forwards may have misread: no guess
    why = (f"{layout.UNDETERMINED}: the PP exchanges per step fit "
           f"{' and '.join(f'VPP {v} x {m} micro-batches' for v, m in fits)}, and the forward passes "
           "(full recompute re-runs forwards) do not choose")
    return replace(lay, sizes={**s, "vpp": None, "microbatches": None}, source={**src, "vpp": why, "microbatches": why})


def facts(job: Job, numbers: dict) -> dict:
    """``ep`` from the layout where it knows whether experts are split over ranks (it then
    overrides the configuration's)."""
    ep = job.layout.size("ep")
    return {"ep": ep > 1} if ep else {}


ANALYZER = Analyzer(name="layout", about="the parallel layout: group sizes, their sources, group membership",
                    facts=facts, missing=lambda job, numbers: layout.missing(job), section="layout",
                    report=lambda job, numbers: job.layout.to_dict())
