"""How much training work each side's step does. A pair that changed the batch (a larger global
batch, more micro-batches of the same size) does more per step: its step is compared per the
base's work, as throughput is, so twice the samples in 1.5x the time is an improvement, not a
regression (docs/diff.md, "Per the base's work").

The measure is per data-parallel rank and the same on both sides, or there is none:
- sequences: the global batch over DP (``--global-batch-size``, DP from the layout), else
  ``--micro-batch-size`` x micro-batches (the flag, else the timeline's count);
- rows: a micro-batch's rows off the normalisation kernels' grids (``fix_gains.ROWS``) x
  micro-batches, where no flag gives the micro-batch's size, both sides with the same TP and CP
  (sequence and context parallelism divide a micro-batch's rows among those ranks).
A micro-batch count that changed with nothing to say the micro-batch's size is no measure: a
smaller micro-batch and a larger global batch both raise it.
"""
from __future__ import annotations

SEQUENCES = "sequences per step on one data-parallel rank"
ROWS_MEASURE = "rows (tokens) per step on one data-parallel rank, off the normalisation kernels' grids"
ROWS = "micro_batch_rows"  # fix_gains' settings key of a micro-batch's rows (the same string)


def number(v) -> float | None:
    """A setting's value as a number, None where it is none."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _positive(v) -> float | None:
    x = number(v)
    return x if x is not None and x > 0 else None


def _sequences(s: dict, dp: int | None) -> tuple[float, str] | None:
    gbs = _positive(s.get("--global-batch-size"))
    if gbs and dp:
        return gbs / dp, f"--global-batch-size {gbs:g} / DP {dp}"
    mbs, m = _positive(s.get("--micro-batch-size")), _positive(s.get("--num-microbatches"))
    if mbs and m:
        return mbs * m, f"--micro-batch-size {mbs:g} x {m:g} micro-batches"
    return None


def _rows(s: dict) -> tuple[float, str] | None:
    rows, m = _positive(s.get(ROWS)), _positive(s.get("--num-microbatches"))
    if rows and m:
        return rows * m, f"{rows:g} rows x {m:g} micro-batches"
    return None


def step_work(sb: dict, sc: dict, sizes_b: dict, sizes_c: dict) -> dict | None:
    """The candidate's work per step over the base's, from two sides' settings (``fix_gains``'
    ``side_settings``: flags, Hydra overrides, the timeline's micro-batch count and rows) and layout
    sizes; None where no one measure is known on both sides."""
    seq = _sequences(sb, sizes_b.get("dp")), _sequences(sc, sizes_c.get("dp"))
    same_split = all(sizes_b.get(k) == sizes_c.get(k) for k in ("tp", "cp"))
    rows = (_rows(sb), _rows(sc)) if same_split else (None, None)
    for (wb, wc), measure in ((seq, SEQUENCES), (rows, ROWS_MEASURE)):
        if wb and wc:
            return dict(ratio=round(wc[0] / wb[0], 4), measure=measure, base=round(wb[0], 3),
                        candidate=round(wc[0], 3), basis=f"base {wb[1]}; candidate {wc[1]}")
    return None


def global_batch_note(work: dict | None, sizes_b: dict, sizes_c: dict) -> list[str]:
    """A note where the pair changed the global batch (the per-rank work ratio times the DP
    ratio): a per-work gain is throughput's, and the change is to the training too."""
    if not work:
        return []
    g = work["ratio"] * (sizes_c.get("dp") or 1) / (sizes_b.get("dp") or 1)
    if abs(g - 1) < 1e-6:
        return []
    return [f"the candidate trains {g:.3g}x the base's global batch ({work['basis']}): judged per the base's "
            "work, as throughput; a different global batch changes the training as well as its speed (the "
            "optimiser's steps per sample, a schedule counted in steps and, on a learned router, the experts' "
            "balance and so their time), so time to a given loss is not judged here"]


def per_base_work(xc: list[float], work: dict | None) -> list[float]:
    """The candidate's per-iteration steps per the base's work (unchanged without a work ratio)."""
    r = (work or {}).get("ratio") or 1.0
    return [x / r for x in xc]
