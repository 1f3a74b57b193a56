"""Analyzer: communication. Per GPU, how much communication compute hides (by collective and
library); over the job, from the collectives matched across ranks (``matching``, the
communication stage): exposed transfer and waiting per group, the gain models of the
communication fixes.
"""
from __future__ import annotations

import numpy as np

from .. import intervals as iv
from ..kernels import COLLECTIVE_TYPES, collective_name
from ..timeline import GpuTimeline
from . import layout
from .gainmodel import Gain, gain, share_of
from .job import Job, evidence_row, mean_per_step_ms
from .matching import DP_COLLECTIVES, EP_COLLECTIVES
from .pipeline_gains import PP_GAINS, pipelined
from .protocol import Analyzer
from .results import CommResult
from .sets import WindowSets, clipped_set

# exposed DP / TP / EP collectives above this share of the step are worth a fix
DP_EXPOSED_MIN = 0.02
# the share of the DP gradient reductions' time beside compute that tells them issued under the
# backward: without --overlap-grad-reduce Megatron's DDP reduces after the whole backward, with
# nothing computing beside it (0.00 on every such corpus capture); with it every bucket but the last
# is issued under the backward (0.20-0.88 on the four overlapped captures). The same share of the
# distributed optimizer's parameter all-gathers tells them under the next forward.
DP_OVERLAP_SEEN = 0.1
DP_REDUCTIONS, DP_GROUPS = ("all_reduce", "reduce_scatter"), ("DP", "EDP")


def param_gathers_in(collectives, groups, in_groups=DP_GROUPS) -> bool:
    """Whether a GPU's all-gathers in ``in_groups`` are the distributed optimizer's parameter
    gathers: they come with its gradient reduce-scatters in those groups. Without them a DP
    group's all-gathers are others' (the MoE dispatcher's token counts, where EP = DP). Array-like
    ``collectives`` and ``groups``, one entry per collective (a report row or an op)."""
    return bool(((np.asarray(collectives) == "reduce_scatter") & np.isin(groups, in_groups)).any())


COMM_WAIT_MIN = 0.05  # waiting for peers above this share of the step, with no straggler


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> CommResult:
    compute, comm_set, comm = sets.compute, sets.comm, sets.comm_ops
    r = CommResult(comm_ns=iv.total(comm_set), overlapped_comm_ns=iv.total(iv.intersect(comm_set, compute)))
    r.exposed_comm_ns = r.comm_ns - r.overlapped_comm_ns
    for ctype in COLLECTIVE_TYPES:
        sub = comm[comm["collective"] == ctype]
        if sub.empty:
            continue
        of_type = clipped_set(sub, sets.lo, sets.hi)
        r.comm_by_type_ns[ctype] = iv.total(of_type)
        r.exposed_comm_by_type_ns[ctype] = iv.total(iv.subtract(of_type, compute))
    r.comm_libraries = {str(k): int(v) for k, v in comm.groupby("library", observed=True).size().items()}
    return r


def missing(job: Job, numbers: dict) -> list[str]:
    """The waiting a lone rank's collectives hold for ranks outside the profile (estimated)."""
    if not any(job.comm.unseen_exposed_wait_ns):
        return []
    per_step = float(np.mean([u / max(r.iterations, 1) for u, r in
                              zip(job.comm.unseen_exposed_wait_ns, job.records)])) / 1e6
    share = per_step / job.step_ms if job.step_ms else 0.0
    out = (f"ranks outside the profile: {per_step:.1f} ms/step ({100 * share:.0f}% of the step) of exposed "
           "collective time is taken as waiting for them, estimated from the profiled ranks' own kernel times "
           "(docs/comm.md); what made them late is not in this capture")
    if job.walls.unseen_reading:
        out += f"; without that waiting the verdict would be {job.walls.unseen_reading} (confidence at most 0.5)"
    return [out]


# ---------------------------------------------------------------------------------------------
# job level

# gain models (ms per step) from the job numbers; each constant's basis is in docs/fixes.md
BACKWARD_SHARE = 2.0 / 3.0  # backward ~ 2x the forward's FLOPs: 2/3 of a step's compute
NCCL_LAUNCH_MS = 0.02  # one collective's launch and proxy set-up (nccl-tests small-message latency)
NCCL_SM_SHARE = 32 / 132  # NCCL's default 32 channels (one SM each) of an H100/H200's 132 SMs
# a slow path's bandwidth over NVLink's: PCIe Gen5 x16 through host memory (~50 GB/s achieved,
# or an InfiniBand NDR port, 50 GB/s) vs H100/H200 NVLink 4 (450 GB/s per direction)
SLOW_OVER_NVLINK = 50.0 / 450.0
DP_GATHER_BUCKETS = 8  # dp_overlap_param_gather's share model: the overlap transform's best bucket count


def _dp_overlap(n: dict) -> Gain:
    """Each layer's gradients reduce while the layers after them in backward compute: the
    reductions start once the first layer's backward is done (B/L) and the last-ready layer's
    (T/L) runs after backward, so exposed = max(T - B(L-1)/L, T/L) (L layers; unknown: no tail)."""
    t, backward, layers = n["exposed_dp_transfer_ms"], BACKWARD_SHARE * n["compute_ms"], n["num_layers"]
    tail, under = (t / layers, backward * (layers - 1) / layers) if layers else (0.0, backward)
    hideable = min(t - tail, under)
    est = hideable - n["dp_reductions_per_step"] * NCCL_LAUNCH_MS
    # range: overlap can cost (NCCL's SMs are taken from the backward it runs under), and the
    # reduction is a job-wide sync point, so overlap can also free rank skew paid in waits
    return gain("dp_overlap", est, -NCCL_SM_SHARE * hideable, n["exposed_dp_ms"] + n["comm_wait_ms"],
                n["exposed_dp_ms"],
                f"exposed DP transfer {t:.1f} less the last layer's {tail:.1f}, hideable under the backward "
                f"compute after the first layer's {under:.1f} ms/step, minus "
                f"{n['dp_reductions_per_step']:.0f} launches x {NCCL_LAUNCH_MS} ms")


def _fabric(n: dict) -> Gain:
    t = n["exposed_ep_ms"] + n["exposed_dp_transfer_ms"]
    if not n["slow_fabric"]:
        return gain("fabric_ratio", 0.0, 0.0, n["exposed_ep_ms"], n["exposed_ep_ms"],
                    "no slow path in evidence (NCCL_P2P_DISABLE not set): the traffic already takes NVLink")
    # the transfer falls to the bandwidth ratio; the step banks the share the hosts' waits allow
    # (low 0: in a host-bound step a faster transfer only lengthens the wait for the next launch)
    f = n.get("fabric_bankable", 1.0)
    return gain("fabric_ratio", t * (1 - SLOW_OVER_NVLINK) * f, 0.0, t, t,
                f"exposed transfer {t:.1f} ms/step x (1 - {SLOW_OVER_NVLINK:.2f} slow/NVLink bandwidth)"
                f" x {f:.2f} (the share the hosts' waits for the GPU let the step bank)")


def _dp_gather(n: dict) -> Gain:
    """The parameter all-gather bucketed under the next forward: all but the first of B buckets
    hide (B = DP_GATHER_BUCKETS, the transform's best), none at the low end (a forward too short
    to hide them), all at the high."""
    t = n["exposed_dp_gather_ms"]
    return share_of("dp_param_gather", t, 1 - 1 / DP_GATHER_BUCKETS, 0.0, 1.0,
                    "exposed parameter all-gather transfer")


GAINS = {
    # no measured DeepEP/NCCL ratio yet: the midpoint of [0, exposed all-to-all transfer]
    "exposed_ep_transfer": lambda n: share_of("exposed_ep_transfer", n["exposed_ep_ms"], 0.5, 0.0, 1.0,
                                              "exposed all-to-all transfer"),
    # EP overlap hides the all-to-all behind the other micro-batch's compute: the smaller of the two
    "ep_overlap": lambda n: share_of("ep_overlap", min(n["exposed_ep_ms"], n["compute_ms"]), 1.0, 0.5, 1.0,
                                     "exposed all-to-all transfer hideable under compute"),
    "dp_overlap": _dp_overlap,
    "dp_param_gather": _dp_gather,
    "exposed_tp": lambda n: None if n.get("exposed_tp_ms") is None else share_of(
        "exposed_tp", n["exposed_tp_ms"], 1.0, 0.5, 1.0, "exposed TP collectives"),
    # arrivals evened to the mean save the mean wait; jitter may not be removable (low 0)
    "rank_skew": lambda n: share_of("rank_skew", n["comm_wait_ms"], 1.0, 0.0, 1.0, "mean wait for peers"),
    "fabric_ratio": _fabric,
    **PP_GAINS,
}

def exposed_ms(job: Job, types: tuple[str, ...], transfer_only: bool) -> float:
    """Exposed time of these collectives, ms per step (transfer only: without peer waiting).

    Exposed time is the per-GPU half's (collective time compute does not hide); the matched
    half only says how much of it was waiting for peers (none for a lone rank, or one whose
    collectives matched none of its peers').
    """
    vals = []
    for rec, rank_comm in zip(job.records, job.comm.ranks):
        exposed = rec.analysis.communication.exposed_comm_by_type_ns
        v = sum(exposed.get(t, 0) for t in types)
        if transfer_only:
            v -= sum(rank_comm.by_type.get(t, {}).get("exposed_wait_ns", 0) for t in types)
        vals.append(max(v, 0) / rec.iterations)
    return float(np.mean(vals)) / 1e6 if vals else 0.0


def group_share(job: Job, groups: tuple[str, ...], types: tuple[str, ...]) -> float:
    """The share of these collectives' exposed time (matched rows) that belongs to ``groups``:
    per-type exposed time is measured per GPU, its group split from the ``collectives`` rows."""
    rows = [c for c in job.comm.collectives if c["collective"] in types]
    total = sum(c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"] for c in rows)
    if not total:
        return 1.0 if any(c["group"] in groups for c in rows) else 0.0
    return sum(c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"]
               for c in rows if c["group"] in groups) / total


def beside_compute(collectives: list[dict], types: tuple[str, ...]) -> float | None:
    """The share of these DP/EDP collectives' time (transfer and wait, the matched ``collectives``
    rows) that compute ran beside; None without any."""
    rows = [c for c in collectives if c["collective"] in types and c["group"] in DP_GROUPS]
    total = sum(c["transfer_ms_per_step"] + c["wait_ms_per_step"] for c in rows)
    return sum(c["overlapped_ms_per_step"] for c in rows) / total if total > 0 else None


def _exposed_transfer(job: Job, ctype: str, groups: tuple[str, ...]) -> float:
    """The exposed transfer (waiting left out) of one collective type in these groups, ms per step."""
    return sum(c["exposed_transfer_ms_per_step"] for c in job.comm.collectives
               if c["collective"] == ctype and c["group"] in groups)


def numbers(job: Job) -> dict:
    comm_wait_ms = float(np.mean([c.exposed_wait_ns / r.iterations for c, r in zip(job.comm.ranks, job.records)])) / 1e6
    tp_types = DP_COLLECTIVES + ("broadcast", "reduce")
    dp_share = group_share(job, ("DP", "EDP"), DP_COLLECTIVES)
    dp_calls = sum(c["instances"] for c in job.comm.collectives
                   if c["collective"] in DP_COLLECTIVES and c["group"] in ("DP", "EDP"))
    slow = str(job.cfg.get("NCCL_P2P_DISABLE", {}).get("value", "")) == "1"
    flags = job.flags
    layers = next((int(flags[f]) for f in ("--num-layers", "--layers") if str(flags.get(f, "")).isdigit()), None)
    ep_share = group_share(job, ("EP",), EP_COLLECTIVES)
    exposed_a2a, exposed_a2a_transfer = exposed_ms(job, EP_COLLECTIVES, False), exposed_ms(job, EP_COLLECTIVES, True)
    # PP send/recv is an all-to-all type too, with no waiting of its own (never matched): the
    # EP share of the exposed time, less all of the type's waiting (EP's), is EP's transfer
    exposed_ep = (exposed_a2a_transfer if ep_share == 1.0 else
                  max(exposed_a2a * ep_share - (exposed_a2a - exposed_a2a_transfer), 0.0))
    return dict(comm_wait_ms=comm_wait_ms,
                exposed_ep_ms=exposed_ep,
                # the ranks' wait for their EP peers inside the dispatcher's collectives
                ep_wait_ms=max(exposed_a2a * ep_share - exposed_ep, 0.0),
                ep_work_imbalance_ms=job.comm.ep_work_imbalance_ms,
                exposed_dp_ms=exposed_ms(job, DP_COLLECTIVES, False) * dp_share,
                exposed_dp_transfer_ms=exposed_ms(job, DP_COLLECTIVES, True) * dp_share,
                exposed_tp_ms=exposed_ms(job, tp_types, False) * group_share(job, ("TP", "ETP"), tp_types),
                dp_reductions_per_step=dp_calls / float(np.median([r.iterations for r in job.records])),
                # the distributed optimizer's parameter all-gather (with its reduce-scatters): its
                # transfer (the MoE dispatcher's token-count gathers, in the DP group where EP = DP,
                # are waits with next to no transfer)
                exposed_dp_gather_ms=_exposed_transfer(job, "all_gather", DP_GROUPS) if param_gathers_in(
                    [c["collective"] for c in job.comm.collectives], [c["group"] for c in job.comm.collectives])
                else 0.0,
                dp_reductions_beside_compute=beside_compute(job.comm.collectives, DP_REDUCTIONS),
                slow_fabric=slow, num_layers=layers, fabric_bankable=fabric_bankable(job))


def fabric_bankable(job: Job) -> float:
    """The share of a faster fabric's saving the hosts let the step bank. Between two host
    waits for the GPU (``idle.host_waits``) the GPU's queue was filled by a host that then sat
    waiting: a saving in that segment lets the host's next work start earlier by at most the
    time it waited; beyond that the GPU just idles until the host catches up. Each EP and DP
    collective's exposed transfer counts in the segment of the first wait ending after it; those
    after the window's last wait (no sign of the host pacing them) count whole. Sum over GPUs
    of what is banked over the sum of the savings (1 where nothing is known)."""
    banked = total = 0.0
    for rec, (ends, saved) in zip(job.records, job.comm.fabric_transfers):
        wait_start, wait_end = getattr(rec.gpu, "host_waits", (np.zeros(0), np.zeros(0)))
        if not len(saved):
            continue
        seg = np.searchsorted(wait_end, ends)  # a collective ending by wait j's end is in segment j
        by_seg = np.bincount(seg, weights=saved.astype(float), minlength=len(wait_end) + 1)
        banked += float(np.minimum(by_seg[:-1], wait_end - wait_start).sum() + by_seg[-1])
        total += float(saved.sum())
    return banked / total if total else 1.0


def facts(job: Job, numbers: dict) -> dict:
    # the reductions issued under the backward already, seen on the timeline where no flag says so
    overlapped = (numbers["dp_reductions_beside_compute"] or 0.0) >= DP_OVERLAP_SEEN
    return dict(
        dp_comm_exposed=numbers["exposed_dp_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        dp_reductions_overlapped=overlapped,
        # the parameter all-gather exposed where the reductions are overlapped already (by flag, or
        # seen beside the backward): dp_overlap_grad_reduce moves both where they are not
        dp_gather_exposed=bool(numbers["exposed_dp_gather_ms"] >= DP_EXPOSED_MIN * job.step_ms
                               and ("--overlap-grad-reduce" in job.flags or overlapped)),
        comm_wait_dominant=bool(not job.stragglers and numbers["comm_wait_ms"] > numbers["exposed_ep_ms"]
                                and numbers["comm_wait_ms"] >= COMM_WAIT_MIN * job.step_ms),
        tp_comm_exposed=numbers["exposed_tp_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        # EP fixes need expert parallelism and all-to-all time that compute does not hide
        ep_comm_exposed=numbers["exposed_ep_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        tp_within_node=layout.tp_within_node(job.layout) if getattr(job, "layout", None) else False,
        pp_bubble_known=pipelined(numbers))


def evidence(job: Job, numbers: dict) -> list[dict]:
    ev = [evidence_row("communication", "exposed communication",
                       mean_per_step_ms(job, lambda a: a.communication.exposed_comm_ns), "ms/step",
                       "communication not overlapped by compute"),
          evidence_row("communication", "overlapped communication",
                       mean_per_step_ms(job, lambda a: a.communication.overlapped_comm_ns), "ms/step",
                       "communication hidden under compute")]
    for c in job.comm.collectives:
        ev.append(evidence_row("communication", f"{collective_name(c['collective'], c['group'])} exposed transfer",
                               c["exposed_transfer_ms_per_step"], "ms/step",
                               f"{c['group']} group; wait {c['exposed_wait_ms_per_step']} ms/step"))
    return ev


ANALYZER = Analyzer(name="communication", about="communication compute does not hide; collectives matched "
                    "across ranks: transfer vs waiting per group", per_gpu_field="communication",
                    analyse=analyse, numbers=numbers, facts=facts, evidence=evidence, missing=missing,
                    section="collectives", report=lambda job, numbers: job.comm.collectives, gains=GAINS)
