"""Pipeline-schedule replay: Megatron-Core's 1F1B and interleaved schedules simulated from each
stage's measured per-micro-batch work, prices the pipeline fixes (more micro-batches, VPP, stage
balance) that the graph replay cannot: a schedule change changes the graph itself.

The op order is Megatron-Core's (megatron/core/pipeline_parallel/schedules.py, 0.19):
``forward_backward_pipelining_without_interleaving`` runs min(p - r - 1, m) warm-up forwards on
stage r, then one forward and one backward per step, then the remaining backwards;
``forward_backward_pipelining_with_interleaving`` runs (p - r - 1) * 2 + (v - 1) * g warm-up
chunk-forwards (g = microbatch_group_size_per_vp_stage, p by default; capped at m v), the
chunks of a micro-batch group in ``get_schedule_table``'s order, backwards in the same order
with the chunk reversed.

What the simulation takes from the capture is measured in ``schedule_inputs`` (``Stages``).

A chunk's forward computes F / v, its backward B / v, F + B = U less the base's own calls (so
the base's own work is kept whatever x is), B = ``FB_RATIO`` F (backward ~2x a forward's FLOPs;
a recomputed forward is inside the backward). The stages run Megatron's P2P calls between them,
each waiting for the peers Megatron's calls wait for (``p2p_calls`` runs ``pp_program``'s
programs). After its last item a stage runs its rest (with a PP all-reduce: the part before it,
then waits for every stage to get there, then the part after it) and starts the next step.
``STEPS`` steps run back to back; the step is the start-to-start time of the last two (a stage's
rest can run beside another stage's last slots, which one step's makespan plus the rest would
not see).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..analyzers.pp_program import BATCHED, OVERLAPPED, calls_per_microbatch
from .p2p_calls import simulate  # the schedule, call by call
from .schedule_inputs import FB_RATIO, Stages, measure
from .trace import GpuTrace

# overlapped P2P's NCCL kernels run beside the compute they were posted ahead of and share its
# SMs: a stage's busy time grows by this share at the (low, best, high) gain points. A posted
# kernel takes SMs for as long as it waits for its peer, so it is the stages that wait for
# another that slow; the busiest stage, the one the others wait for, finds its tensors already
# sent. Measured on six twin traced captures (batched and overlapped, one job each; docs/replay.md):
# the other stages' busy time +0.45 to +4.6% (mean 3.0), the busiest stage's -1.3 to +0.7% (mean -0.5)
OVERLAP_SLOWDOWN = (0.046, 0.030, 0.0045)
OVERLAP_SLOWDOWN_BUSIEST = (0.007, -0.005, -0.013)


STEPS = 3  # steps simulated back to back: the last one's start-to-start is the steady step


def periodic_step(p: int, v: int, m: int, f_comp, b_comp, x: float, pre, post, meet: bool,
                  group: int | None = None, steps: int = STEPS, floor: float = 0.0, mode: str = BATCHED) -> float:
    """The steady step: ``steps`` steps back to back (``simulate``), the mean over stages of
    the start-to-start time of the last two steps' first slots."""
    first = simulate(p, v, m, f_comp, b_comp, x, floor, mode, group, pre, post, meet, steps).first
    return float(np.mean(first[:, -1] - first[:, -2]))


def step_ns(st: Stages, v: int, m: int, x: float, work=None, p2p: str | None = None, slowdown: float = 0.0) -> float:
    """The simulated step at (v, m) with exchange cost ``x``, the exchanges run as ``p2p``
    (default: as captured; 1F1B's are batched). A batched call ends in a device sync
    (``batch_p2p_sync``) and costs ``x``, the transfer's floor and the host's gap to the next
    kernel, plus the rest of the idle the host's refill leaves after it (``sync_refill``: as
    measured after the base's syncs, whatever a chunk's share of the layers; the base's own
    refill comes out of U with its calls). An
    overlapped schedule syncs nothing: its calls cost the GPU the transfer's floor, and the
    refill idle a host ahead would not leave (``sync_idle``, once: the gap after each call is in it
    and goes with ``x``) leaves the stages' time, and its posted kernels slow the compute beside
    them (``slowdown``, per stage or one for all, of the busy time: ``overlap_slowdown``). The base's own
    calls come out of U first (a stage's work per micro-batch is measured with them)."""
    floor = min(st.floor, x)
    calls = np.array([calls_per_microbatch(st.p, st.v, st.m, s, st.p2p) for s in range(st.p)])
    mode = BATCHED if v == 1 else (p2p or st.p2p)
    base_refill = sync_refill(st, calls)  # the captured calls' refill, per call
    refill = base_refill if mode == BATCHED else 0.0
    own = x + refill if st.p2p == BATCHED or st.v == 1 else floor
    st = st if work is None else replace(st, work=work)
    shared = 0.0
    if mode == OVERLAPPED and st.p2p == BATCHED:
        shared = slowdown * (st.busy if st.busy is not None else st.work)  # the SMs the posted kernels take
        if st.sync_idle is not None:  # the refill idle beyond the gap ``x`` holds goes, from work and rest by their time
            st = less_host(st, base_refill * calls * st.m)
    f = (np.clip(st.work - calls * own, 0, None) + shared) / (1 + FB_RATIO)
    pre = st.rest_before_meet if st.rest_before_meet is not None else np.zeros(st.p)
    cost = x + refill if mode == BATCHED else np.full(st.p, floor)
    # the collectors' pauses stall the coupled stages one after another; a collector runs after
    # so many allocations, so its pauses come with the micro-batches' work, not once a step
    return periodic_step(st.p, v, m, f / v, FB_RATIO * f / v, cost, pre, st.rest - pre, st.meet,
                         floor=floor, mode=mode) + st.pause * m / st.m


def sync_refill(st: Stages, calls: np.ndarray) -> np.ndarray:
    """Per stage, ns per batched call: the GPU idle its device sync leaves beyond the host's gap
    to the next kernel that ``x`` already counts (the stage's measured sync idle over its calls;
    a chunk of fewer layers pays it whole: call V, docs/notes.md)."""
    if st.sync_idle is None or not len(st.gaps):
        return np.zeros(st.p)
    return np.clip(st.sync_idle / np.maximum(calls * st.m, 1) - float(np.median(st.gaps)), 0, None)


def exchange_cost(st: Stages, q: float) -> float:
    return st.floor + (float(np.quantile(st.gaps, q)) if len(st.gaps) else 0.0)


KIND = "pp_schedule"  # the transform kind of data/fixes.toml that this module prices
CHANGE_KEYS = ("vpp", "microbatches", "p2p", "balance")  # the schedule changes a pp_schedule spec can hold together
POINTS = ("low", "best", "high")


def takes(spec: dict) -> set:
    """The keys of a requested change a fix's transform takes: its own, and on a schedule change
    every schedule size (a pair that doubled the micro-batches and interleaved at once)."""
    return set(spec) | (set(CHANGE_KEYS) if spec.get("kind") == KIND else set())


def without_pipeline(spec: dict) -> dict | None:
    """A schedule change a job without a pipeline can make, as the graph transform that prices it
    (the spec's ``one_stage`` table): only more micro-batches of one size (no VPP, P2P or
    balance on one stage); None otherwise."""
    one = spec.get("one_stage")
    if spec.get("kind") != KIND or not one or any(spec.get(k) for k in ("vpp", "p2p", "balance")):
        return None
    return {**one, "microbatches": spec.get("microbatches", 2)}


def from_job(traces: list[GpuTrace], keyed: list[dict], ranks, pipeline, step_ns,
             pause_ns: list[float] | None = None) -> tuple[Stages | None, str]:
    """The job's schedule inputs from the replay's traces (``keyed``: each GPU's comm ops with
    their group, ``collectives._keyed``), the pipeline analyzer's result and each GPU's host
    pauses per step; (None, why) where the job is not pipelined or a size is unknown."""
    if pipeline is None or not pipeline.stages or pipeline.stages < 2:
        return None, ""
    if not pipeline.microbatches:
        return None, "the micro-batch count is unknown (no flag, not inferred from the timeline)"
    if pipeline.microbatches * (pipeline.virtual_stages or 1) < 2:  # F B, then the optimizer: one stretch
        return None, "one micro-batch a step (the first stage's work and rest are one stretch)"
    rows = {r["rank"]: r for r in (pipeline.per_stage or [])}
    if any(r not in rows for r in ranks):
        return None, "a GPU's pipeline stage is unknown"
    stage = [rows[r]["stage"] for r in ranks]
    if set(stage) != set(range(pipeline.stages)):
        return None, "not every pipeline stage is in the profile"
    # every PP-group op: send/recv, and the step's PP all-reduce (embedding, gradient norm) that
    # ends the schedule on every stage
    pp = [np.sort(kd["op"][kd["group"] == "PP"]) for kd in keyed]
    # the stages meet once a step where the PP group all-reduces (the gradient norm, embeddings)
    meets = [np.isin(p_ops, kd["op"][(kd["group"] == "PP") & (kd["collective"] == "all_reduce")])
             for p_ops, kd in zip(pp, keyed)]
    st = measure(traces, pp, stage, pipeline.stages, pipeline.virtual_stages or 1, pipeline.microbatches,
                 [(rows[r]["busy_ms"] + rows[r]["idle_ms"]) * 1e6 for r in ranks], list(step_ns),
                 meets if any(mt.any() for mt in meets) else None, pause_ns, pipeline.p2p or BATCHED,
                 [rows[r]["busy_ms"] * 1e6 for r in ranks])
    layers = [rows[r].get("layers") for r in ranks]
    per_stage = dict(zip(stage, layers))
    if st is not None and None not in layers and all(per_stage[s] == n for s, n in zip(stage, layers)):
        st = replace(st, layers=np.array([per_stage[s] for s in range(st.p)]))  # its ranks agree
    return st, "" if st is not None else "a stage has fewer than two PP exchanges in its window"


def _pick(param, point: str) -> float:
    return float(param[POINTS.index(point)]) if isinstance(param, (list, tuple)) else float(param)


def _sizes(specs: list[dict], st: Stages) -> tuple[int, float, np.ndarray | None, float]:
    """(v, m, work per stage or None, samples per step over the base's) after the schedule
    changes ``specs``; a larger micro-batch (``fewer_launches``) divides m and multiplies each
    micro-batch's work (its host saving is not in the simulation's inputs: the plan prices it
    on its own), the same samples per step."""
    v, m, samples, scale = st.v, float(st.m), 1.0, 1.0
    for spec in specs:
        if spec.get("kind") == "fewer_launches":
            k = float(spec.get("microbatch_factor", 2))
            m, scale = m / k, scale * k
            continue
        v, m = v * int(spec.get("vpp", 1)), m * int(spec.get("microbatches", 1))
        samples *= int(spec.get("microbatches", 1))
    balanced = any(spec.get("balance") for spec in specs)
    work = balanced_work(st) if balanced else st.work
    return v, m, (work * scale if balanced or scale != 1.0 else None), samples


def layer_split(st: Stages) -> tuple[np.ndarray, float] | None:
    """(layers per stage, a layer's busy time per micro-batch) of the whole-layer split with the
    lowest busiest stage that Megatron-Core allows (``num_layers_in_first/last_pipeline_stage``:
    end stages any count >= 1, the middle ones the rest evenly; a layer at the least busy time per
    layer of any stage; embedding, output layer and loss stay). None: no count, or no gain."""
    if st.layers is None or st.p < 2:
        return None
    per_layer = float(np.min((st.busy if st.busy is not None else st.work) / st.layers))
    total, mid = int(st.layers.sum()), st.p - 2
    first, last = np.meshgrid(np.arange(1, total), np.arange(1, total), indexing="ij")
    rest = total - first - last
    ok = (rest == 0) if mid == 0 else ((rest >= mid) & (rest % max(mid, 1) == 0))
    counts = np.column_stack([first[ok]] + [rest[ok] // max(mid, 1)] * mid + [last[ok]])
    if not len(counts):
        return None
    works = st.work + (counts - st.layers) * per_layer
    best = int(np.argmin(works.max(axis=1)))
    return (counts[best], per_layer) if works[best].max() < st.work.max() else None


def balanced_work(st: Stages) -> np.ndarray:
    """Each stage's work per micro-batch after ``layer_split``; without a layer count, the mean."""
    if st.layers is None or st.p < 2:
        return np.full(st.p, float(np.mean(st.work)))
    split = layer_split(st)
    return st.work if split is None else st.work + (split[0] - st.layers) * split[1]


def balance_note(st: Stages) -> str:
    """How ``balanced_work`` re-split the layers, for a price's basis."""
    if st.layers is None:
        return "every stage at the stages' mean work (a layer count per stage is unknown)"
    now, split = ", ".join(str(int(n)) for n in st.layers), layer_split(st)
    if split is None:
        return f"no split in whole layers lowers the busiest stage (layers per stage {now})"
    return f"layers per stage {now} -> {', '.join(map(str, split[0]))}, a layer {split[1] / 1e6:.2f} ms per micro-batch"


def overlap_slowdown(st: Stages, point: str = "best") -> np.ndarray:
    """Per stage, the share by which posted send/recv kernels slow its busy time at a gain
    point: the busiest stage's (the others wait for it) or the others' (they wait)."""
    i = POINTS.index(point)
    return np.where(st.work >= st.work.max(), OVERLAP_SLOWDOWN_BUSIEST[i], OVERLAP_SLOWDOWN[i])


def overlap_note(spec: dict, st: Stages) -> str:
    """What an overlapped schedule priced from a batched capture assumes, for a price's basis
    ("" where the change keeps the exchanges batched or the capture already overlapped)."""
    if st.p2p != BATCHED or p2p_mode([spec], st) != OVERLAPPED:
        return ""
    pct = [f"{100 * v:g}%" for v in (OVERLAP_SLOWDOWN[1], OVERLAP_SLOWDOWN_BUSIEST[1])]
    where = " at the best and high points" if p2p_mode([spec], st, "low") != OVERLAPPED else ""
    return (f"; the exchanges overlapped{where}, from a batched capture: each stage's sync idle leaves once, and "
            f"the posted send/recv kernels slow the stages that wait by {pct[0]} of their busy time, the busiest "
            f"stage by {pct[1]}")


def p2p_mode(specs: list[dict], st: Stages, point: str = "best") -> str:
    """How the changed schedule's exchanges run: as a spec says (``p2p``: ``batched`` or
    ``overlapped``), else as captured where the capture is interleaved, else Megatron-LM's and
    Megatron Bridge's default with VPP (overlapped isend/irecv: OVERLAPPED) at the best and high
    points, Megatron-Core's own default (``batch_p2p_comm``: BATCHED) at the low one."""
    said = [spec["p2p"] for spec in specs if spec.get("p2p") in (BATCHED, OVERLAPPED)]
    if said:
        return str(said[-1])
    if st.v > 1:
        return st.p2p
    return BATCHED if point == "low" else OVERLAPPED


def combined_ms(specs: list[dict], st: Stages, q: float = 0.5) -> float | None:
    """The simulated step (ms, per the base's samples) after the schedule changes ``specs``
    together, the exchange at the ``q`` quantile of the gaps (the plan's: the median, the
    table's best point); None where Megatron would not run them."""
    v, m, work, samples = _sizes(specs, st)
    if m < 1 or m != int(m) or (v > 1 and m < st.p):
        return None
    return step_ns(st, v, int(m), exchange_cost(st, q), work=work, p2p=p2p_mode(specs, st),
                   slowdown=overlap_slowdown(st, "best")) / samples / 1e6


def gains_ms(spec: dict, st: Stages) -> dict | None:
    """ms per step the fix ``spec`` saves at each point, against the schedule simulated at the
    captured (p, v, m); a micro-batch change is compared per the base's samples (the new step
    times m / m'). None where Megatron would not run the change (interleaving needs m >= p)."""
    out = {point: gain_at([spec], st, point) for point in POINTS}
    return None if None in out.values() else out


def gain_at(specs: list[dict], st: Stages, point: str, lean: Stages | None = None) -> float | None:
    """ms per step the schedule changes ``specs`` together save at ``point`` against the schedule
    simulated at the captured (p, v, m) of ``st``, the changed schedule run by ``lean`` (``st``
    less a graph fix's savings, ``pipelined.lean_stages``; ``st`` where None): the bubble a change
    removes is then the leaner stages'. The exchange at the first spec's quantile for the point;
    per the base's samples. None where Megatron would not run the changes."""
    lean = st if lean is None else lean
    v, m, work, samples = _sizes(specs, lean)
    if m < 1 or m != int(m) or (v > 1 and m < st.p):
        return None
    x = exchange_cost(st, _pick(next((s["exchange_quantile"] for s in specs if "exchange_quantile" in s), 0.5), point))
    new = step_ns(lean, v, int(m), x, work=work, p2p=p2p_mode(specs, lean, point),
                  slowdown=overlap_slowdown(lean, point)) / samples
    return (step_ns(st, st.v, st.m, x) - new) / 1e6


def less_host(st: Stages, saved_ns) -> Stages:
    """The stages with ``saved_ns`` (per stage, ns per step of its time the graph replay takes
    away: host time) taken out, split between the micro-batches' work and the once-per-step
    rest by their time (m U against R)."""
    return less_time(st, saved_ns, st.m * st.work / np.maximum(st.m * st.work + st.rest, 1))


def host_paced(st: Stages, host_ratio) -> Stages:
    """The stages on a host whose time is ``host_ratio`` (per stage) of the captured host's: the
    idle after the P2P syncs (the host refilling the queue) and the host's gap after an exchange
    (every stage's, at their mean ratio: one exchange cost serves all) are host time, and move with
    it as the host's calls and the CPU time between them do."""
    ratio = np.asarray(host_ratio, float)
    idle = None if st.sync_idle is None else st.sync_idle * ratio
    return replace(st, sync_idle=idle, gaps=st.gaps * float(np.mean(ratio)))


def less_time(st: Stages, saved_ns, share) -> Stages:
    """The stages with ``saved_ns`` (per stage, ns per step) taken off: ``share`` of it from the
    micro-batches' work (over m), the rest from the once-per-step rest (its part before the
    stages' meeting point in proportion)."""
    saved = np.asarray(saved_ns, float)
    rest = np.clip(st.rest - (1 - share) * saved, 0, None)
    pre = None if st.rest_before_meet is None else st.rest_before_meet * rest / np.maximum(st.rest, 1)
    return replace(st, work=np.clip(st.work - share * saved / st.m, 0, None), rest=rest, rest_before_meet=pre)


def bigger_microbatch_ms(st: Stages, k: float, saved_ns: np.ndarray, q: float = 0.5) -> float | None:
    """ms per step a k times larger micro-batch (m / k micro-batches, the same samples per step)
    saves on a pipelined job: the schedule simulated with m / k micro-batches, each k times a
    captured one's work after ``less_host(saved_ns)`` (per stage, ns per step: the host time the
    graph replay says the larger launches save), against the schedule at the captured m. The
    bubble grows with fewer micro-batches ((p - 1) / m of the step), which the graph replay
    keeps frozen in the captured PP waits. An exchange carries k times the activations: its
    floor (the transfer) scales by k, the host's gap after it does not. None where m / k is not
    a whole count or Megatron would not run it (interleaving needs m >= p)."""
    m2 = st.m / k
    if m2 < 1 or abs(m2 - round(m2)) > 1e-9 or (st.v > 1 and round(m2) < st.p):
        return None
    m2 = int(round(m2))
    x = exchange_cost(st, q)
    x2 = x + st.floor * (k - 1)
    lean = less_host(st, saved_ns)
    work2 = k * np.clip(lean.work - 2 * st.v * x, 0, None) + 2 * st.v * x2  # k micro-batches' work in one
    return (step_ns(st, st.v, st.m, x) - step_ns(lean, st.v, m2, x2, work=work2)) / 1e6


def fidelity(st: Stages) -> dict:
    """The simulated step at the captured (p, v, m) against the measured one."""
    sim = step_ns(st, st.v, st.m, exchange_cost(st, 0.5)) / 1e6
    meas = st.measured_step / 1e6
    return dict(p=st.p, v=st.v, m=st.m, simulated_step_ms=round(sim, 3), measured_step_ms=round(meas, 3),
                error_pct=round(100.0 * (sim - meas) / meas, 2) if meas else None,
                work_ms_per_microbatch=[round(float(u) / 1e6, 3) for u in st.work],
                rest_ms=[round(float(r) / 1e6, 3) for r in st.rest],
                exchange_ms=round(exchange_cost(st, 0.5) / 1e6, 3), p2p=st.p2p, pause_ms=round(st.pause / 1e6, 3),
                sync_idle_ms=None if st.sync_idle is None else [round(float(s) / 1e6, 3) for s in st.sync_idle])
