"""The PP and EP sizes from the SendRecv traffic itself, when no command line says them.

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
- a lone pair is EP when both ranks run the same number of kernels per step (EP ranks run one
  program), PP when they differ (the first stage holds the embedding, the last the loss).

With two kinds of bucket on one rank, the busier one is EP. What is not determined (TP, CP,
DP when world / PP leaves room for more than one) stays null.
"""
from __future__ import annotations

import numpy as np

from .layout import Layout, fill

END_TOL_NS = 20_000  # end-time spread of one transfer across its members (docs/comm.md)
# a middle PP stage splits its transfers between two neighbours: the lesser neighbour's share
# measured >= 0.69 of the greater (interleaved 0.20 vs 0.29); lockstep coincidences with
# non-partners <= 0.35 of the best partner's (0.20 vs 1.00, 0.10 vs 0.52) on the layout captures
PARTNER_REL = 0.5
PARTNER_MIN = 0.1
SAME_PROGRAM_TOL = 0.01  # kernels per step within 1%: the same program


def _near(x: np.ndarray, ends: np.ndarray) -> np.ndarray:
    if len(ends) == 0:
        return np.zeros(len(x), bool)
    idx = np.clip(np.searchsorted(ends, x), 1, len(ends)) - 1
    nxt = np.clip(idx + 1, 0, len(ends) - 1)
    return np.minimum(np.abs(ends[idx] - x), np.abs(ends[nxt] - x)) <= END_TOL_NS


def buckets(kernels, ranks) -> list[tuple[int, int, frozenset]]:
    """(rank, kernels in bucket, partner ranks) per (rank, stream) bucket of SendRecv kernels."""
    sr = [k[k["collective"] == "all_to_all"] for k in kernels]
    ends = {r: np.sort(k["end"].to_numpy()) for r, k in zip(ranks, sr)}
    out = []
    for r, k in zip(ranks, sr):
        for _, b in k.groupby("stream", observed=True):
            x = b["end"].to_numpy()
            share = {j: _near(x, ends[j]).mean() for j in ranks if j != r}
            best = max(share.values(), default=0.0)
            partners = frozenset(j for j, v in share.items() if v >= max(PARTNER_MIN, PARTNER_REL * best))
            if partners:
                out.append((r, len(b), partners))
    return out


def _classify(bks, per_step: dict) -> tuple[set, set]:
    """EP cliques and PP edges from the buckets."""
    seen = {(r, p) for r, _, p in bks}
    ep, pp = set(), set()
    busiest = {}
    for r, n, p in bks:
        busiest[r] = max(busiest.get(r, (0, None)), (n, p), key=lambda t: t[0])
    kinds = {r: len({p for q, _, p in bks if q == r}) for r, _, _ in bks}
    for r, n, p in bks:
        clique = p | {r}
        is_clique = all((j, frozenset(clique - {j})) in seen for j in p)
        if len(p) == 1 and kinds[r] == 1:  # a lone pair: one program (EP) or two stages (PP)?
            j = next(iter(p))
            is_clique = is_clique and abs(per_step[r] - per_step[j]) <= SAME_PROGRAM_TOL * max(per_step[r], 1)
        if is_clique and busiest[r][1] == p:
            ep.add(frozenset(clique))
        else:
            pp.update(frozenset((r, j)) for j in p)
    return ep, pp


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


def infer(layout: Layout, kernels, ranks, kernels_per_step: list[float]) -> None:
    """Fill PP and EP (and what they force) from the traffic, where no command line said them."""
    if layout.source.get("pp") or layout.source.get("ep") or len(kernels) < 2:
        return
    ep_sets, pp_edges = _classify(buckets(kernels, ranks), dict(zip(ranks, kernels_per_step)))
    s, src = layout.sizes, layout.source
    s["ep"], src["ep"] = (max(len(c) for c in ep_sets) if ep_sets else 1), "inferred"
    s["pp"], src["pp"] = _chain_size(pp_edges), "inferred"
    if layout.world and layout.world == s["pp"]:  # nothing left for TP or CP
        for k in ("tp", "cp"):
            s[k], src[k] = 1, "inferred"
    fill(layout)
