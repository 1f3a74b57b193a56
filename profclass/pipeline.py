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
from copy import copy
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from . import analyzers, classify, config, fixes, pitfalls, train_log as train_logs
from .analyzers import GpuRecord, Job, iterations, layout_stage, matching, memory, pipeline_bubbles, stragglers
from .clocks import align_clocks
from .contract import stamp
from .errors import ProfileError
from .inputs import resolve
from .kernel_table import kernel_table, table_records
from .onejob import check_one_job
from .ranks import assign_ranks
from .replay import run as replay_run
from .ranks import summarise_file
from .workers import summarise_files

@dataclass(frozen=True)
class NotInJson:
    """What a Diagnosis holds besides its JSON, for the library API, the reports and ``diff``."""

    numbers: dict | None = None  # the job numbers fix gains are priced from (ms per step)
    # diagnose(keep_timelines=True)'s analysed GpuTimelines (for pictures and kernel tables)
    timelines: list | None = None
    # a diagnosis read back from its JSON: (path, schema version, profclass version)
    saved_from: tuple | None = None
    # diagnose(keep_replay=True): the replay's inputs (per-GPU traces on the job's clock), for
    # ``diff``'s replayed split of a step change (profclass.diff.split)
    replay_inputs: object | None = None


@dataclass(frozen=True)
class ReplayReport:
    """The replay stage's part of the JSON: its ``replay`` section and the fix ``plan``."""

    section: dict = field(default_factory=dict)
    plan: list = field(default_factory=list)


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
    # the JSON's ``replay`` (the step replayed: fidelity, walls removed) and ``plan`` (the fixes
    # in order, each replayed on top of the last): profclass.replay
    replayed: ReplayReport = field(default_factory=lambda: ReplayReport())
    extra: NotInJson = field(default_factory=NotInJson)  # not in the JSON

    @property
    def numbers(self) -> dict | None:
        return self.extra.numbers

    @property
    def timelines(self) -> list | None:
        return self.extra.timelines

    @property
    def saved_from(self) -> tuple | None:
        return self.extra.saved_from

    def to_dict(self) -> dict:
        # schema_version, profclass_version first (profclass.contract)
        raw = {k: v for k, v in asdict(replace(self, extra=NotInJson())).items() if k != "extra"}
        replayed = raw.pop("replayed")
        return stamp({**raw, "replay": replayed["section"], "plan": replayed["plan"]})

    @property
    def replay(self) -> dict:
        return self.replayed.section

    @property
    def plan(self) -> list:
        return self.replayed.plan

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
             keep_timelines: bool = False, jobs: int = 1, scheduler: str | None = None,
             price_fixes: tuple[str, ...] = (), keep_replay: bool = False,
             untraced_step_ms: float | None = None, train_log=None) -> Diagnosis:
    """Diagnose a job from its nsys exports. Raises ProfileError on bad input.

    ``progress(message, fraction=None)``, when given, is called as each stage starts
    (fraction: how far through the files, or through an nsys export, when known).
    ``keep_timelines`` keeps the per-GPU timelines on ``Diagnosis.timelines`` (single process).
    ``keep_replay`` keeps the replay's inputs on ``Diagnosis.extra.replay_inputs`` (``diff``).
    ``price_fixes``: fix ids to price beside the chosen ones (``replay["requested"]``), each as
    ``id[:key=value,...]`` with the change a run made; ``a+b`` prices fixes applied together.
    ``untraced_step_ms``: the job's own step without the profiler (its log's iteration time outside
    the capture); the replay's host is calibrated to it before any fix is priced
    (``replay.calibrate``). ``train_log``: instead, the job's training log (a path, or a
    ``train_log.TrainLog`` as ``train_log.read`` returns it, for another format or iterations to
    leave out): its median step outside warm-up and the profiled iterations (``profclass.train_log``).
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
    if untraced_step_ms is not None and not (np.isfinite(untraced_step_ms) and untraced_step_ms > 0):
        raise ProfileError("--untraced-step-ms", f"not a positive number of ms ({untraced_step_ms})")
    untraced = _untraced(untraced_step_ms, train_log)
    with resolve(paths, progress=progress) as files:
        # timelines (whole DataFrames) stay in the process that made them: keeping them means
        # the per-file work runs here
        summaries = summarise_files(files, iteration_regex,
                                    jobs=1 if keep_timelines else jobs,
                                    scheduler=None if keep_timelines else scheduler,
                                    keep_timelines=keep_timelines, progress=progress)
        d, gpus = _reduce(summaries, files, paths, iteration_regex, keep_timelines, progress, price_fixes, untraced)
    if keep_timelines:
        for g in gpus:
            if g.timeline is not None:
                g.timeline.rank = g.rank
        d = replace(d, extra=replace(d.extra, timelines=[g.timeline for g in gpus if g.timeline is not None] or None))
    if not keep_replay:
        d = replace(d, extra=replace(d.extra, replay_inputs=None))
    return d


def diagnose_summaries(summaries, files, paths, iteration_regex: str | None = None) -> Diagnosis:
    """The job analysis over per-file summaries made elsewhere (``profclass.ranks.summarise_file``
    of each of ``files``, in order): what ``diagnose`` does once the per-file work is done, for
    callers that run that work themselves (the ``nsys recipe profclass`` reducer, profclass.recipe).
    ``files``: ``inputs.InputFile`` rows; ``sqlite`` may be None where the file is to be resolved
    again from ``given`` (a compressed export, an .nsys-rep report)."""
    d = _reduce(summaries, files, [str(p) for p in paths], iteration_regex, False, None)[0]
    return replace(d, extra=replace(d.extra, replay_inputs=None))


def _untraced(untraced_step_ms: float | None, train_log):
    """The job's given step without the profiler: a number of ms, a read ``train_log.TrainLog``
    (a path is read here, before any work: a bad log is bad input), or None."""
    if train_log is None:
        return untraced_step_ms
    if untraced_step_ms is not None:
        raise ProfileError("--train-log", "give the job's step without the profiler as --untraced-step-ms or "
                                          "--train-log, not both")
    return train_log if isinstance(train_log, train_logs.TrainLog) else train_logs.read(train_log)


def _reduce(summaries, files, paths, iteration_regex, keep_timelines, progress, price_fixes=(), untraced=None):
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
    return analyse(profiles, gpus, all_ops, [f.rank_hint for f in files], paths, price_fixes, untraced), gpus


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


def analyse(profiles, gpus, all_ops, hints, paths, price_fixes=(), untraced=None) -> Diagnosis:
    """The job-level stages over the per-rank summaries, each on the frozen outputs of the ones
    before it: layout -> communication -> pipeline -> stragglers -> classify -> configuration
    -> the analyzers' job halves -> fixes and pitfalls, into one Diagnosis (the last two: diagnose's)."""
    assign_ranks(gpus, profiles, hints)
    skew = align_clocks(gpus, {i: p.session_start_ns for i, p in enumerate(profiles)})
    # iterations and per-GPU analyzers ran per file, on its own clock (profclass.ranks)
    records = tuple(GpuRecord(g, g.analysis, max(g.analysis.window.iterations, 1)) for g in gpus)
    lay = layout_stage.job_layout(profiles, gpus)
    comm = matching.analyse_ranks(records, lay)
    # the schedule's own signature, once the PP group's kernels are known
    lay = layout_stage.with_exchanges(lay, records, comm)
    for g, kernels in zip(gpus, comm.kernels):
        if g.timeline is not None:  # kept for pictures: their lane per group
            g.timeline.comm_groups = kernels[["start", "end", "group"]]
    pipe = pipeline_bubbles.measure(records, lay, comm)
    blamed = stragglers.find(records, comm.ranks)
    walls = classify.classify_job(records, comm.ranks, comm.unseen_exposed_wait_ns, blamed,
                                  iterations.window_source(records) == "whole")
    names = _kernel_names(records)
    cfg = _config(profiles, all_ops, records, lay, names)
    job = Job(records=records, layout=lay, comm=comm, pipeline=pipe, walls=walls, cfg=cfg,
              stragglers=stragglers.straggler_rows(records, lay, blamed, walls.late_walls))
    out = analyzers.job_outputs(job)
    env_all = {k: v for p in profiles for k, v in p.env.items()}
    # the run's own facts (pitfalls.facts) need the peak memory share, worked out once here
    peak_share = memory.peak_share(job)
    run_facts = pitfalls.facts(job.flags, env_all, cfg, peak_share, len(records), names)
    # whether memory has room for what a fix would add (recompute off): the pitfalls' fact
    facts = {**config.config_facts(cfg), **out.facts, "memory_headroom": run_facts["memory_headroom"]}
    # a fix is already on when its flag is on the command line or its variable in the environment
    flags = {**env_all, **job.flags}
    chosen = fixes.select([walls.verdict.wall, walls.verdict.runner_up], facts, flags, out.numbers, step_ms=job.step_ms)
    found = pitfalls.check({**facts, **run_facts}, out.numbers, job.step_ms)
    undo = pitfalls.undoing_fixes(found)
    inp, untraced_missing = _replay_inputs(job, gpus, out.numbers["probe_call_ns"], untraced, out.sections["window"])
    # every wall's fixes that apply: a pitfall's fix may enter the plan, and a wall's fixes join
    # it once a step leaves that wall the largest
    every_wall = fixes.select(list(classify.WALLS), facts, flags, out.numbers, step_ms=job.step_ms)
    replayed = replay_run.replay_job(inp, chosen, {f["id"]: f for f in fixes.load_table()}, walls.verdict.wall,
                                     price_fixes, quiet=undo,
                                     plan_walls={w: [f for f in every_wall if f["wall"] == w] for w in classify.WALLS})
    chosen = replay_run.priced(fixes.joined(chosen, every_wall, undo, replayed.plan), replayed.prices, job.step_ms)
    found = pitfalls.priced(found, {i: (p.best_ms, p.basis) for i, p in replayed.prices.items()}, job.step_ms)
    for pf in found:
        if peak_share is not None and "memory_headroom" in pf["facts"]:
            pf["evidence"] = memory.headroom_note(peak_share)
    return Diagnosis(
        inputs=list(paths), verdict=classify.verdict_section(walls, job.stragglers),
        walls=classify.walls_section(walls, comm.collectives),
        devices=classify.device_rows(records, walls, comm.ranks, [analyzers.feature_record(r.analysis)
                                                                  for r in records]),
        fixes=chosen, evidence=out.evidence, config=cfg, pitfalls=found,
        missing=(sorted({m for p in profiles for m in p.missing}) + config.scope_missing(cfg)
                 + config.graph_trace_missing(cfg) + out.missing + untraced_missing + replayed.missing),
        clock={"aligned_sources": len(skew), "residual_skew_ns": skew} if skew else {},
        nsys_versions=sorted({p.nsys_version for p in profiles if p.nsys_version}),
        kernels=table_records(kernel_table(gpus, [r.iterations for r in records], list(comm.kernels))),
        extra=NotInJson(numbers=out.numbers, replay_inputs=inp), replayed=ReplayReport(replayed.section, replayed.plan),
        **out.sections)


def _replay_inputs(job: Job, gpus, host_probe_ns: float | None, untraced=None,
                   window: dict | None = None) -> tuple[replay_run.ReplayInputs, list]:
    """The replay stage's inputs: the job's per-GPU traces (on the job's clock), its
    collectives' groups, its measured steps, the host's speed (the host analyzer's probe), the
    job's own step without the profiler where the user gave it, a number or a training log read
    with the launch line's profiled range (profclass.replay, profclass.train_log), whether the
    window is the run's first steps (the ``window`` section's capture_start); and the
    ``missing`` lines of a log that gave no step."""
    given = train_logs.given_step(untraced, job.flags)
    return replay_run.ReplayInputs(
        traces=tuple(replace(g.replay_trace, shift_ns=g.shift_ns) for g in gpus),
        comm_kernels=tuple(job.comm.kernels), members=tuple(job.comm.members), ranks=tuple(g.rank for g in gpus),
        step_ns=tuple(r.analysis.window.window_ns / r.iterations for r in job.records),
        profiler_ns_per_step=tuple(r.analysis.profiler.profiler_inflation_ns / r.iterations for r in job.records),
        microbatches=job.layout.size("microbatches") if job.layout else None,
        pipeline=job.pipeline, host_probe_ns=host_probe_ns, untraced_step_ms=given.step_ms,
        untraced_step_source=given.source,
        run_start_window=(window or {}).get("capture_start") == "process"), list(given.missing)


def _kernel_names(records) -> pd.Series | None:
    """The job's distinct kernel names (full, demangled) in the windows."""
    aggs = [r.gpu.kernel_agg for r in records if r.gpu.kernel_agg is not None]
    return pd.Series(pd.concat([a["full_name"].astype(str) for a in aggs]).unique()) if aggs else None


def _config(profiles, all_ops, records, lay, names: pd.Series | None) -> dict:
    """The configuration stage: the Diagnosis ``config`` section."""
    ops_all = pd.concat(all_ops, ignore_index=True) if all_ops else pd.DataFrame()
    recompute_ratio = float(np.median([r.analysis.memory.recompute_ratio for r in records]))
    cuda_graphs = any(r.analysis.host.graph_launches or r.analysis.host.graph_kernels for r in records)
    return config.derive(profiles, ops_all, len(records), recompute_ratio, cuda_graphs,
                         ep_size=lay.size("ep"), moe_router=lay.moe_router, kernel_names=names,
                         ep_source=lay.source.get("ep"))
