"""Stage 4, classify: split steady-state time between the four walls and name the dominant one.

Per GPU, over the window (``docs/classification.md`` has the derivation):

    memory        = recompute + idle around allocator calls + exposed offload copies
                    + idle right after offload copies
    communication = exposed communication (transfer + waiting for peers)
    host          = the rest of the idle time (input, launch-late, after host syncs, other)
                    + exposed input copies (host-to-device copies that are not offload)
    compute       = compute kernels - recompute + other exposed copies
    (recompute is memory's only when the card is near capacity: ``memory.charged_recompute``)

The four add up to the window. Job level: when a straggler exists, the time other ranks
spend *waiting* for it is moved from communication to the straggler's own wall (the wall in
which it spends more than its peers), and the job's walls are the mean over GPUs.

Verdict: each wall's share is divided by its calibrated threshold (``data/calibration.toml``,
fitted on the independent labels of the corpus by ``bench/calibrate.py``); the largest score
wins, the second is the runner-up. The rules (a straggler, the memory-bound job) only count
their evidence in the wall it names; they never override a larger score, so a verdict is never
less likely than its runner-up. ``Verdict.rule`` names the rule when the wall it fed is the
verdict, ``rule_note`` says why a rule that found its evidence did not decide. ``confidence`` is the probability that the winner's margin over the
runner-up is real given how well the window measured it (``confidence``; the derivation and
its constants are in ``docs/classification.md``).
"""
from __future__ import annotations

from dataclasses import replace
from math import erf, sqrt
from typing import TYPE_CHECKING

from .tables import read_table
from .verdict import JobWalls, Verdict

if TYPE_CHECKING:
    from .analyzers.job import GpuRecord
    from .analyzers.results import GpuAnalysis, RankComm

WALLS = ("compute", "communication", "host", "memory")
# one share's error beyond sampling: the largest share difference between two captures of one
# configuration in the corpus (docs/classification.md, constants table)
SHARE_NOISE = 0.05
# per-iteration step spread assumed when one step cannot measure it: the largest a steady step
# may differ from the median before it counts as warm-up (iterations.WARMUP_FACTOR - 1)
UNMEASURED_SPREAD = 0.25
WHOLE_CAPTURE_CAP = 0.5  # a whole-capture window is not shown to be the steady state
# a verdict that holds if a lone rank's collective time is transfer and not if part of it is
# waiting for ranks outside the profile: nothing in the profile weighs the two readings
UNSEEN_PEERS_CAP = 0.5
# recompute charged to memory above this share of the step makes the job memory-bound: above
# the 5-10% run-to-run noise of a step, so what memory costs is measurable
MEMORY_BOUND_MIN_SHARE = 0.10


def load_thresholds() -> dict[str, float]:
    return {w: float(v) for w, v in read_table("calibration")["thresholds"].items()}


def gpu_walls(a: GpuAnalysis) -> dict[str, int]:
    """Nanoseconds of the window per wall for one GPU (they sum to the window)."""
    from .analyzers.memory import charged_recompute

    mem, idle = a.memory, a.idle
    host = idle.idle_ns - idle.idle_alloc_ns - idle.idle_offload_ns
    rc = charged_recompute(mem)
    rc["host"] = min(rc["host"], host)  # launch gaps the idle split already gave to memory stay there
    comm = a.communication.exposed_comm_ns - rc["communication"]
    memory = sum(rc.values()) + idle.idle_alloc_ns + idle.idle_offload_ns + mem.offload_exposed_ns
    # exposed input copies are the input pipeline's (host), other exposed copies compute's
    inp = min(idle.input_exposed_ns, a.compute.exposed_copy_ns - mem.offload_exposed_ns)
    compute = a.compute.compute_ns - rc["compute"] + (a.compute.exposed_copy_ns - mem.offload_exposed_ns - inp)
    return {"compute": int(compute), "communication": int(comm), "host": int(host - rc["host"] + inp),
            "memory": int(memory)}


def decide(shares: dict[str, float], thresholds: dict[str, float]) -> Verdict:
    scores = {w: shares.get(w, 0.0) / thresholds[w] for w in WALLS}
    ranked = sorted(WALLS, key=lambda w: -scores[w])
    return Verdict(wall=ranked[0], runner_up=ranked[1], confidence=0.0,
                   scores={w: round(v, 3) for w, v in scores.items()})


def decide_memory_bound(shares: dict[str, float], thresholds: dict[str, float], charged_share: float) -> Verdict:
    """The job recomputes because its cards are near capacity (the seeds' memory wall): the
    recompute is charged to memory (``charged_share`` of the step). The rule decides only where
    that makes memory the highest score; otherwise the larger wall stands and the note says so."""
    v = decide(shares, thresholds)
    if v.wall == "memory":
        return replace(v, rule="memory-bound", rule_note=(
            f"memory-bound: full recompute with the card near capacity costs {100 * charged_share:.0f}% of the "
            "step, charged to memory"))
    return replace(v, rule_note=(
        f"memory-bound (recompute near capacity, {100 * charged_share:.0f}% of the step charged to memory) but "
        f"memory scores {v.scores['memory']:.2f} below {v.wall} {v.scores[v.wall]:.2f}: the larger wall stands"))


def straggler_wall(j: int, per_gpu_ns: list[dict[str, int]], iterations: list[int]) -> tuple[str, float]:
    """Why rank j is late: the non-communication wall it spends most *more* time in than the
    median of its peers (ns per step). Returns (wall, excess_ns_per_step)."""
    import numpy as np

    mine = {w: per_gpu_ns[j][w] / max(iterations[j], 1) for w in WALLS}
    others = [k for k in range(len(per_gpu_ns)) if k != j]
    excess = {w: mine[w] - float(np.median([per_gpu_ns[k][w] / max(iterations[k], 1) for k in others]))
              for w in ("compute", "host", "memory")}
    wall = max(excess, key=excess.get)
    return wall, excess[wall]


def decide_with_straggler(shares: dict[str, float], thresholds: dict[str, float], wall: str,
                          blame_share: float, rank=None, waited_ms: float = 0.0) -> Verdict:
    """A straggler's lateness: the waiting it causes is already counted in its ``wall``
    (``gpu_step_walls``). The rule decides only where that makes its wall the highest score (its
    evidence is larger than what it would override); otherwise the larger wall stands.
    ``straggler_blame_share`` is how much of the delay that rank causes."""
    v = replace(decide(shares, thresholds), straggler_blame_share=round(float(blame_share), 3))
    if v.wall == wall:
        return replace(v, rule="straggler", rule_note=(
            f"straggler: the others wait {waited_ms:.1f} ms/step for rank {rank}, counted in its {wall} wall"))
    return replace(v, rule_note=(
        f"rank {rank} is a straggler ({wall}; the others wait {waited_ms:.1f} ms/step, counted in {wall}) but "
        f"{wall} scores {v.scores[wall]:.2f} below {v.wall} {v.scores[v.wall]:.2f}: the larger wall stands"))


def gpu_step_walls(per_gpu_ns: list[dict[str, int]], iterations: list[int], exposed_wait_ns: list[int],
                   straggler_gpus: list[int], target: str | None) -> list[dict[str, float]]:
    """Each GPU's ns per step per wall, with its waiting for the straggler moved to the
    straggler's wall (the job's walls are their mean)."""
    per_step = []
    for j, walls in enumerate(per_gpu_ns):
        w = {k: v / max(iterations[j], 1) for k, v in walls.items()}
        if target and j not in straggler_gpus:
            moved = min(exposed_wait_ns[j] / max(iterations[j], 1), w["communication"])
            w["communication"] -= moved
            w[target] += moved
        per_step.append(w)
    return per_step


def unseen_peers_reading(per_step: list[dict[str, float]], iterations: list[int], unseen_wait_ns: list[int],
                         thresholds: dict[str, float]) -> Verdict | None:
    """The verdict with each GPU's waiting for ranks not in the profile (estimated,
    ``matching._lone_waits``) taken out of its communication and its step; None when
    there is no such waiting."""
    per_gpu = [u / max(i, 1) for u, i in zip(unseen_wait_ns, iterations)]
    if not any(per_gpu):
        return None
    walls = job_walls([dict(w, communication=max(w["communication"] - u, 0.0)) for w, u in zip(per_step, per_gpu)])
    step = sum(walls.values())
    return decide({w: v / step if step else 0.0 for w, v in walls.items()}, thresholds)


def job_walls(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Job-level ns per step per wall: the mean over GPUs of ``gpu_step_walls``."""
    import numpy as np

    return {k: float(np.mean([w[k] for w in per_step])) for k in WALLS}


def confidence(wall: str, shares: dict[str, float], thresholds: dict[str, float],
               gpu_shares: list[dict[str, float]], step_ns: list[list[int]], whole: bool,
               floor: float | None = None) -> tuple[float, dict]:
    """The probability that ``wall`` truly outscores the best other wall given how well the
    window measured the shares (``docs/classification.md``, "Confidence"), and its numbers.

    Score order is the sign of the margin ``m = s_wall - k * s_other`` (k = t_wall / t_other).
    Each share's error: ``SHARE_NOISE`` plus the step's relative spread over sqrt(steady steps);
    ranks that split the step differently add the spread of their own margins. With n steady
    steps the spread is itself estimated from n, so m / sigma is read on Student's t with n - 1
    degrees of freedom; one step (or the whole capture) measures no spread: at most 0.5.

    ``floor``: a verdict decided by a share crossing a floor rather than by outscoring the
    other walls (the memory-bound rule: the charged recompute is at least that share of the
    step) is as sure as that crossing: the margin is ``s_wall - floor``."""
    import numpy as np

    from .stats import t

    other = max((w for w in WALLS if w != wall), key=lambda w: shares[w] / thresholds[w])
    k = thresholds[wall] / thresholds[other] if floor is None else 0.0
    base = k * shares[other] if floor is None else floor
    margin = shares[wall] - base
    n = min((len(s) for s in step_ns), default=0)
    spread = step_spread(step_ns)
    per_gpu = np.array([g[wall] - (k * g[other] if floor is None else floor) for g in gpu_shares], float)
    rank_var = float(per_gpu.var(ddof=1)) if len(per_gpu) > 1 else 0.0
    sigma = sqrt((1 + k * k) * (SHARE_NOISE ** 2 + spread ** 2 / max(n, 1)) + rank_var)
    if n >= 2:
        p = 1.0 - t.sf(margin / sigma, n - 1)
    else:
        p = min(0.5 * (1 + erf(margin / (sigma * sqrt(2)))), WHOLE_CAPTURE_CAP)
    if whole:
        p = min(p, WHOLE_CAPTURE_CAP)
    return round(p, 3), dict(margin=round(margin, 4), uncertainty=round(sigma, 4), versus=other,
                             floor=floor, steady_iterations=n, step_spread=round(spread, 4),
                             whole_capture=whole)


def step_spread(step_ns: list[list[int]]) -> float:
    """Relative spread of the step: per-iteration (median over GPUs of std/mean, or
    ``UNMEASURED_SPREAD`` when a GPU has one step) combined with the spread of the GPUs' mean
    steps (one synchronous job should have one)."""
    import numpy as np

    steps = [np.asarray(s, float) for s in step_ns if len(s)]
    if not steps or min(len(s) for s in steps) < 2:
        per_iter = UNMEASURED_SPREAD
    else:
        per_iter = float(np.median([s.std(ddof=1) / s.mean() for s in steps]))
    means = np.array([s.mean() for s in steps]) if steps else np.zeros(1)
    across = float(means.std(ddof=1) / means.mean()) if len(means) > 1 and means.mean() > 0 else 0.0
    return sqrt(per_iter ** 2 + across ** 2)


# ---------------------------------------------------------------------------------------------
# the classify stage over the job: walls, verdict, confidence

def _charged_ms(records: list[GpuRecord]) -> float:
    """Recompute charged to memory, ms per step (mean over GPUs)."""
    import numpy as np

    from .analyzers.memory import charged_recompute

    return float(np.mean([sum(charged_recompute(r.analysis.memory).values()) / r.iterations
                          for r in records])) / 1e6


def memory_bound(records: list[GpuRecord], step_ns: float) -> bool:
    """The seeds' memory wall: the job recomputes because its cards are near capacity, and
    that recompute costs a measurable share of the step (``MEMORY_BOUND_MIN_SHARE``)."""
    return bool(step_ns) and _charged_ms(records) >= MEMORY_BOUND_MIN_SHARE * (step_ns / 1e6)


def classify_job(records: list[GpuRecord], ranks: tuple[RankComm, ...], unseen_wait_ns: tuple[int, ...],
                 blamed: list[dict], whole_window: bool) -> JobWalls:
    """Walls per GPU and for the job, the verdict and its confidence. ``ranks``: each GPU's
    waiting for its peers, ``unseen_wait_ns``: of it, the estimate for ranks outside the
    profile (the communication stage); ``blamed``: the stragglers' ranks (``stragglers.find``);
    ``whole_window``: the job's step is the whole capture (``iterations.window_source``)."""
    import numpy as np

    thresholds = load_thresholds()
    per_gpu_ns = [gpu_walls(r.analysis) for r in records]
    its = [r.iterations for r in records]
    late_walls = tuple(straggler_wall(s["gpu"], per_gpu_ns, its) for s in blamed)
    late_wall = late_walls[0][0] if blamed else None
    step_walls = gpu_step_walls(per_gpu_ns, its, [c.exposed_wait_ns for c in ranks], [s["gpu"] for s in blamed],
                                late_wall)
    job_ns = job_walls(step_walls)
    step_ns = float(np.mean([r.analysis.window.window_ns / r.iterations for r in records]))
    shares = {w: (v / step_ns if step_ns else 0.0) for w, v in job_ns.items()}
    bound = memory_bound(records, step_ns)
    verdict = _verdict(shares, thresholds, late_wall, [dict(b, rank=records[b["gpu"]].gpu.rank) for b in blamed],
                       bound and not late_wall, _charged_ms(records) / (step_ns / 1e6) if step_ns else 0.0)
    gpu_shares = [{w: v / max(sum(g.values()), 1) for w, v in g.items()} for g in step_walls]
    conf, basis = confidence(verdict.wall, shares, thresholds, gpu_shares,
                             [r.analysis.window.step_ns for r in records], whole_window)
    verdict = replace(verdict, confidence=conf, confidence_basis=basis)
    # (a memory-bound verdict stands: taking waiting out of the step only raises the recompute's share)
    unseen = unseen_peers_reading(step_walls, its, unseen_wait_ns, thresholds) \
        if not late_wall and verdict.rule != "memory-bound" else None
    unseen_reading = None
    if unseen is not None and unseen.wall != verdict.wall:
        # one rank of a bigger job: its collective time is transfer or waiting for unseen peers
        verdict = replace(verdict, confidence=min(verdict.confidence, UNSEEN_PEERS_CAP), runner_up=unseen.wall)
        unseen_reading = unseen.wall
    return JobWalls(gpu_ns=tuple(per_gpu_ns), job_ns=job_ns, step_ns=step_ns, shares=shares, verdict=verdict,
                    late_walls=late_walls, memory_bound=bound, unseen_reading=unseen_reading)


def _verdict(shares: dict[str, float], thresholds: dict[str, float], late_wall: str | None, blamed: list[dict],
             memory_bound_rule: bool, charged_share: float) -> Verdict:
    """The verdict: the largest score, named after the rule (straggler, memory-bound) whose
    evidence made it so (``decide_with_straggler``, ``decide_memory_bound``)."""
    if late_wall:
        return decide_with_straggler(shares, thresholds, late_wall, blamed[0]["blame_share"], blamed[0]["rank"],
                                     blamed[0]["others_wait_ms_per_step"])
    if memory_bound_rule:
        return decide_memory_bound(shares, thresholds, charged_share)
    return decide(shares, thresholds)


def walls_section(walls: JobWalls, collectives: list[dict]) -> dict:
    """The Diagnosis ``walls``: each wall's share and ms per step; communication's split by
    group from the matched ``collectives`` rows (exposed transfer and waiting)."""
    out = {w: {"share": round(walls.shares[w], 4), "ms_per_step": round(walls.job_ns[w] / 1e6, 3)} for w in WALLS}
    by_group: dict[str, float] = {}
    for c in collectives:
        by_group[c["group"]] = (by_group.get(c["group"], 0.0) + c["exposed_transfer_ms_per_step"]
                                + c["exposed_wait_ms_per_step"])
    out["communication"]["by_group"] = {g: round(v, 3) for g, v in sorted(by_group.items())}
    return out


def verdict_section(walls: JobWalls, stragglers: list[dict]) -> dict:
    """The Diagnosis ``verdict``: the wall, its confidence and runner-up, a one-line summary."""
    v = walls.verdict
    return dict(wall=v.wall, confidence=v.confidence, runner_up=v.runner_up,
                summary=_summary(v, walls.shares, walls.job_ns, stragglers), scores=v.scores,
                confidence_basis=v.confidence_basis, straggler_blame_share=v.straggler_blame_share, rule=v.rule,
                rule_note=v.rule_note)


def _summary(verdict: Verdict, shares: dict[str, float], job_ns: dict[str, float], stragglers: list[dict]) -> str:
    w = verdict.wall
    s = (f"{w} wall: {100 * shares[w]:.0f}% of the steady-state step ({job_ns[w] / 1e6:.1f} ms/step); "
         f"runner-up {verdict.runner_up} ({100 * shares[verdict.runner_up]:.0f}%)")
    if stragglers:
        st = stragglers[0]
        s += (f"; rank {st['rank']} is the straggler ({st['reason']}), costing the others "
              f"{st['others_wait_ms_per_step']:.1f} ms/step of waiting")
    r = verdict.runner_up
    if verdict.rule == "scores" and shares[r] > shares[w]:  # the larger share is not the verdict: say why
        t = load_thresholds()
        s += (f"; {r} takes more of the step, but each wall is scored as its share over its own threshold "
              f"(data/calibration.toml: {w} {t[w]:.2f}, {r} {t[r]:.2f}), {w} {verdict.scores[w]:.2f} "
              f"against {r} {verdict.scores[r]:.2f}")
    if verdict.rule_note:  # which rule decided, or why one that found its evidence did not
        s += f". Rule: {verdict.rule_note}"
    return s + "."


def device_rows(records: list[GpuRecord], walls: JobWalls, ranks: tuple[RankComm, ...],
                features: list[dict]) -> list[dict]:
    """The Diagnosis ``devices``: each GPU's own walls, verdict, window and results
    (``features``: each GPU's flat analyzer results)."""
    from dataclasses import asdict

    thresholds = load_thresholds()
    devices = []
    for r, walls_ns, rank_comm, feats in zip(records, walls.gpu_ns, ranks, features):
        g, window_ns = r.gpu, r.analysis.window.window_ns
        w_share = {w: v / max(window_ns, 1) for w, v in walls_ns.items()}
        devices.append(dict(
            pid=g.pid, device=g.device, rank=g.rank, file=g.path, wall=decide(w_share, thresholds).wall,
            walls={w: {"share": round(w_share[w], 4), "ms_per_step": round(walls_ns[w] / r.iterations / 1e6, 3)}
                   for w in WALLS},
            window_source=g.window_source, iterations=r.analysis.window.iterations,
            step_ms=round(window_ns / r.iterations / 1e6, 3),
            comm=asdict(rank_comm) if len(records) > 1 else None,
            features={k: (round(v, 4) if isinstance(v, float) else v) for k, v in feats.items()}))
    devices.sort(key=lambda dv: (dv["rank"] is None, dv["rank"], dv["pid"]))
    return devices
