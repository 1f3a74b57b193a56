"""The facade: load -> timeline -> analyzers -> classify -> fixes/pitfalls, into one ``Diagnosis``.

No analysis happens here: the per-file stages run in ``profclass.ranks`` (through
``profclass.workers``), the analyses in ``profclass.analyzers``, the wall split and verdict in
``profclass.classify``. This module orders the stages and assembles their outputs.

``diagnose(paths)`` accepts one export holding every rank, one export per rank, or a
directory of them (``.sqlite``, ``.sqlite.zst``, ``.sqlite.xz``, ``.nsys-rep``).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from copy import copy
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from . import analyzers, classify, config, fixes, pitfalls
from .analyzers import (GpuRecord, Job, communication, iterations, layout, layout_infer, memory,
                        pipeline_bubbles, profiler, stragglers)
from .clocks import align_clocks
from .contract import stamp
from .errors import ProfileError
from .inputs import resolve
from .kernel_table import kernel_table, table_records
from .onejob import check_one_job
from .timeline import comm_kernels
from .ranks import assign_ranks
from .ranks import summarise_file
from .workers import summarise_files


@dataclass
class Diagnosis:
    """Everything ``profclass diagnose`` reports; ``to_dict`` is the JSON output."""

    inputs: list[str]
    verdict: dict
    walls: dict
    window: dict
    devices: list[dict]
    stragglers: list[dict]
    collectives: list[dict]
    fixes: list[dict]
    evidence: list[dict]
    missing: list[str]
    config: dict
    pitfalls: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # recompute, footprint, offload (analyzers.memory.section)
    clock: dict = field(default_factory=dict)
    nsys_versions: list[str] = field(default_factory=list)
    # time per step of each normalised kernel/copy name, mean per GPU (what `diff` matches)
    kernels: list[dict] = field(default_factory=list)
    layout: dict = field(default_factory=dict)  # parallel sizes, their sources, group order
    pipeline: dict = field(default_factory=dict)  # PP bubble and stage imbalance (pipeline_bubbles)
    # diagnose(keep_timelines=True) sets this to the analysed GpuTimelines (for pictures and
    # kernel tables); a plain class attribute, so not a dataclass field and not in to_dict()
    timelines = None
    # the job numbers fix gains are priced from (ms per step); a plain attribute like timelines
    numbers = None

    def to_dict(self) -> dict:
        return stamp(asdict(self))  # schema_version, profclass_version first (profclass.contract)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_jsonable)


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(type(o))


def diagnose(paths, iteration_regex: str | None = None, progress=None,
             keep_timelines: bool = False, jobs: int = 1, scheduler: str | None = None) -> Diagnosis:
    """Diagnose a job from its nsys exports. Raises ProfileError on bad input.

    ``progress(message, fraction=None)``, when given, is called as each stage starts
    (fraction: how far through the files, or through an nsys export, when known).
    ``keep_timelines`` keeps the per-GPU timelines on ``Diagnosis.timelines`` (single process).
    ``jobs``: per-file work in that many local processes; ``scheduler``: on a Dask cluster
    (an address, or ``local``); either way only compact per-rank summaries come back
    (``profclass.ranks``), and the result is the same as in one process.
    """
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    paths = [str(p) for p in paths]
    if iteration_regex is not None:
        try:
            re.compile(iteration_regex)
        except re.error as exc:  # the user's regex, not the profile: say so before any work
            raise ProfileError("--iteration-range", f"not a valid regular expression ({exc})") from None
    with resolve(paths, progress=progress) as files:
        # timelines (whole DataFrames) stay in the process that made them: keeping them means
        # the per-file work runs here
        summaries = summarise_files(files, iteration_regex,
                                    jobs=1 if keep_timelines else jobs,
                                    scheduler=None if keep_timelines else scheduler,
                                    keep_timelines=keep_timelines, progress=progress)
        d, gpus = _reduce(summaries, files, paths, iteration_regex, keep_timelines, progress)
    if keep_timelines:
        for g in gpus:
            if g.timeline is not None:
                g.timeline.rank = g.rank
        d.timelines = [g.timeline for g in gpus if g.timeline is not None] or None
    return d


def diagnose_summaries(summaries, files, paths, iteration_regex: str | None = None) -> Diagnosis:
    """The job analysis over per-file summaries made elsewhere (``profclass.ranks.summarise_file``
    of each of ``files``, in order): what ``diagnose`` does once the per-file work is done, for
    callers that run that work themselves (the ``nsys recipe profclass`` reducer, profclass.recipe).
    ``files``: ``inputs.InputFile`` rows; ``sqlite`` may be None where the file is to be resolved
    again from ``given`` (a compressed export, an .nsys-rep report)."""
    return _reduce(summaries, files, [str(p) for p in paths], iteration_regex, False, None)[0]


def _reduce(summaries, files, paths, iteration_regex, keep_timelines, progress):
    """Per-file summaries -> the job's step across files -> one job -> the Diagnosis."""
    summaries = _agree_across_files(summaries, files, iteration_regex, keep_timelines)
    profiles = [fs.meta for fs in summaries]
    gpus = [g for fs in summaries for g in fs.gpus]
    all_ops = [fs.config_ops for fs in summaries]
    check_one_job(profiles, paths[0] if len(paths) == 1 else ", ".join(paths))
    if not gpus:
        raise ProfileError(paths[0] if len(paths) == 1 else ", ".join(paths),
                           "no GPU kernels in the profile (CPU-only capture, or CUDA tracing was off)")
    if progress:
        progress(f"analysing {len(gpus)} GPU(s)")
    return analyse(profiles, gpus, all_ops, [f.rank_hint for f in files], paths), gpus


def _agree_across_files(summaries, files, regex, keep_timelines):
    """One step for the job over all its GPUs, whichever exports hold them; the processes whose
    GPUs did not find the job's step are summarised again with it, at the reference GPU's step
    boundaries (clocks aligned on shadow copies of the compact summaries, so the real ones are
    shifted once, later)."""
    # also within one export: it is read one process at a time (ranks._summarise_sqlite), so
    # its GPUs agree here, not inside the per-process summaries
    gpus = [g for fs in summaries for g in fs.gpus]
    if len(gpus) < 2:
        return summaries
    job = iterations.consensus([g.step for g in gpus])
    redo = [g for g in gpus if iterations.takes_job_step(iterations.step_info(g), job)]
    if not redo:
        return summaries
    shadow = [copy(g) for g in gpus]
    for sh in shadow:
        sh.timeline, sh.ops = None, sh.ops.copy()
        sh.runtime, sh.nvtx = sh.runtime.copy(), sh.nvtx.copy()
    align_clocks(shadow, {i: fs.meta.session_start_ns for i, fs in enumerate(summaries)})
    ref = iterations.reference_starts([sh for sh, g in zip(shadow, gpus) if g not in redo], job)
    forced: dict[int, dict] = {}
    for sh, g in zip(shadow, gpus):
        if g in redo:
            bounds = None if ref is None else ref - sh.shift_ns
            forced.setdefault(g.source, {})[(g.pid, g.device)] = (job, bounds)
    out = list(summaries)
    for src, hint in forced.items():
        # only the processes holding those GPUs are read again; the others keep their summary
        redone = summarise_file(files[src].given, files[src].sqlite, src, regex, keep_timelines, hint)
        pids = {g.pid for g in redone.gpus}
        kept = [g for g in summaries[src].gpus if g.pid not in pids]
        out[src] = replace(summaries[src], gpus=sorted(kept + redone.gpus, key=lambda g: (g.pid, g.device)))
    return out


def analyse(profiles, gpus, all_ops, hints, paths) -> Diagnosis:
    """The job-level stages over the per-rank summaries: cross-rank analyzers -> classify ->
    configuration -> fixes and pitfalls, into one Diagnosis."""
    assign_ranks(gpus, profiles, hints)
    skew = align_clocks(gpus, {i: p.session_start_ns for i, p in enumerate(profiles)})
    # iterations and per-GPU analyzers ran per file, on its own clock (profclass.ranks)
    job = Job([GpuRecord(g, g.analysis, max(g.analysis.window.iterations, 1)) for g in gpus])
    job.layout = _layout(profiles, gpus)
    job.comm = communication.analyse_ranks(job)
    for g, k in zip(gpus, job.comm_kernels):
        if g.timeline is not None:  # kept for pictures: their lane per group
            g.timeline.comm_groups = k[["start", "end", "group"]]
    job.pipeline = pipeline_bubbles.measure(job)
    blamed = stragglers.find(job)
    verdict, shares = _classify(job, blamed)
    ops_all = pd.concat(all_ops, ignore_index=True) if all_ops else pd.DataFrame()
    recompute_ratio = float(np.median([r.analysis.memory.recompute_ratio for r in job.records]))
    cuda_graphs = any(r.analysis.host.graph_launches or r.analysis.host.graph_kernels for r in job.records)
    job.cfg = cfg = config.derive(profiles, ops_all, len(gpus), recompute_ratio, cuda_graphs,
                                  ep_size=job.layout.size("ep"), moe_router=job.layout.moe_router)
    numbers = analyzers.job_numbers(job)
    facts = {**config.config_facts(cfg), **analyzers.job_facts(job, numbers)}
    if job.layout.size("ep"):  # the layout knows whether experts are split over ranks
        facts["ep"] = job.layout.size("ep") > 1
    flags = config.run_flags(cfg)
    env_all = {k: v for p in profiles for k, v in p.env.items()}
    # whether memory has room for what a fix would add (recompute off): the pitfalls' fact
    facts["memory_headroom"] = pitfalls.facts(flags, env_all, cfg, memory.peak_share(job), len(job.records))[
        "memory_headroom"]
    # a fix is already on when its flag is on the command line or its variable in the environment
    chosen = fixes.select([verdict.wall, verdict.runner_up], facts, {**env_all, **flags}, numbers,
                          step_ms=job.step_ms)
    d = Diagnosis(
        inputs=list(paths),
        verdict=dict(wall=verdict.wall, confidence=verdict.confidence, runner_up=verdict.runner_up,
                     summary=_summary(verdict, shares, job.walls_ns, job.stragglers), scores=verdict.scores,
                     confidence_basis=verdict.confidence_basis,
                     straggler_blame_share=verdict.straggler_blame_share),
        walls=_walls(job, shares),
        window=iterations.window_section(job), devices=_devices(job), stragglers=job.stragglers,
        collectives=job.comm.collectives, fixes=chosen, evidence=analyzers.job_evidence(job, numbers),
        missing=(sorted({m for p in profiles for m in p.missing}) + iterations.missing(job)
                 + layout.missing(job) + communication.missing(job) + profiler.missing(job, numbers)), config=cfg,
        pitfalls=_pitfalls(job, flags, env_all, numbers, facts), memory=memory.section(job, numbers),
        clock={"aligned_sources": len(skew), "residual_skew_ns": skew} if skew else {},
        nsys_versions=sorted({p.nsys_version for p in profiles if p.nsys_version}),
        kernels=table_records(kernel_table(gpus, [r.iterations for r in job.records])),
        layout=job.layout.to_dict(), pipeline=job.pipeline.to_dict())
    d.numbers = numbers
    return d


def _walls(job: Job, shares: dict) -> dict:
    out = {w: {"share": round(shares[w], 4), "ms_per_step": round(job.walls_ns[w] / 1e6, 3)} for w in classify.WALLS}
    out["communication"]["by_group"] = communication.by_group(job)
    return out


def _layout(profiles, gpus) -> layout.Layout:
    """The layout from the command line, else (TP, PP, EP) from the traffic."""
    command = [a for p in profiles for a in p.command]
    env = {k: v for p in profiles for k, v in p.env.items()}
    lay = layout.build(config.parse_flags(command), command, env, len(gpus))
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
                       windows=[g.window for g in gpus], gemms=gemms, moe_router=moe_router)
    return lay


def _classify(job: Job, blamed: list[dict]) -> tuple[classify.Verdict, dict[str, float]]:
    """Walls per GPU and for the job, the verdict, and the stragglers' reasons (sets ``job``)."""
    thresholds = classify.load_thresholds()
    per_gpu_ns = []
    for r in job.records:
        r.walls_ns = classify.gpu_walls(r.analysis)
        per_gpu_ns.append(r.walls_ns)
    its = [r.iterations for r in job.records]
    late_walls = [classify.straggler_wall(s["gpu"], per_gpu_ns, its) for s in blamed]
    straggler_wall = late_walls[0][0] if blamed else None
    step_walls = classify.gpu_step_walls(per_gpu_ns, its, [r.comm.exposed_wait_ns for r in job.records],
                                         [s["gpu"] for s in blamed], straggler_wall)
    job.walls_ns = classify.job_walls(step_walls)
    job.step_ns = float(np.mean([r.analysis.window.window_ns / r.iterations for r in job.records]))
    job.stragglers = stragglers.straggler_rows(job, blamed, late_walls)
    shares = {w: (v / job.step_ns if job.step_ns else 0.0) for w, v in job.walls_ns.items()}
    memory_bound = not straggler_wall and memory.memory_bound(job)
    if straggler_wall:
        verdict = classify.decide_with_straggler(shares, thresholds, straggler_wall, blamed[0]["blame_share"])
    elif memory_bound:
        verdict = classify.decide_memory_bound(shares, thresholds)
    else:
        verdict = classify.decide(shares, thresholds)
    # the memory-bound rule decides by the charged recompute crossing its floor, not by outscoring
    floor = memory.MEMORY_BOUND_MIN_SHARE if memory_bound else None
    gpu_shares = [{w: v / max(sum(g.values()), 1) for w, v in g.items()} for g in step_walls]
    verdict.confidence, verdict.confidence_basis = classify.confidence(
        verdict.wall, shares, thresholds, gpu_shares, [r.analysis.window.step_ns for r in job.records],
        iterations.window_source(job) == "whole", floor=floor)
    # (a memory-bound verdict stands: taking waiting out of the step only raises the recompute's share)
    unseen = classify.unseen_peers_reading(step_walls, its, job.comm.unseen_exposed_wait_ns, thresholds) \
        if job.comm and not straggler_wall and not memory_bound else None
    if unseen is not None and unseen.wall != verdict.wall:
        # one rank of a bigger job: its collective time is transfer or waiting for unseen peers
        verdict.confidence = min(verdict.confidence, classify.UNSEEN_PEERS_CAP)
        verdict.runner_up = job.unseen_reading = unseen.wall
    return verdict, shares


def _devices(job: Job) -> list[dict]:
    """The Diagnosis ``devices``: each GPU's own walls, verdict, window and results."""
    thresholds = classify.load_thresholds()
    devices = []
    for r in job.records:
        g, window_ns = r.gpu, r.analysis.window.window_ns
        w_share = {w: v / max(window_ns, 1) for w, v in r.walls_ns.items()}
        devices.append(dict(
            pid=g.pid, device=g.device, rank=g.rank, file=g.path, wall=classify.decide(w_share, thresholds).wall,
            walls={w: {"share": round(w_share[w], 4), "ms_per_step": round(r.walls_ns[w] / r.iterations / 1e6, 3)}
                   for w in classify.WALLS},
            window_source=g.window_source, iterations=r.analysis.window.iterations,
            step_ms=round(window_ns / r.iterations / 1e6, 3),
            comm=asdict(r.comm) if len(job.records) > 1 else None,
            features=_round_features(analyzers.feature_record(r.analysis))))
    devices.sort(key=lambda dv: (dv["rank"] is None, dv["rank"], dv["pid"]))
    return devices


def _pitfalls(job: Job, flags: dict, env: dict, numbers: dict, measured: dict) -> list[dict]:
    """Rules over the run's configuration facts and the analyzers' measured ones (``measured``)."""
    peak_share = memory.peak_share(job)
    found = pitfalls.check({**measured, **pitfalls.facts(flags, env, job.cfg, peak_share, len(job.records))},
                           numbers, job.step_ms)
    for pf in found:
        if peak_share is not None and "memory_headroom" in pf["facts"]:
            pf["evidence"] = memory.headroom_note(peak_share)
    return found


def _round_features(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def _summary(verdict, shares, job_ns, stragglers) -> str:
    w = verdict.wall
    s = (f"{w} wall: {100 * shares[w]:.0f}% of the steady-state step ({job_ns[w] / 1e6:.1f} ms/step); "
         f"runner-up {verdict.runner_up} ({100 * shares[verdict.runner_up]:.0f}%)")
    if stragglers:
        st = stragglers[0]
        s += (f"; rank {st['rank']} is the straggler ({st['reason']}), costing the others "
              f"{st['others_wait_ms_per_step']:.1f} ms/step of waiting")
    return s + "."
