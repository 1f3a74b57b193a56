"""Per-kernel time per step, by normalised name: the table ``profclass diff`` matches across runs.

Two builds of the same model rarely emit byte-identical kernel names: template arguments
carry tile sizes and vector widths, Triton and cuBLAS kernels carry numeric suffixes, and
parameter lists repeat what the template already says. ``normalise_name`` drops the
parameter list and a leading ``void`` and replaces every free-standing number (``(int)128``,
``128x256``, ``_12``) by ``N``, but keeps identifiers (``sm90``, ``bf16``, functor names) so
that an add kernel stays distinct from a fill kernel and a BF16 GEMM from an FP8 one.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

# a number not glued to a preceding letter or digit, with its "x"-joined dimensions (128x256x64)
_NUMBER = re.compile(r"(?<![A-Za-z0-9])\d+(?:x\d+)*")
_SPACES = re.compile(r"\s+")
TABLE_COLUMNS = ["name", "op", "library", "collective", "is_comm", "is_gemm", "is_fp8",
                 "count_per_step", "ms_per_step", "gpus"]


def _drop_parameter_list(name: str) -> str:
    """``f<T>(int, T *)`` -> ``f<T>``: cut the trailing balanced ``(...)``."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        c = name[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                head = name[:i].rstrip()
                # "operator ()" or an anonymous "(...)" alone is not a parameter list to drop
                return head if head and not head.endswith("operator") else name
    return name  # unbalanced (a truncated name): leave it


def normalise_name(name: str) -> str:
    n = _SPACES.sub(" ", str(name)).strip()
    if n.startswith("void "):
        n = n[5:]
    n = _drop_parameter_list(n)
    return _NUMBER.sub("N", n)


def name_codes(full: pd.Series) -> tuple[np.ndarray, tuple]:
    """Per row: a code into the distinct normalised names (``normalise_name`` once per distinct
    name), -1 where there is none; and those names."""
    cat = full.astype("category")
    inverse, names = pd.factorize(pd.Index([normalise_name(n) for n in cat.cat.categories]))
    codes = cat.cat.codes.to_numpy(np.int64)
    safe = inverse[np.clip(codes, 0, None)] if len(inverse) else np.full(len(codes), -1)
    return np.where(codes >= 0, safe, -1).astype(np.int32), tuple(str(n) for n in names)


_META_COLUMNS = ["full_name", "library", "collective", "is_comm", "is_gemm", "is_fp8"]


def gpu_kernel_agg(ops: pd.DataFrame, window: tuple[int, int]) -> pd.DataFrame | None:
    """One GPU's ops that start inside ``window``, by (full_name, op): count, ns and the
    name's library/collective/flags; None when nothing starts inside."""
    lo, hi = window
    start = ops["start"].to_numpy(np.int64)
    rows = np.flatnonzero((start >= lo) & (start < hi))
    if not rows.size:
        return None
    dur = ops["end"].to_numpy(np.int64)[rows] - start[rows]
    fn, op = ops["full_name"], ops["op"]
    if isinstance(fn.dtype, pd.CategoricalDtype) and isinstance(op.dtype, pd.CategoricalDtype):
        # (name code, op code) packed into one integer, groups in first-seen order (as
        # groupby(sort=False)), sums by a sorted reduce: no copy of the window's rows
        fcode = fn.cat.codes.to_numpy()[rows].astype(np.int64)
        ocode = op.cat.codes.to_numpy()[rows].astype(np.int64)
        keep = (fcode >= 0) & (ocode >= 0)  # groupby drops missing keys
        if not keep.all():
            fcode, ocode, dur, rows = fcode[keep], ocode[keep], dur[keep], rows[keep]
            if not rows.size:
                return None
        n_op = len(op.cat.categories)
        group, keys = pd.factorize(fcode * n_op + ocode)
        labels = np.asarray(fn.cat.categories.astype(str), dtype=object)
        op_labels = np.asarray(op.cat.categories.astype(str), dtype=object)
        agg = pd.DataFrame({"full_name": pd.array(labels[keys // n_op], dtype="str"),
                            "op": pd.array(op_labels[keys % n_op], dtype="str"),
                            "count": np.bincount(group).astype(np.int64),
                            "ns": _group_sums(group, dur)})
        # the first op of each name, in first-seen order (drop_duplicates("full_name")): the
        # groups are numbered in first-seen order, so a name's first op is the first op of
        # its first group, and a group's first op is where the running maximum code grows
        group_first = _first_seen(group)
        name_first = _first_seen(pd.factorize(keys // n_op)[0])
        meta = ops.take(rows[group_first[name_first]])[_META_COLUMNS]
    else:
        inside = ops.take(rows)
        agg = (pd.DataFrame({"full_name": fn.take(rows).astype(str).to_numpy(), "op": inside["op"].to_numpy(),
                             "dur": dur})
               .groupby(["full_name", "op"], sort=False, observed=True)
               .agg(count=("dur", "size"), ns=("dur", "sum")).reset_index())
        meta = inside.drop_duplicates("full_name")[_META_COLUMNS]
    meta = meta.assign(full_name=meta["full_name"].astype(str))
    return agg.merge(meta, on="full_name", how="left")


def _group_sums(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of int64 ``values`` per ``group`` code, exact. ``bincount`` adds in float64, exact
    for integers while every partial sum stays below 2^53 (104 days of ns), checked by the
    largest magnitude times the count; else a sort and an integer reduce."""
    if not len(values) or max(int(values.max()), -int(values.min())) <= 2**53 // len(values):
        return np.bincount(group, weights=values).astype(np.int64)
    order = np.argsort(group, kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(group[order]) != 0])
    return np.add.reduceat(values[order], bounds).astype(np.int64)


def _first_seen(codes: np.ndarray) -> np.ndarray:
    """Where each code of a first-seen numbering (``pd.factorize``) first occurs, by code: a
    code is new exactly where the running maximum grows (no sort)."""
    if not len(codes):
        return np.empty(0, np.int64)
    top = np.maximum.accumulate(codes)
    return np.flatnonzero(np.r_[True, top[1:] > top[:-1]])


def kernel_table(gpus, iterations: list[int], comm_groups: list | None = None) -> pd.DataFrame:
    """Mean per GPU and per steady-state step of each normalised op name (kernels, copies, sets).

    ``gpus`` are GpuTimelines with their window set; ``iterations`` the steady iterations of
    each. An op belongs to the window when it starts inside it, as in the analyzers.
    ``comm_groups``: per GPU, its communication kernels with their ``group`` (the
    communication stage's); a SendRecv kernel of the PP group then gets its own row of kind
    ``send/recv`` (the pipeline's p2p, not an all-to-all: one kernel name serves both).
    """
    n_gpus = max(len(gpus), 1)
    parts, pp_parts = [], []
    for j, (g, its) in enumerate(zip(gpus, iterations)):
        # a per-rank summary (profclass.ranks) brings its rows aggregated by its worker
        agg = g.kernel_agg if hasattr(g, "kernel_agg") else gpu_kernel_agg(g.ops, g.window)
        if agg is None:
            continue
        agg = agg.copy()
        scale = 1.0 / (max(its, 1) * n_gpus)  # per step, then the mean over GPUs
        agg["count_per_step"] = agg["count"] * scale
        agg["ms_per_step"] = agg["ns"] * scale / 1e6
        agg["gpu"] = len(parts)
        if comm_groups is not None and comm_groups[j] is not None:
            pp_parts.append(_pp_send_recv(comm_groups[j], g.window, scale, len(parts)))
        parts.append(agg)
    if not parts:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    allk = pd.concat(parts, ignore_index=True)
    uniq = allk["full_name"].unique()
    allk["name"] = allk["full_name"].map(dict(zip(uniq, (normalise_name(u) for u in uniq))))
    allk["library"] = allk["library"].fillna("").astype(str)
    allk["collective"] = allk["collective"].fillna("").astype(str)
    for col in ("is_comm", "is_gemm", "is_fp8"):
        allk[col] = allk[col].fillna(False).astype(bool)
    allk = _split_send_recv(allk, [p for p in pp_parts if len(p)])
    table = allk.groupby(["name", "op", "collective"], sort=False, observed=True).agg(
        library=("library", "first"), is_comm=("is_comm", "any"),
        is_gemm=("is_gemm", "any"), is_fp8=("is_fp8", "any"), count_per_step=("count_per_step", "sum"),
        ms_per_step=("ms_per_step", "sum"), gpus=("gpu", "nunique")).reset_index()
    return table.sort_values("ms_per_step", ascending=False, kind="stable").reset_index(drop=True)[TABLE_COLUMNS]


def _pp_send_recv(kernels: pd.DataFrame, window: tuple[int, int], scale: float, gpu: int) -> pd.DataFrame:
    """One GPU's PP-group SendRecv kernels inside its window, per normalised name: count and
    ms per step (scaled as the table's rows)."""
    lo, hi = window
    k = kernels[(kernels["group"] == "PP") & (kernels["collective"].astype(str) == "all_to_all")
                & (kernels["start"] >= lo) & (kernels["start"] < hi)]
    if k.empty:
        return pd.DataFrame(columns=["gpu", "name", "pp_count", "pp_ms"])
    names = k["name"].astype(str)
    uniq = names.unique()
    per = pd.DataFrame({"name": names.map(dict(zip(uniq, (normalise_name(u) for u in uniq)))).to_numpy(),
                        "dur": (k["end"] - k["start"]).to_numpy(np.int64)})
    out = per.groupby("name", sort=False).agg(pp_count=("dur", "size"), pp_ms=("dur", "sum")).reset_index()
    out["pp_count"] = out["pp_count"] * scale
    out["pp_ms"] = out["pp_ms"] * scale / 1e6
    out["gpu"] = gpu
    return out


def _split_send_recv(allk: pd.DataFrame, pp_parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Move each GPU's PP share of a SendRecv kernel name into rows of kind ``send/recv``."""
    if not pp_parts:
        return allk
    pp = pd.concat(pp_parts, ignore_index=True)
    kern = (allk["op"] == "kernel") & (allk["collective"] == "all_to_all")
    # one row per (gpu, name) to take the PP share from: the name's largest
    first = allk[kern].sort_values("ms_per_step", ascending=False).drop_duplicates(["gpu", "name"])
    hit = first.reset_index().merge(pp, on=["gpu", "name"])
    if hit.empty:
        return allk
    out = allk.copy()
    idx = hit["index"].to_numpy()
    out.loc[idx, "count_per_step"] = np.maximum(out.loc[idx, "count_per_step"].to_numpy() - hit["pp_count"].to_numpy(), 0)
    out.loc[idx, "ms_per_step"] = np.maximum(out.loc[idx, "ms_per_step"].to_numpy() - hit["pp_ms"].to_numpy(), 0)
    moved = out.loc[idx].copy()
    moved["collective"], moved["count_per_step"], moved["ms_per_step"] = "send/recv", hit["pp_count"].to_numpy(), \
        hit["pp_ms"].to_numpy()
    out = pd.concat([out, moved], ignore_index=True)
    return out[(out["count_per_step"] > 1e-12) | (out["op"] != "kernel") | (out["collective"] != "all_to_all")]


def table_records(table: pd.DataFrame) -> list[dict]:
    """The table as JSON-ready rows (rounded)."""
    t = table.assign(count_per_step=table["count_per_step"].astype(float).round(3),
                     ms_per_step=table["ms_per_step"].astype(float).round(4),
                     gpus=table["gpus"].astype(int))
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in t.to_dict("records")]
