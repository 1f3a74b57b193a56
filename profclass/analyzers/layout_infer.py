"""The TP, PP and EP sizes from the traffic itself, when no command line says them.

Two ranks exchange data when their SendRecv kernels finish together: the kernels of one
transfer end within the natural spread of collective end times (`docs/comm.md`: 6-27 us on
NVLink), other ranks' kernels only by chance. Per (rank, stream) bucket of SendRecv kernels,
rank j is a *partner* when the share of the bucket's kernels ending within ``END_TOL_NS`` of
one of j's is at least ``PARTNER_REL`` of the best-matching rank's share (and ``PARTNER_MIN``).
Then:

- a bucket whose partners are all partners of each other (a clique, every member seeing the
  same set) is an all-to-all: EP = clique size;
- partners that are not partners of each other (a middle stage talks to the stage before and
  the stage after) are pipeline neighbours: PP = the size of the chain they form;
- a lone pair is EP when both ranks run the same number of kernels per SendRecv kernel over the
  capture (EP ranks run one program; a ratio of whole-capture counts, so windows of different
  lengths do not matter), PP when they differ (the first stage holds the embedding, the last the
  loss).

With two kinds of bucket on one rank, the busier one is EP.

TP comes first, from the other collectives: Megatron issues TP collectives inside every layer
and micro-batch (2 forward and 2 backward all-reduces per layer, or all-gathers and
reduce-scatters with SP), so a TP collective type runs at least ~0.22 kernels per GEMM kernel
(4 against 12 GEMMs plus the attention's batched GEMMs per layer), while the DP gradient and
parameter collectives run once per bucket per step (0.003-0.05 per GEMM on the captures) and the
MoE dispatcher's token-count all-gathers once per MoE layer (0.025-0.054). A collective type at
``PER_LAYER_MIN`` or more whose partners form the aligned block of consecutive ranks that
parallel_state gives TP (TP is the fastest-varying rank coordinate), and is not the EP clique, is
TP. Every PP and EP partner of a rank then sits a multiple of TP away (both groups are strided
by TP in parallel_state's orders), which removes the TP peers' lockstep coincidences from the
SendRecv partners. One exception: experts without TP (expert TP 1) put the EP group over the TP
ranks, so the EP clique is the TP block itself. A per-layer group equal to the EP clique is TP
only where its collectives run inside the forward passes (``FORWARD_MIN``: TP's do, in every
layer; a gradient reduction over the same ranks never does); EP is then that clique and expert
TP 1. No per-layer collective at all on a dense job means TP = 1; on a MoE job
without an EP all-to-all (the all-gather dispatcher gathers over TP x EP) TP and EP stay unknown. CP
is taken as 1 when TP is inferred (no capture with CP: its ring exchange is not recognised).
What is not determined stays null.
"""
from __future__ import annotations

import re

import numpy as np

from .layout import BRIDGE, OVERRIDES, UNDETERMINED, Layout, fill, with_overrides

END_TOL_NS = 20_000  # end-time spread of one transfer across its members (docs/comm.md)
# a middle PP stage splits its transfers between two neighbours: the lesser neighbour's share
# measured >= 0.69 of the greater (interleaved 0.20 vs 0.29); lockstep coincidences with
# non-partners <= 0.35 of the best partner's (0.20 vs 1.00, 0.10 vs 0.52) on the layout captures
PARTNER_REL = 0.5
PARTNER_MIN = 0.1
SAME_PROGRAM_TOL = 0.01  # kernels per SendRecv kernel (whole capture) within 1%: the same program
# kernels of one collective type per GEMM kernel that mark a per-layer (TP) collective: the
# geometric mean of the per-bucket DP/MoE-metadata rates (<= 0.054 measured) and the per-layer
# TP rates (>= 0.22 by Megatron's layer structure, 0.24-0.36 measured), an order of magnitude apart
PER_LAYER_MIN = 0.11
PER_LAYER_TYPES = ("all_reduce", "all_gather", "reduce_scatter")
# share of a type's kernels issued in a forward pass (``timeline.in_forward``) that marks TP: half
# of Megatron's TP collectives (0.44-0.60 measured on TP 2 + SP x PP 2 x EP 2); gradient
# reductions none (0.00: dpoverlap_4gpu's DP all-reduces over its EP clique's ranks)
FORWARD_MIN = 0.2
# MoE routing: torch.topk (gatherTopK) or a fused top-k router kernel; a dense model has none
MOE_ROUTER = re.compile(r"topk", re.I)


def end_gap(own_end: np.ndarray, peer_ends: np.ndarray) -> np.ndarray:
    """For each own end, the distance to the nearest of the sorted ``peer_ends`` (inf when the
    peer has none)."""
    if len(peer_ends) == 0:
        return np.full(len(own_end), np.inf)
    idx = np.clip(np.searchsorted(peer_ends, own_end), 1, len(peer_ends)) - 1
    nxt = np.clip(idx + 1, 0, len(peer_ends) - 1)
    return np.minimum(np.abs(peer_ends[idx] - own_end), np.abs(peer_ends[nxt] - own_end))


def _pool(ends: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every rank's ends in one sorted array, with the position of each end's rank in ``ends``:
    one search per own end finds its near ends on every rank at once."""
    keys = list(ends)
    vals = np.concatenate([ends[j] for j in keys]) if keys else np.empty(0, np.int64)
    owner = np.repeat(np.arange(len(keys)), [len(ends[j]) for j in keys])
    order = np.argsort(vals, kind="stable")
    return vals[order], owner[order], {j: i for i, j in enumerate(keys)}


def _shares(x: np.ndarray, r: int, ranks, pool: tuple, stride: int) -> dict[int, float]:
    """Share of the kernel ends ``x`` of rank ``r`` with a same-type end on each other rank a
    multiple of ``stride`` away (``end_gap`` <= ``END_TOL_NS``, for all ranks in one pass over
    the ``_pool``: a rank pair at a time made the layout quadratic in Python calls)."""
    vals, owner, pos = pool
    # saturating bounds: x +- the tolerance wraps around for an end within it of int64's limits
    i64 = np.iinfo(np.int64)
    lower = np.where(x < i64.min + END_TOL_NS, i64.min, x - END_TOL_NS)
    upper = np.where(x > i64.max - END_TOL_NS, i64.max, x + END_TOL_NS)
    lo = np.searchsorted(vals, lower, "left")
    n = np.searchsorted(vals, upper, "right") - lo
    near = np.zeros((len(x), len(pos)), bool)  # own end i has an end of rank pos[j] within the tolerance
    at = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    near[np.repeat(np.arange(len(x)), n), owner[at]] = True
    share = near.mean(axis=0)
    return {j: share[pos[j]] for j in ranks if j != r and (j - r) % stride == 0}


def _partners(share: dict[int, float]) -> frozenset:
    best = max(share.values(), default=0.0)
    return frozenset(j for j, v in share.items() if v >= max(PARTNER_MIN, PARTNER_REL * best))


def buckets(kernels, ranks, stride: int = 1) -> list[tuple[int, int, frozenset]]:
    """(rank, kernels in bucket, partner ranks) per (rank, stream) bucket of SendRecv kernels;
    partners only ``stride`` apart (TP, once known: PP and EP peers share the TP coordinate)."""
    sr = [k[k["collective"] == "all_to_all"] for k in kernels]
    pool = _pool({r: k["end"].to_numpy() for r, k in zip(ranks, sr)})
    out = []
    for r, k in zip(ranks, sr):
        for _, b in k.groupby("stream", observed=True):
            partners = _partners(_shares(b["end"].to_numpy(), r, ranks, pool, stride))
            if partners:
                out.append((r, len(b), partners))
    return out


def per_layer_types(kernels, windows, gemms) -> list[set]:
    """Per GPU, the collective types that run at ``PER_LAYER_MIN`` kernels per GEMM kernel or
    more in its window: issued inside every layer and micro-batch."""
    out = []
    for k, (lo, hi), n_gemm in zip(kernels, windows, gemms):
        inside = k.loc[(k["start"] >= lo) & (k["start"] < hi), "collective"]
        out.append({c for c in PER_LAYER_TYPES if n_gemm and (inside == c).sum() >= PER_LAYER_MIN * n_gemm})
    return out


def tp_blocks(kernels, ranks, per_layer: list[set]) -> dict[int, frozenset]:
    """Per rank, the members (itself included) of its per-layer collective group: partners of
    every collective type ``per_layer_types`` found on it."""
    pools = {c: _pool({r: k.loc[k["collective"] == c, "end"].to_numpy() for r, k in zip(ranks, kernels)})
             for c in PER_LAYER_TYPES}
    out = {}
    for r, k, types in zip(ranks, kernels, per_layer):
        for c in types:
            x = k.loc[k["collective"] == c, "end"].to_numpy()
            partners = _partners(_shares(x, r, ranks, pools[c], 1))
            if partners:
                out[r] = out.get(r, frozenset()) | partners | {r}
    return out


def forward_types(kernels, ranks, per_layer: list[set]) -> dict[int, set]:
    """Per rank, its per-layer collective types issued inside forward passes (``FORWARD_MIN``)."""
    out = {}
    for r, k, types in zip(ranks, kernels, per_layer):
        fwd = k["in_forward"].to_numpy(bool) if "in_forward" in k else np.zeros(len(k), bool)
        coll = k["collective"].to_numpy()
        out[r] = {c for c in types if (coll == c).any() and fwd[coll == c].mean() >= FORWARD_MIN}
    return out


def _tp_size(blocks: dict[int, frozenset], ranks, ep_sets: set, forward: dict | None = None) -> tuple[int | None, bool]:
    """(the TP size, whether the EP clique is the TP block) when every rank's per-layer group is
    the aligned block of consecutive ranks parallel_state makes TP, and not an EP clique unless
    its collectives run in the forward passes (``forward``: ``forward_types``); None when the
    blocks say otherwise."""
    sizes = {len(b) for b in blocks.values()}
    if len(sizes) != 1 or set(blocks) != set(ranks):
        return None, False
    t = sizes.pop()
    over = False
    for r, b in blocks.items():
        first = r - r % t
        if b != frozenset(range(first, first + t)):
            return None, False
        if b in ep_sets:
            if not (forward or {}).get(r):
                return None, False
            over = True
    return t, over


def _classify(bks, shape: dict) -> tuple[set, set, set]:
    """EP cliques, PP edges, and the PP edges both ends see, from the buckets."""
    # one object per distinct rank set, so that the membership tests below compare by identity:
    # j's bucket with partners clique - {j} is (j, clique) here (a rank is never its own partner)
    canon: dict[frozenset, frozenset] = {}
    closed = {(r, canon.setdefault(p | {r}, p | {r})) for r, _, p in bks}
    ep, pp = set(), set()
    busiest, partner_sets = {}, {}
    for r, n, p in bks:
        busiest[r] = max(busiest.get(r, (0, None)), (n, p), key=lambda t: t[0])
        partner_sets.setdefault(r, set()).add(p)
    kinds = {r: len(sets) for r, sets in partner_sets.items()}
    for r, n, p in bks:
        clique = canon[p | {r}]
        is_clique = all((j, clique) in closed for j in p)
        if len(p) == 1 and kinds[r] == 1:  # a lone pair: one program (EP) or two stages (PP)?
            j = next(iter(p))
            is_clique = is_clique and abs(shape[r] - shape[j]) <= SAME_PROGRAM_TOL * max(shape[r], 1)
        if is_clique and busiest[r][1] == p:
            ep.add(frozenset(clique))
        else:
            pp.update(frozenset((r, j)) for j in p)
    # groups partition the ranks: cliques sharing a rank are a chain of pairs, pipeline neighbours
    # (overlapped P2P: a communicator, so a stream and a bucket, per neighbour), not EP groups
    chain = {c for c in ep if any(c & d and c != d for d in ep)}
    pp.update(frozenset((a, b)) for c in chain for a in c for b in c if a < b)
    seen = {(r, j) for r, _, p in bks for j in p}
    return ep - chain, pp, {e for e in pp if all((a, b) in seen for a in e for b in e if a != b)}


def _chain_size(edges: set) -> int:
    """Ranks in the largest connected set of PP edges (one pipeline)."""
    adj: dict[int, set] = {}
    for e in edges:
        a, b = tuple(e)
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)
    best, seen = 1, set()
    for start in adj:
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v not in comp:
                comp.add(v)
                todo.extend(adj[v] - comp)
        seen |= comp
        best = max(best, len(comp))
    return best


def pp_size(edges: set, world: int | None) -> tuple[int | None, str | None]:
    """PP from the pipeline neighbours found, and why not where they cannot tell.

    parallel_state makes PP the slowest rank coordinate: stage k's ranks sit k x s past stage
    0's, s = world / PP, so neighbouring stages are s ranks apart and the interleaved
    schedule's wrap (last stage to first) world - s. Each edge gives s = min(d, world - d) for
    its distance d, which must divide the world; one s for every edge gives PP = world / s
    whether or not every neighbour showed (a GPU-bound interleaved job's middle pair ends too
    spread to match). Without the world or global ranks, the largest chain of edges."""
    if not edges:
        return 1, None
    pairs = [tuple(e) for e in edges]
    if not world or any(not isinstance(r, (int, np.integer)) for pair in pairs for r in pair):
        return _chain_size(edges), None
    strides = {min(abs(a - b), world - abs(a - b)) for a, b in pairs}
    if len(strides) == 1 and world % (s := strides.pop()) == 0 and s > 0:
        return world // s, None
    found = sorted(tuple(sorted(p)) for p in pairs)
    shown = ", ".join(f"{a}-{b}" for a, b in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return None, (f"pipeline neighbours found ({shown}) fit no one stage stride dividing the world of "
                  f"{world} (PP is the slowest rank coordinate)")


def infer(layout: Layout, kernels, ranks, program_shape: list[float], windows=None, gemms=None,
          moe_router: bool = False, alltoall_peers=None) -> None:
    """Fill TP, PP and EP (and what they force) from the traffic, where no command line said
    them. ``program_shape``: each GPU's kernels per SendRecv kernel over the capture; ``windows`` and ``gemms``: each GPU's steady window and its GEMM kernels there (the
    per-layer test); ``moe_router``: routing kernels seen (a MoE job); ``alltoall_peers``: each
    GPU's ``nccl_alltoall_peers`` (EP where one rank is all the profile holds)."""
    per_layer = per_layer_types(kernels, windows, gemms) if windows is not None and gemms is not None else None
    if per_layer is not None:  # for the group guess when no layout is known
        layout.per_layer = set().union(*per_layer)
        layout.moe_router = moe_router
    src = layout.source
    told = {k: (layout.sizes[k], v) for k, v in src.items() if v == BRIDGE and k in OVERRIDES}
    if "command line" in src.values() or (not told and any(src.get(k) for k in ("tp", "pp", "ep"))):
        return
    for k in told:  # the traffic is read as if nothing were told; the overrides win after
        layout.sizes[k], src[k] = None, None
    ran = _from_traffic(layout, kernels, ranks, program_shape, per_layer, moe_router, alltoall_peers)
    if told:
        with_overrides(layout, told, ran)


def _from_traffic(layout: Layout, kernels, ranks, program_shape, per_layer, moe_router, alltoall_peers) -> bool:
    """``infer``'s reading of TP, PP and EP off the collectives' partners; whether there was
    traffic between ranks to read (two or more in the profile)."""
    if len(kernels) == 1 and (layout.world_from_gpus or layout.world == 1):
        _one_gpu(layout, kernels[0], alltoall_peers)
    if len(kernels) < 2:
        return False
    shape = dict(zip(ranks, program_shape))
    unstrided = _classify(buckets(kernels, ranks), shape)
    ep_sets = unstrided[0]
    tp, ambiguous, ep_over_tp = None, False, False
    if per_layer is not None and layout.world == len(ranks):
        blocks = tp_blocks(kernels, ranks, per_layer)
        if not any(per_layer):
            tp = 1  # no per-layer collective: neither TP nor a MoE token exchange over it
        elif not blocks:
            tp = None  # per-layer collectives whose partners do not show (ends too spread to match)
        elif moe_router and not ep_sets:
            # the all-gather dispatcher's TP x EP group looks like TP: neither is decided
            tp, ambiguous = None, True
        else:  # in a dense job a SendRecv "clique" on the TP block is TP peers sending in lockstep
            tp, ep_over_tp = _tp_size(blocks, ranks, ep_sets if moe_router else set(),
                                      forward_types(kernels, ranks, per_layer))
    # with TP known, the SendRecv partners again, only a multiple of TP away (the PP neighbours;
    # EP too, unless it is laid over the TP block: then the clique found unstrided)
    ep_sets, pp_edges, mutual = _classify(buckets(kernels, ranks, stride=tp), shape) if tp and tp > 1 else unstrided
    s, src = layout.sizes, layout.source
    if ep_over_tp:
        ep_sets = {c for c in unstrided[0] if len(c) == tp}
        s["etp"], src["etp"] = 1, "inferred"
    s["ep"], src["ep"] = ((None, None) if ambiguous else
                          ((max(len(c) for c in ep_sets) if ep_sets else 1), "inferred"))
    s["pp"], why = pp_size(pp_edges, layout.world)
    if why and mutual:  # a partner one end alone sees is the weaker: the edges both ends see decide, if they can
        both = pp_size(mutual, layout.world)
        s["pp"], why = both if both[1] is None else (s["pp"], why)
    src["pp"] = "inferred" if why is None else f"{UNDETERMINED}: {why}"
    if tp:
        s["tp"], s["cp"], src["tp"], src["cp"] = tp, 1, "inferred", "inferred"
    if layout.world and layout.world == s["pp"]:  # nothing left for TP or CP
        for k in ("tp", "cp"):
            s[k], src[k] = 1, "inferred"
    _ep_from_nccl(layout, alltoall_peers, len(ranks))
    _drop_impossible(layout, kernels, ranks)
    fill(layout)
    return True




def _one_gpu(layout: Layout, kernels, alltoall_peers) -> None:
    """One GPU. With collectives and no launcher's world their peers are outside it: the job is
    bigger, by how much nothing says (NCCL's NVTX ranges may give the all-to-all's group). With
    none, or a launcher's world of one, the job is this GPU: every group of one."""
    if not len(kernels) or not layout.world_from_gpus:
        if layout.world == 1:
            for k in ("tp", "cp", "pp", "ep"):
                layout.sizes[k], layout.source[k] = 1, "inferred"
            fill(layout)
        return
    layout.world = None
    ep = (alltoall_peers or [None])[0]
    _undetermined(layout, ("tp", "cp", "pp", "dp") + (() if ep else ("ep",)),
                  "one rank in the profile, its collectives' peers outside it: no partner to match, no world size")
    if ep:
        layout.sizes["ep"], layout.source["ep"] = ep, "inferred"


def _ep_from_nccl(layout: Layout, alltoall_peers, n_ranks: int) -> None:
    """EP from torch's all-to-all communicator (``nccl_alltoall_peers``) where every rank of the
    whole job shows the same: SendRecv partners, matched a multiple of TP away, miss an EP group
    spanning TP blocks (TP 2, EP 4 read EP 2). EP x TP above a stage's ranks: expert TP 1."""
    peers = set(alltoall_peers or [])
    s, src = layout.sizes, layout.source
    if len(peers) != 1 or None in peers or not layout.world or layout.world != n_ranks or s.get("ep") is None:
        return
    ep = peers.pop()
    if ep < 2 or ep == s["ep"] or layout.world % ep:
        return
    s["ep"], src["ep"] = ep, "inferred"
    tp, pp = s.get("tp") or 1, s.get("pp") or 1
    if tp > 1 and ep * tp > layout.world // pp:
        s["etp"], src["etp"] = 1, "inferred"


def _undetermined(layout: Layout, names, why: str) -> None:
    for k in names:
        layout.sizes[k], layout.source[k] = None, f"{UNDETERMINED}: {why}"


def _drop_impossible(layout: Layout, kernels, ranks) -> None:
    """Inferred sizes that no Megatron layout of this world allows become null, with the reason
    in ``layout.source``: ranks with identical collective timelines (copies of one rank: their
    partners cannot be told apart, whatever else they seemed to show), a size that does not
    divide the world, or groups that together exceed it (``pp_size`` has judged the pipeline
    neighbours)."""
    s, world = layout.sizes, layout.world
    inferred = [k for k in ("tp", "cp", "pp", "ep") if layout.source.get(k) == "inferred"
                or str(layout.source.get(k)).startswith(UNDETERMINED)]
    if not inferred or not world:
        return
    seen: dict[tuple, int] = {}
    for r, k in zip(ranks, kernels):
        ends = np.sort(k["end"].to_numpy(np.int64))
        key = (len(ends), int(ends.sum() % (1 << 61)), ends[:8].tobytes(), ends[-8:].tobytes())
        if len(ends) and key in seen:
            _undetermined(layout, inferred, f"ranks {seen[key]} and {r} have identical collective timelines "
                                            "(copies of one rank)")
            return
        seen[key] = r
    inferred = [k for k in inferred if layout.source[k] == "inferred"]
    bad = [f"{k.upper()}={s[k]}" for k in inferred if s.get(k) and world % s[k]]
    if bad:
        _undetermined(layout, inferred, f"the traffic gives {', '.join(bad)}, which does not divide the world of {world}")
        return
    tp, cp, pp, ep = (s.get(k) or 1 for k in ("tp", "cp", "pp", "ep"))
    etp = s.get("etp") or tp  # the experts' TP: TP's unless the EP clique was the TP block
    if world % (tp * cp * pp) or world % (etp * ep * pp):
        _undetermined(layout, inferred, f"TP={tp}, CP={cp}, PP={pp}, EP={ep}, ETP={etp} do not fit a world of {world}")
        return


def infer_passes(layout: Layout, ranks, passes: list, warmups: list) -> None:
    """VPP and the micro-batch count from the forward passes each GPU runs per step
    (``recompute.forward_passes``), where no command line said them. Every stage runs
    ``VPP x micro-batches`` forward passes per step (the median over GPUs, rounded). Megatron's
    interleaved schedule makes the last stage run ``(VPP - 1) x PP`` warm-up forwards before the
    steady 1F1B, the plain one none: the last stage's longest backward-free stretch holds
    ``(VPP - 1) x PP + 1`` forwards. A job without PP has VPP = 1. Undetermined: left null
    (``layout.missing`` says so)."""
    s, src = layout.sizes, layout.source
    known = [p for p in passes if p]
    if not known or (s.get("microbatches") and s.get("vpp")):
        return
    chunks = int(round(float(np.median(known))))
    pp = s.get("pp")
    vpp = s.get("vpp")
    if vpp is None and pp == 1:
        vpp = 1
    elif vpp is None and pp and pp > 1 and layout.world and len(ranks) == layout.world:
        per_stage = layout.world // pp  # Megatron's orders put PP slowest: the last stage's ranks
        last = [w for r, w in zip(ranks, warmups) if w and r is not None and r // per_stage == pp - 1]
        if last:
            vpp = int(round((float(np.median(last)) - 1) / pp)) + 1
    # a job bigger than one GPU (or one rank of one) whose PP is unknown: the passes are seen,
    # their split is not (a one-GPU profile without collectives keeps the plain unknown)
    bigger = len(ranks) > 1 or str(src.get("pp")).startswith(UNDETERMINED)
    if pp is None and bigger and s.get("vpp") is None and s.get("microbatches") is None:
        _undetermined(layout, ("vpp", "microbatches"), f"{chunks} forward passes per step (VPP x micro-batches), "
                                                       "and PP unknown")
        return
    if vpp is None or vpp < 1 or chunks < vpp or chunks % vpp:
        return
    if s.get("vpp") is None:
        s["vpp"], src["vpp"] = vpp, "inferred"
    if s.get("microbatches") is None:
        s["microbatches"], src["microbatches"] = chunks // vpp, "inferred"
