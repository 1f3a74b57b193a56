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
which it spends more than its peers), the job's walls are the mean over GPUs, and the
verdict is the straggler's wall with communication as runner-up (the job is as slow as its
slowest rank).

Verdict: each wall's share is divided by its calibrated threshold (``data/calibration.toml``,
fitted on the labelled corpus by ``bench/calibrate.py``); the largest score wins, the second
is the runner-up and ``confidence = s1 / (s1 + s2)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .tables import read_table

if TYPE_CHECKING:
    from .analyzers import GpuAnalysis

WALLS = ("compute", "communication", "host", "memory")


def load_thresholds() -> dict[str, float]:
    return {w: float(v) for w, v in read_table("calibration")["thresholds"].items()}


@dataclass
class Verdict:
    wall: str
    runner_up: str
    confidence: float
    scores: dict[str, float]


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
    s1, s2 = scores[ranked[0]], scores[ranked[1]]
    conf = s1 / (s1 + s2) if (s1 + s2) > 0 else 0.0
    return Verdict(wall=ranked[0], runner_up=ranked[1], confidence=round(conf, 3),
                   scores={w: round(v, 3) for w, v in scores.items()})


def decide_memory_bound(shares: dict[str, float], thresholds: dict[str, float]) -> Verdict:
    """The job fits only by recomputing (full recompute with the card near capacity: the seeds'
    memory wall): memory wins whatever the shares, the runner-up is the best other wall and
    confidence compares the two scores as ``decide`` does (below 0.5 when the other is larger)."""
    base = decide(shares, thresholds)
    runner = max((w for w in WALLS if w != "memory"), key=lambda w: base.scores[w])
    s1, s2 = base.scores["memory"], base.scores[runner]
    return Verdict(wall="memory", runner_up=runner, confidence=round(s1 / (s1 + s2), 3) if s1 + s2 else 0.0,
                   scores=base.scores)


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
                          blame_share: float) -> Verdict:
    """The job is as slow as its straggler: its wall wins, communication (the waiting) is the
    runner-up; confidence is how much of the delay that rank causes."""
    base = decide(shares, thresholds)
    return Verdict(wall=wall, runner_up="communication" if wall != "communication" else base.runner_up,
                   confidence=round(float(blame_share), 3), scores=base.scores)


def job_walls(per_gpu_ns: list[dict[str, int]], iterations: list[int], exposed_wait_ns: list[int],
              straggler_gpus: list[int], target: str | None) -> dict[str, float]:
    """Job-level ns per step per wall, with waiting moved to the straggler's wall."""
    import numpy as np

    per_step = []
    for j, walls in enumerate(per_gpu_ns):
        w = {k: v / max(iterations[j], 1) for k, v in walls.items()}
        if target and j not in straggler_gpus:
            moved = min(exposed_wait_ns[j] / max(iterations[j], 1), w["communication"])
            w["communication"] -= moved
            w[target] += moved
        per_step.append(w)
    return {k: float(np.mean([w[k] for w in per_step])) for k in WALLS}
