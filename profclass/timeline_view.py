"""What the reports draw: one representative steady-state iteration per GPU, as lanes of
intervals (compute, each collective type, copies, idle, NVTX), and the top kernels table.

Works on a ``Diagnosis`` made with ``diagnose(..., keep_timelines=True)``: the timelines are
already clock-aligned (multi-report jobs) and carry their steady-state iterations.
Every lane is an interval union (``intervals``), so the picture has one bar per busy
stretch, not one per kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import intervals as iv
from .formatting import by_rank
from .kernels import COLLECTIVE_TYPES
from .timeline import GpuTimeline

NVTX_LEVELS = 3  # nesting depth of NVTX ranges drawn; deeper ones are left out of the lane

LANE_COLOURS = {
    "compute": "#4C72B0", "GEMM": "#223F73",
    "all_to_all": "#DD8452", "all_reduce": "#C44E52", "all_gather": "#8172B3",
    "reduce_scatter": "#937860", "broadcast": "#DA8BC3", "reduce": "#8C613C", "other": "#8C8C8C",
    "memcpy": "#55A868", "idle": "#D9D9D9", "NVTX": "#CCB974",
    # one lane per parallel group once the communicator of each kernel is known
    "TP comm": "#8172B3", "CP comm": "#64B5CD", "EP comm": "#DD8452", "ETP comm": "#B47CC7",
    "DP comm": "#C44E52", "EDP comm": "#E8A0A2", "PP comm": "#937860", "other comm": "#8C8C8C",
}
GROUP_LANES = [f"{g} comm" for g in ("TP", "CP", "EP", "ETP", "DP", "EDP", "PP", "other")]
WALL_COLOURS = {"compute": "#4C72B0", "communication": "#DD8452", "host": "#B07AA1", "memory": "#55A868"}


@dataclass
class IterationView:
    """One GPU's representative steady iteration: ``lanes`` has lane, start, end (ns, on the
    job clock), and for NVTX rows level and text; ``lo``/``hi`` bound the step."""

    label: str
    rank: int | None
    iteration: str
    lo: int
    hi: int
    lanes: pd.DataFrame


def representative_iterations(gpus: list[GpuTimeline]) -> list[tuple[int, int, str]]:
    """(start, end, label) of one steady step per GPU: the step whose length is closest to the
    steady median. When every GPU has the same iterations the same one is taken on all of
    them (judged on the mean over GPUs), so collectives line up across the picture; else the
    one nearest in time to the first GPU's pick."""
    steadies = [g.steady for g in gpus]
    dur = [(s["step_end"] - s["start"]).to_numpy(float) for s in steadies]
    first = steadies[0]["index"].to_numpy()
    same = all(np.array_equal(s["index"].to_numpy(), first) for s in steadies)
    if same and len(gpus) > 1:
        mean = np.mean(np.stack(dur), axis=0)
        k = int(np.argmin(np.abs(mean - np.median(mean))))
        picks = [k] * len(gpus)
    else:
        # iterations differ across GPUs (warm-up dropped unevenly, periodicity): take the
        # median step of the first GPU and, on the others, the steady step starting nearest it
        k0 = int(np.argmin(np.abs(dur[0] - np.median(dur[0]))))
        t = int(steadies[0]["start"].iloc[k0])
        picks = [k0] + [int(np.argmin(np.abs(s["start"].to_numpy() - t))) for s in steadies[1:]]
    out = []
    for s, k in zip(steadies, picks):
        row = s.iloc[k]
        out.append((int(row["start"]), int(row["step_end"]), str(row.get("label", row["index"]))))
    return out


def _nvtx_levels(nv: pd.DataFrame) -> np.ndarray:
    """Nesting depth of each range among ``nv`` (sorted by start): how many of the other
    ranges enclose it. Quadratic in the ranges of one iteration, which are few."""
    s, e = nv["start"].to_numpy(), nv["end"].to_numpy()
    idx = np.arange(len(s))
    encl = (s[None, :] <= s[:, None]) & (e[None, :] >= e[:, None]) & (idx[None, :] != idx[:, None])
    # identical ranges enclose each other: count only the earlier one as the parent
    same = (s[None, :] == s[:, None]) & (e[None, :] == e[:, None]) & (idx[None, :] > idx[:, None])
    return (encl & ~same).sum(axis=1)


def iteration_view(gpu: GpuTimeline, lo: int, hi: int, iteration: str = "") -> IterationView:
    """The lanes of ``gpu`` inside [lo, hi)."""
    ops = gpu.ops[(gpu.ops["end"] > lo) & (gpu.ops["start"] < hi)]
    rows = []

    def add(lane, ivs):
        s, e = iv.clip(ivs, lo, hi)
        if s.size:
            rows.append(pd.DataFrame({"lane": lane, "start": s, "end": e}))

    kern = ops[ops["op"] == "kernel"]
    compute = kern[~kern["is_comm"]]
    add("compute", iv.union(compute["start"], compute["end"]))
    gemm = compute[compute["is_gemm"]]
    add("GEMM", iv.union(gemm["start"], gemm["end"]))
    _add_comm_lanes(gpu, ops[ops["is_comm"]], lo, hi, add)
    copies = ops[(ops["op"] != "kernel") & ~ops["is_comm"]]
    add("memcpy", iv.union(copies["start"], copies["end"]))
    add("idle", iv.complement(iv.union(ops["start"], ops["end"]), lo, hi))
    nv = gpu.nvtx
    if not nv.empty:
        nv = nv[(nv["end"] > lo) & (nv["start"] < hi) & (nv["end"] > nv["start"])].sort_values("start")
        if len(nv):
            level = _nvtx_levels(nv)
            keep = level < NVTX_LEVELS
            nv = nv[keep]
            rows.append(pd.DataFrame({"lane": "NVTX", "start": np.maximum(nv["start"].to_numpy(), lo),
                                      "end": np.minimum(nv["end"].to_numpy(), hi), "level": level[keep],
                                      "text": nv["text"].astype(str).to_numpy()}))
    lanes = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["lane", "start", "end"])
    for col, default in (("level", 0), ("text", "")):
        lanes[col] = lanes[col].fillna(default) if col in lanes else default
    lanes["level"] = lanes["level"].astype(int)
    return IterationView(label=gpu.label, rank=gpu.rank, iteration=iteration, lo=lo, hi=hi, lanes=lanes)


def _add_comm_lanes(gpu: GpuTimeline, comm: pd.DataFrame, lo: int, hi: int, add) -> None:
    """A lane per parallel group when the communicator of each kernel is known, else a lane
    per collective type."""
    groups = gpu.comm_groups
    if groups is not None and len(groups):
        g = groups[(groups["end"] > lo) & (groups["start"] < hi)]
        for name, sub in g.groupby("group"):
            add(f"{name} comm", iv.union(sub["start"], sub["end"]))
        copies = comm[comm["op"] != "kernel"]  # peer copies: no communicator
        if len(copies):
            add("other comm", iv.union(copies["start"], copies["end"]))
        return
    for ctype in COLLECTIVE_TYPES:
        c = comm[comm["collective"] == ctype]
        if len(c):
            add(ctype, iv.union(c["start"], c["end"]))


def iteration_views(d) -> list[IterationView]:
    """One representative steady iteration per GPU of a ``Diagnosis`` with timelines, by rank."""
    gpus = _timelines(d)
    picks = representative_iterations(gpus)
    views = [iteration_view(g, lo, hi, label) for g, (lo, hi, label) in zip(gpus, picks)]
    return sorted(views, key=lambda v: (v.rank is None, v.rank))


def top_kernels(d, n: int = 15) -> pd.DataFrame:
    """The kernels that take the most GPU time per steady step (mean over GPUs), with what
    the taxonomy says they are. Columns: kernel, kind, ms_per_step, calls_per_step,
    mean_us, share (of the mean step)."""
    gpus = _timelines(d)
    parts = []
    for g in gpus:
        lo, hi = g.window
        its = max(int(g.steady.shape[0]), 1)
        k = g.ops[(g.ops["op"] == "kernel") & (g.ops["start"] >= lo) & (g.ops["start"] < hi)]
        per = pd.DataFrame({"kernel": k["name"].astype(str).to_numpy(),
                            "dur": (k["end"] - k["start"]).to_numpy(),
                            "is_comm": k["is_comm"].to_numpy(), "collective": _kinds(g, k),
                            "library": k["library"].astype(str).to_numpy(), "is_gemm": k["is_gemm"].to_numpy()})
        # one kernel name can be two kinds (SendRecv: EP all-to-all and PP send/recv)
        agg = per.groupby(["kernel", "collective"], sort=False).agg(
            ns=("dur", "sum"), calls=("dur", "size"), is_comm=("is_comm", "first"),
            library=("library", "first"), is_gemm=("is_gemm", "first"))
        agg["ns"] = agg["ns"] / its
        agg["calls"] = agg["calls"] / its
        parts.append(agg)
    if not parts:
        return pd.DataFrame(columns=["kernel", "kind", "ms_per_step", "calls_per_step", "mean_us", "share"])
    allk = pd.concat(parts)
    # mean over GPUs: a kernel absent on a GPU counts as zero there
    tot = allk.groupby(level=[0, 1]).agg(ns=("ns", "sum"), calls=("calls", "sum"), is_comm=("is_comm", "first"),
                                         library=("library", "first"), is_gemm=("is_gemm", "first"))
    tot["collective"] = tot.index.get_level_values(1)
    tot["ns"] /= len(gpus)
    tot["calls"] /= len(gpus)
    tot = tot.sort_values("ns", ascending=False).head(n)
    kind = np.where(tot["is_comm"], tot["library"] + " " + tot["collective"],
                    np.where(tot["is_gemm"], "GEMM", "compute"))
    step_ms = float(d.window["step_ms"]["mean"]) or np.nan
    out = pd.DataFrame({"kernel": tot.index.get_level_values(0).to_numpy(), "kind": kind,
                        "ms_per_step": (tot["ns"] / 1e6).to_numpy(),
                        "calls_per_step": tot["calls"].to_numpy(),
                        "mean_us": (tot["ns"] / tot["calls"].clip(lower=1e-9) / 1e3).to_numpy()})
    out["share"] = out["ms_per_step"] / step_ms
    return out.reset_index(drop=True)


def _kinds(g: GpuTimeline, k: pd.DataFrame) -> np.ndarray:
    """The collective type of each of ``k``'s kernels, ``send/recv`` for a SendRecv kernel of the
    PP group (``comm_groups``: the communication kernels' groups, in the ops' order)."""
    kinds = k["collective"].astype(str).to_numpy().copy()
    groups = getattr(g, "comm_groups", None)
    if groups is None:
        return kinds
    comm_index = g.ops.index[g.ops["is_comm"].to_numpy(bool) & (g.ops["op"] == "kernel").to_numpy()]
    if len(comm_index) != len(groups):
        return kinds
    group = pd.Series(groups["group"].to_numpy(), index=comm_index).reindex(k.index).to_numpy()
    kinds[(group == "PP") & (kinds == "all_to_all")] = "send/recv"
    return kinds


def _timelines(d) -> list[GpuTimeline]:
    if not getattr(d, "timelines", None):
        raise ValueError("this Diagnosis has no timelines: make it with diagnose(..., keep_timelines=True)")
    return d.timelines


# ---------------------------------------------------------------------------------------------
# pictures (matplotlib, imported only when a picture is drawn)

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "profclass"  # stable SVG ids: same profile, same bytes
    import matplotlib.pyplot as plt
    return plt


def timeline_figure(d, width_in: float = 13.0):
    """A matplotlib Figure: per GPU (by rank), lanes for compute (GEMMs darker), each
    collective type, copies, idle and NVTX, over one representative steady iteration."""
    plt = _pyplot()
    views = iteration_views(d)
    present = set().union(*(set(v.lanes["lane"]) for v in views))
    order = ["compute"] + [c for c in COLLECTIVE_TYPES + GROUP_LANES if c in present] + ["memcpy", "idle"]
    order = [lane for lane in order if lane in present or lane in ("compute", "idle")]
    has_nvtx = "NVTX" in present
    nvtx_rows = 1 + max((int(v.lanes.loc[v.lanes["lane"] == "NVTX", "level"].max()) for v in views
                         if (v.lanes["lane"] == "NVTX").any()), default=0)
    # one shared time origin when the steps shown overlap in time (clocks are aligned)
    overlapping = max(v.lo for v in views) < min(v.hi for v in views)
    t0 = min(v.lo for v in views) if overlapping else None
    rows_per_gpu = len(order) + (nvtx_rows if has_nvtx else 0)
    height = 1.2 + 0.22 * rows_per_gpu * len(views) + 0.25 * len(views)
    fig, ax = plt.subplots(figsize=(width_in, max(2.6, height)), dpi=100)
    yticks, ylabels, y = [], [], 0.0
    span_ms = 0.0
    for v in views:
        origin = t0 if t0 is not None else v.lo
        span_ms = max(span_ms, (v.hi - origin) / 1e6)
        y = _draw_gpu(ax, v, order + (["NVTX"] if has_nvtx else []), nvtx_rows, origin, y, yticks, ylabels)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=7)
    ax.tick_params(axis="y", length=0, pad=2)
    ax.set_ylim(y - 0.6 + 0.1, -0.3)
    ax.set_xlim(0, span_ms * 1.002 if span_ms else 1)
    ax.set_xlabel("ms from the start of the step" if len(views) == 1 else
                  "ms from the earliest start of the steps shown (one clock for all GPUs)" if t0 is not None else
                  "ms from the start of each GPU's step")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _legend(ax, present, has_nvtx)
    ax.set_title(f"One representative steady-state iteration per GPU: {d.verdict['wall']} wall",
                 fontsize=10, pad=22)
    fig.subplots_adjust(left=2.1 / width_in, right=0.99, top=1 - 0.75 / fig.get_figheight(), bottom=0.5 / fig.get_figheight())
    return fig


def _draw_gpu(ax, v, lanes_shown: list[str], nvtx_rows: int, origin: int, y: float,
              yticks: list, ylabels: list) -> float:
    """One GPU's lanes, drawn from height ``y`` down (their ticks appended to ``yticks`` and
    ``ylabels``); returns where the next GPU starts."""
    lane_h, gap = 0.8, 0.9
    lanes = v.lanes
    group_top = y
    for lane in lanes_shown:
        rows = lanes[lanes["lane"] == lane]
        levels = nvtx_rows if lane == "NVTX" else 1
        for level in range(levels):
            r = rows[rows["level"] == level] if lane == "NVTX" else rows
            xs = ((r["start"] - origin) / 1e6).to_numpy()
            ws = ((r["end"] - r["start"]) / 1e6).to_numpy()
            if len(xs):
                ax.broken_barh(list(zip(xs, ws)), (y, lane_h), facecolors=LANE_COLOURS[lane], linewidth=0)
            if lane == "compute":
                g = lanes[lanes["lane"] == "GEMM"]
                if len(g):
                    ax.broken_barh(list(zip(((g["start"] - origin) / 1e6).to_numpy(),
                                            ((g["end"] - g["start"]) / 1e6).to_numpy())),
                                   (y, lane_h), facecolors=LANE_COLOURS["GEMM"], linewidth=0)
            if lane == "NVTX" and len(r):
                _label_ranges(ax, r, origin, y + lane_h / 2, span_hint=(v.hi - v.lo) / 1e6)
            yticks.append(y + lane_h / 2)
            ylabels.append(lane.replace("_", "-") if not (lane == "NVTX" and level) else "")
            y += gap
    ax.axhspan(group_top - 0.05, y - gap + lane_h + 0.05, xmin=0, xmax=1, facecolor="none",
               edgecolor="#999999", linewidth=0.6)
    # the GPU's name sits left of its lane names (offset in points, so any width works)
    ax.annotate(f"{v.label}\n{v.iteration}", xy=(0, (group_top + y - gap + lane_h) / 2),
                xycoords=ax.get_yaxis_transform(), xytext=(-62, 0), textcoords="offset points",
                ha="right", va="center", fontsize=8.5, fontweight="bold", annotation_clip=False)
    return y + 0.6


def _legend(ax, present: set[str], has_nvtx: bool) -> None:
    from matplotlib.patches import Patch
    legend = [Patch(facecolor=LANE_COLOURS[k], label=k.replace("_", "-"))
              for k in ["compute", "GEMM"] + [c for c in COLLECTIVE_TYPES + GROUP_LANES if c in present] + ["memcpy", "idle"]
              + (["NVTX"] if has_nvtx else []) if k in present or k in ("compute", "idle")]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(legend), fontsize=8,
              frameon=False)


def _label_ranges(ax, r: pd.DataFrame, origin: int, y: float, span_hint: float) -> None:
    """Write NVTX range names on the ranges wide enough to hold them."""
    w = ((r["end"] - r["start"]) / 1e6).to_numpy()
    wide = w >= 0.06 * max(span_hint, 1e-9)
    for x0, width, text in zip(((r["start"] - origin) / 1e6).to_numpy()[wide], w[wide], r["text"].to_numpy()[wide]):
        ax.text(x0 + width / 2, y, text[:28], ha="center", va="center", fontsize=6.5, clip_on=True)


def walls_figure(d, width_in: float = 9.0):
    """A stacked horizontal bar per rank of the steady-state step (ms) split by wall."""
    from .classify import WALLS
    plt = _pyplot()
    devs = by_rank(d.devices)
    labels = [f"rank {x['rank']} / GPU {x['device']}" for x in devs]
    fig, ax = plt.subplots(figsize=(width_in, 0.9 + 0.42 * len(devs)), dpi=100)
    left = np.zeros(len(devs))
    ypos = np.arange(len(devs))
    for wall in WALLS:
        vals = np.array([x["walls"][wall]["ms_per_step"] for x in devs], float)
        ax.barh(ypos, vals, left=left, color=WALL_COLOURS[wall], label=wall, height=0.62)
        for yy, l0, vv in zip(ypos, left, vals):
            if vv >= 0.07 * max(float(np.sum([x["step_ms"] for x in devs]) / len(devs)), 1e-9):
                ax.text(l0 + vv / 2, yy, f"{vv:.1f}", ha="center", va="center", fontsize=8, color="white")
        left += vals
    for yy, x in zip(ypos, devs):
        ax.text(left[yy] + 0.01 * left.max(), yy, f"{x['step_ms']:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(ypos)
    ax.set_yticklabels(labels, fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.12 if left.max() else 1)
    ax.set_xlabel("ms per steady-state step")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(WALLS), fontsize=8.5, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def save_figure(fig, path_or_buf, fmt: str | None = None) -> None:
    """Write a figure (png/svg/pdf, from the name unless ``fmt``) and free it."""
    plt = _pyplot()
    try:
        fig.savefig(path_or_buf, format=fmt, dpi=110, metadata=_metadata(fmt, path_or_buf))
    finally:
        plt.close(fig)


def _metadata(fmt, target):
    """Drop the creation date so the same profile gives byte-identical pictures."""
    kind = (fmt or str(target).rsplit(".", 1)[-1]).lower()
    return {"svg": {"Date": None}, "pdf": {"CreationDate": None}, "png": {"Software": None}}.get(kind)
