"""The facade: load -> timeline -> features -> classify -> fixes, into one ``Diagnosis``.

``diagnose(paths)`` accepts one export holding every rank, one export per rank, or a
directory of them (``.sqlite``, ``.sqlite.zst``, ``.nsys-rep``).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from . import classify, comm, config, fixes, pitfalls
from .contract import stamp
from .errors import ProfileError
from .inputs import resolve
from .kernel_table import kernel_table, table_records
from .onejob import check_one_job
from .ranks import summarise_files
from .timeline import GpuTimeline

HOST_SYNC_IDLE_MIN = 0.03  # share of the step idle after host syncs that makes them worth fixing


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
    clock: dict = field(default_factory=dict)
    nsys_versions: list[str] = field(default_factory=list)
    # time per step of each normalised kernel/copy name, mean per GPU (what `diff` matches)
    kernels: list[dict] = field(default_factory=list)
    # diagnose(keep_timelines=True) sets this to the analysed GpuTimelines (for pictures and
    # kernel tables); a plain class attribute, so not a dataclass field and not in to_dict()
    timelines = None

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


def _assign_ranks(gpus: list[GpuTimeline], profiles, hints) -> None:
    sources = sorted({g.source for g in gpus})
    if len(sources) > 1:  # one report per rank: the captured RANK, else the file name
        for g in gpus:
            env_rank = profiles[g.source].env.get("RANK")
            if env_rank is not None and str(env_rank).isdigit():
                g.rank = int(env_rank)
            elif hints[g.source] is not None:
                g.rank = hints[g.source]
    if any(g.rank is None for g in gpus):
        # one report holding every rank (torchrun on one node: rank follows the device), or
        # no better source: by (report, device) order
        order = sorted(range(len(gpus)), key=lambda i: (gpus[i].source, gpus[i].device, gpus[i].pid))
        for r, i in enumerate(order):
            gpus[i].rank = r
    ranks = [g.rank for g in gpus]
    if len(set(ranks)) != len(ranks):
        for r, i in enumerate(sorted(range(len(gpus)), key=lambda i: (ranks[i], gpus[i].source))):
            gpus[i].rank = r


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
        profiles = [fs.meta for fs in summaries]
        gpus = [g for fs in summaries for g in fs.gpus]
        all_ops = [fs.config_ops for fs in summaries]
        check_one_job(profiles, paths[0] if len(paths) == 1 else ", ".join(paths))
        if not gpus:
            raise ProfileError(paths[0] if len(paths) == 1 else ", ".join(paths),
                               "no GPU kernels in the profile (CPU-only capture, or CUDA tracing was off)")
    if progress:
        progress(f"analysing {len(gpus)} GPU(s)")
    d = analyse(profiles, gpus, all_ops, [f.rank_hint for f in files], iteration_regex, paths)
    if keep_timelines:
        for g in gpus:
            if g.timeline is not None:
                g.timeline.rank = g.rank
        d.timelines = [g.timeline for g in gpus if g.timeline is not None] or None
    return d


def analyse(profiles, gpus, all_ops, hints, iteration_regex, paths) -> Diagnosis:
    thresholds = classify.load_thresholds()
    _assign_ranks(gpus, profiles, hints)
    skew = comm.align_clocks(gpus, {i: p.session_start_ns for i, p in enumerate(profiles)})
    # iterations and features were found per file, on its own clock (profclass.ranks)
    feats = [g.features for g in gpus]
    comp_sets = [g.compute for g in gpus]
    its = [max(f.iterations, 1) for f in feats]
    ca = comm.analyse(gpus, comp_sets, its)
    per_gpu_ns = [classify.gpu_walls(f) for f in feats]
    straggler_idx = [s["gpu"] for s in ca.stragglers]
    straggler_wall = classify.straggler_wall(straggler_idx[0], per_gpu_ns, its)[0] if straggler_idx else None
    job_ns = classify.job_walls(per_gpu_ns, its, [r.exposed_wait_ns for r in ca.ranks],
                                straggler_idx, straggler_wall)
    step_ns = float(np.mean([f.window_ns / it for f, it in zip(feats, its)]))
    shares = {w: (v / step_ns if step_ns else 0.0) for w, v in job_ns.items()}
    if straggler_wall:
        verdict = classify.decide_with_straggler(shares, thresholds, straggler_wall,
                                                 ca.stragglers[0]["blame_share"])
    else:
        verdict = classify.decide(shares, thresholds)

    devices = []
    for j, (g, f) in enumerate(zip(gpus, feats)):
        w_share = {w: v / max(f.window_ns, 1) for w, v in per_gpu_ns[j].items()}
        dv = classify.decide(w_share, thresholds)
        devices.append(dict(
            pid=g.pid, device=g.device, rank=g.rank, file=g.path, wall=dv.wall,
            walls={w: {"share": round(w_share[w], 4), "ms_per_step": round(per_gpu_ns[j][w] / its[j] / 1e6, 3)}
                   for w in classify.WALLS},
            window_source=g.window_source, iterations=f.iterations,
            step_ms=round(f.window_ns / its[j] / 1e6, 3),
            comm=asdict(ca.ranks[j]) if len(gpus) > 1 else None,
            features=_round_features(f.to_dict())))
    devices.sort(key=lambda dv: (dv["rank"] is None, dv["rank"], dv["pid"]))
    stragglers = []
    for s in ca.stragglers:
        g = gpus[s["gpu"]]
        reason, detail = _straggler_reason(s["gpu"], gpus, feats, per_gpu_ns, its)
        stragglers.append(dict(pid=g.pid, device=g.device, rank=g.rank, reason=reason, detail=detail,
                               cost_ms_per_step=s["blame_ms_per_step"],
                               others_wait_ms_per_step=s["others_wait_ms_per_step"],
                               blame_share=s["blame_share"]))
    ops_all = pd.concat(all_ops, ignore_index=True) if all_ops else pd.DataFrame()
    recompute_ratio = float(np.median([f.recompute_ratio for f in feats]))
    cuda_graphs = any(f.graph_launches or f.graph_kernels for f in feats)
    cfg = config.derive(profiles, ops_all, len(gpus), recompute_ratio, cuda_graphs)
    numbers = _numbers(feats, its, ca, stragglers, job_ns)
    ctx = _context(cfg, feats, its, numbers, stragglers, step_ns)
    flags = cfg.get("command_line_flags", {}).get("value", {})
    env_all = {k: v for p in profiles for k, v in p.env.items()}
    # a fix is already on when its flag is on the command line or its variable in the environment
    chosen = fixes.select([verdict.wall, verdict.runner_up], ctx, {**env_all, **flags}, numbers,
                          step_ms=step_ns / 1e6)
    peaks = [f.peak_memory_bytes / f.total_memory_bytes for f in feats
             if f.peak_memory_bytes and f.total_memory_bytes]
    peak_share = max(peaks) if peaks else None
    found = pitfalls.check(pitfalls.facts(flags, env_all, cfg, peak_share, len(gpus)), numbers, step_ns / 1e6)
    for pf in found:
        if peak_share is not None and "memory_headroom" in pf["facts"]:
            pf["evidence"] = f"peak GPU memory {100 * peak_share:.0f}% of capacity (CUDA_GPU_MEMORY_USAGE_EVENTS)"
    per_it = [np.asarray(f.step_ns, float) / 1e6 for f in feats]
    if len({len(p) for p in per_it}) == 1:  # the same iterations on every GPU
        job_steps = np.mean(np.stack(per_it), axis=0)
    else:
        job_steps = max(per_it, key=len)
    sources = sorted({g.window_source for g in gpus}, key=["nvtx", "periodicity", "whole"].index)
    window = dict(source=sources[0], sources={g.label: g.window_source for g in gpus},
                  iterations=int(np.median(its)),
                  # mean: the step every share and ms/step refers to (mean over GPUs of their
                  # steady windows); the spread comes from the per-iteration steps
                  step_ms=dict(mean=round(step_ns / 1e6, 3), median=round(float(np.median(job_steps)), 3),
                               std=round(float(job_steps.std(ddof=1)) if len(job_steps) > 1 else 0.0, 3),
                               min=round(float(job_steps.min()), 3), max=round(float(job_steps.max()), 3),
                               per_iteration=[round(float(x), 3) for x in job_steps]))
    summary = _summary(verdict, shares, job_ns, stragglers, gpus)
    missing = sorted({m for p in profiles for m in p.missing})
    if sources[0] == "whole":
        missing.append("iterations (no NVTX iteration ranges and no periodic kernel pattern: the whole "
                       "capture was diagnosed as one window; a capture shorter than one iteration looks "
                       "like this)")
    return Diagnosis(
        inputs=list(paths),
        verdict=dict(wall=verdict.wall, confidence=verdict.confidence, runner_up=verdict.runner_up,
                     summary=summary, scores=verdict.scores),
        walls={w: {"share": round(shares[w], 4), "ms_per_step": round(job_ns[w] / 1e6, 3)} for w in classify.WALLS},
        window=window, devices=devices, stragglers=stragglers, collectives=ca.collectives,
        fixes=chosen, evidence=_evidence(feats, its, ca, numbers, step_ns), missing=missing, config=cfg,
        pitfalls=found,
        clock={"aligned_sources": len(skew), "residual_skew_ns": skew} if skew else {},
        nsys_versions=sorted({p.nsys_version for p in profiles if p.nsys_version}),
        kernels=table_records(kernel_table(gpus, its)))


def _round_features(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


REASON_OF_WALL = {"compute": "imbalance", "host": "host", "memory": "memory"}


def _straggler_reason(j, gpus, feats, per_gpu_ns, its) -> tuple[str, str]:
    wall, excess = classify.straggler_wall(j, per_gpu_ns, its)
    others = [k for k in range(len(gpus)) if k != j]
    f = feats[j]
    if wall == "compute":
        med_gemm = float(np.median([feats[k].gemm_ns / its[k] for k in others]))
        return ("imbalance", f"{excess / 1e6:.1f} ms/step more compute than its peers' median, "
                             f"{f.gemm_ns / its[j] / 1e6:.1f} vs {med_gemm / 1e6:.1f} ms/step of GEMMs "
                             f"(expert load / routing imbalance)")
    if wall == "host":
        med_idle = float(np.median([feats[k].idle_ns / its[k] for k in others]))
        return ("host", f"host-bound: {excess / 1e6:.1f} ms/step more GPU idle than its peers "
                        f"({f.idle_ns / its[j] / 1e6:.1f} vs {med_idle / 1e6:.1f} ms/step)")
    return ("memory", f"memory: {excess / 1e6:.1f} ms/step more recompute/allocator/offload time than its peers")


def _mean_per_step(feats, its, attr) -> float:
    return float(np.mean([getattr(f, attr) / it for f, it in zip(feats, its)])) / 1e6


def _numbers(feats, its, ca, stragglers, job_ns) -> dict:
    """Job-level quantities (ms per step) that fix gains are computed from."""
    n = len(feats)
    ep_types, dp_types = ("all_to_all",), ("all_reduce", "reduce_scatter", "all_gather")

    def exposed(types, transfer_only):
        """Exposed time of these collectives per step (transfer only: without peer waiting)."""
        keys = ("exposed_transfer_ns",) if transfer_only else ("exposed_transfer_ns", "exposed_wait_ns")
        vals = []
        for j, (f, it) in enumerate(zip(feats, its)):
            by_type = ca.ranks[j].by_type
            if n > 1 and by_type:
                v = sum(by_type.get(t, {}).get(k, 0) for t in types for k in keys)
            else:
                v = sum(f.exposed_comm_by_type_ns.get(t, 0) for t in types)
            vals.append(v / it)
        return float(np.mean(vals)) / 1e6 if vals else 0.0

    comp_ms = _mean_per_step(feats, its, "compute_ns")
    sm_busy = []
    for f in feats:
        if f.sm_active is not None and f.compute_ns:
            sm_busy.append(min(1.0, f.sm_active * f.window_ns / f.compute_ns))
    pair_keep = float(np.mean([f.pair_fwd_ns * f.recompute_ratio / (1 + f.recompute_ratio) / it
                               for f, it in zip(feats, its)])) / 1e6
    comm_wait_ms = float(np.mean([ca.ranks[j].exposed_wait_ns / it for j, it in enumerate(its)])) / 1e6
    return dict(
        straggler_wait_ms=sum(s["others_wait_ms_per_step"] for s in stragglers),
        comm_wait_ms=comm_wait_ms,
        exposed_ep_ms=exposed(ep_types, True), exposed_dp_ms=exposed(dp_types, False),
        compute_ms=comp_ms, gemm_ms=_mean_per_step(feats, its, "gemm_ns"),
        elementwise_ms=max(0.0, comp_ms - _mean_per_step(feats, its, "gemm_ns")),
        idle_sync_ms=_mean_per_step(feats, its, "idle_sync_ns"),
        idle_launch_ms=_mean_per_step(feats, its, "idle_launch_ns"),
        idle_alloc_ms=_mean_per_step(feats, its, "idle_alloc_ns"),
        gc_ms=_mean_per_step(feats, its, "gc_ns"),
        recompute_ms=_mean_per_step(feats, its, "recompute_ns"), selective_keep_ms=pair_keep,
        offload_ms=_mean_per_step(feats, its, "offload_exposed_ns") + _mean_per_step(feats, its, "idle_offload_ns"),
        memory_ms=job_ns["memory"] / 1e6, host_ms=job_ns["host"] / 1e6,
        sm_busy=float(np.mean(sm_busy)) if sm_busy else 1.0)


def _context(cfg, feats, its, numbers, stragglers, step_ns) -> dict:
    step_ms = step_ns / 1e6
    kern_per_step = np.mean([f.kernels / it for f, it in zip(feats, its)])
    lb = np.mean([f.launch_bound_kernels / max(f.kernels, 1) for f in feats])
    return dict(
        ep=cfg["expert_parallel"]["value"], dispatcher=cfg["dispatcher"]["value"],
        platform=cfg["platform"]["value"], cuda_graphs=cfg["cuda_graphs"]["value"],
        fp8=cfg["fp8"]["value"], recompute=cfg["recompute"]["value"] == "full",
        straggler_reason=stragglers[0]["reason"] if stragglers else None,
        dp_comm_exposed=numbers["exposed_dp_ms"] >= 0.02 * step_ms,
        comm_wait_dominant=bool(not stragglers and numbers["comm_wait_ms"] > numbers["exposed_ep_ms"]
                                and numbers["comm_wait_ms"] >= 0.05 * step_ms),
        tp_comm_exposed=False,
        host_sync_idle=numbers["idle_sync_ms"] >= HOST_SYNC_IDLE_MIN * step_ms,
        launch_bound_kernels=bool(lb >= 0.2),
        alloc_in_steady=numbers["idle_alloc_ms"] > 0,
        offload=numbers["offload_ms"] > 0.01 * step_ms,
        many_small_gemms=bool(numbers["sm_busy"] < 0.6 or kern_per_step > 2000),
    )


def _evidence(feats, its, ca, numbers, step_ns) -> list[dict]:
    """The rows behind the verdict: job means, ms per step, with what each measures."""
    step_ms = step_ns / 1e6

    def row(wall, metric, value, unit, note):
        return dict(wall=wall, metric=metric, value=round(float(value), 3), unit=unit, note=note)

    ev = [row("compute", "compute kernels", _mean_per_step(feats, its, "compute_ns"), "ms/step",
              "union of compute kernel time"),
          row("compute", "GEMM kernels", numbers["gemm_ms"], "ms/step", "GEMM-type kernels")]
    sm = [f.sm_active for f in feats if f.sm_active is not None]
    if sm:
        ev.append(row("compute", "SM active", float(np.mean(sm)), "fraction", feats[0].sm_active_source))
    ev += [row("communication", "exposed communication", _mean_per_step(feats, its, "exposed_comm_ns"), "ms/step",
               "communication not overlapped by compute"),
           row("communication", "overlapped communication", _mean_per_step(feats, its, "overlapped_comm_ns"),
               "ms/step", "communication hidden under compute")]
    for c in ca.collectives:
        ev.append(row("communication", f"{c['collective']} exposed transfer", c["exposed_transfer_ms_per_step"],
                      "ms/step", f"{c['group']} group; wait {c['exposed_wait_ms_per_step']} ms/step"))
    ev += [row("host", "idle after host syncs", numbers["idle_sync_ms"], "ms/step",
               "GPU idle that began when a host synchronisation returned"),
           row("host", "idle, launch-late", numbers["idle_launch_ms"], "ms/step",
               "the next kernel was launched after the GPU ran dry"),
           row("host", "idle, other", _mean_per_step(feats, its, "idle_other_ns"), "ms/step",
               "queued work waited on another stream or peer"),
           row("host", "kernels shorter than their launch", float(np.mean([f.launch_bound_kernels / it for f, it in zip(feats, its)])),
               "per step", "launch-bound kernels"),
           row("memory", "recompute (estimate)", numbers["recompute_ms"], "ms/step",
               f"forward/backward kernel ratio {np.mean([f.recompute_ratio for f in feats]):.2f}"),
           row("memory", "idle around allocator calls", numbers["idle_alloc_ms"], "ms/step",
               f"{np.mean([f.alloc_calls / it for f, it in zip(feats, its)]):.1f} cudaMalloc/cudaFree-type calls per step"),
           row("memory", "offload copies (exposed) and their waits", numbers["offload_ms"], "ms/step",
               f"{np.mean([f.offload_bytes / it for f, it in zip(feats, its)]) / 2**20:.1f} MiB host<->device per step")]
    peaks = [(f.peak_memory_bytes, f.total_memory_bytes) for f in feats if f.peak_memory_bytes]
    if peaks:
        peak, total = max(peaks)
        ev.append(row("memory", "peak GPU memory", peak / 2**30, "GiB",
                      f"of {total / 2**30:.0f} GiB ({100 * peak / total:.0f}%)" if total else "capacity unknown"))
    ev.append(row("all", "step time", step_ms, "ms", "mean steady-state step"))
    return ev


def _summary(verdict, shares, job_ns, stragglers, gpus) -> str:
    w = verdict.wall
    s = (f"{w} wall: {100 * shares[w]:.0f}% of the steady-state step ({job_ns[w] / 1e6:.1f} ms/step); "
         f"runner-up {verdict.runner_up} ({100 * shares[verdict.runner_up]:.0f}%)")
    if stragglers:
        st = stragglers[0]
        s += (f"; rank {st['rank']} is the straggler ({st['reason']}), costing the others "
              f"{st['others_wait_ms_per_step']:.1f} ms/step of waiting")
    return s + "."
