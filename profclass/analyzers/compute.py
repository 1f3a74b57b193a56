"""Analyzer: compute kernels, GEMMs, SM utilisation and the other exposed copies."""
from __future__ import annotations

import re

import numpy as np

from .. import intervals as iv
from ..timeline import GpuTimeline
from .job import Job, evidence_row, mean_per_step_ms
from .protocol import Analyzer
from .gainmodel import gain, share_of
from .results import ComputeResult
from .sets import WindowSets, clipped_set, name_matches

SMALL_GEMMS_SM_BUSY = 0.6  # SMs busier than this while compute runs: kernels fill the GPU
SMALL_GEMMS_KERNELS_PER_STEP = 2000
# the unfused kernels each named fusion flag replaces, by kernel-name family (docs/fixes.md), in
# the order a name is tried (the loss's log_softmax before attention's softmax): the flag, and
# the key a fix's ``fuse`` transform switches it by
FUSION_FLAGS = (
    ("cross_entropy", "--cross-entropy-loss-fusion", r"log_softmax|LogSoftMax|nll_loss|cross_entropy"),
    ("softmax", "--masked-softmax-fusion", r"masked_fill|softmax|SoftMax"),  # mask fill + softmax
    ("activation", "--bias-activation-fusion", r"silu|gelu|swiglu|geglu"),  # and their backward
    ("rope", "--apply-rope-fusion", r"rotary|rope_"),
    ("dropout", "--bias-dropout-fusion", r"dropout|bernoulli"),
    ("permute", "--moe-permute-fusion", r"indexFunc|index_elementwise|scatter_gather"),  # token permutation
)
# PyTorch's generic pointwise kernels: the other links of a chain a fusion flag replaces (the bias
# add before an activation, the GLU's multiply after it, the scale before a mask)
POINTWISE = re.compile(r".*elementwise_kernel")
COMPILED = re.compile(r"triton_")  # Inductor's generated kernels (str.match: at the name's start)
# kernels that run once per step, whatever the micro-batch count: the optimizer and the
# gradient norm/clip/scale passes (PyTorch and Apex/TE multi-tensor kernels, fused Adam)
PER_STEP_KERNELS = re.compile(r".*(?:multi_tensor|[Ff]used[_]?[Aa]dam|adam_kernel|AdamFunctor|l2norm)")
FUSION_SAVES = 0.5  # a fused chain of two memory-bound passes reads and writes HBM once instead of twice
# FP8 GEMM speed-up over BF16 measured end to end on H100 (Megatron-LM issue #396: a 13B GPT,
# --fp8-hybrid, 0.34 -> 0.24 s/step = 1.42x), range: 1.2x (small GEMMs where the per-step
# quantisation dominates) to 2x (the tensor cores' peak ratio)
FP8_SPEEDUP, FP8_SPEEDUP_LOW, FP8_SPEEDUP_HIGH = 1.42, 1.2, 2.0
# the forward normalisation kernels, whose grids follow the rows (tokens) they normalise:
# PyTorch's LayerNorm/RMSNorm (one block a row), Apex's (a row per block, up to 65535), and
# Transformer Engine's tuned and general kernels (a fixed number of rows a block)
NORM_FORWARD = re.compile(r".*(?:vectorized_layer_norm_kernel|RowwiseMomentsCUDAKernel|LayerNormForwardCUDAKernel"
                          r"|cuApplyLayerNorm|cuApplyRMSNorm|(?:ln|rmsnorm)_fwd_(?:tuned|general)_kernel)")


def fusion_codes(names) -> np.ndarray:
    """Per kernel name: 1 + the index in ``FUSION_FLAGS`` of the flag that fuses it, -1 for
    another generic pointwise kernel, 0 for the rest. A compiled kernel (Inductor's Triton
    ``triton_*``, whose name lists the ops it fused) is a fusion already: 0."""
    code = np.where(name_matches(names, POINTWISE), -1, 0).astype(np.int8)
    for i, (_, _, pattern) in enumerate(FUSION_FLAGS):
        code[name_matches(names, re.compile(f".*(?:{pattern})")) & (code <= 0)] = i + 1
    code[name_matches(names, COMPILED)] = 0
    return code


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> ComputeResult:
    comp = sets.compute_ops
    r = ComputeResult(compute_ns=iv.total(sets.compute),
                      gemm_ns=iv.total(clipped_set(comp[comp["is_gemm"]], sets.lo, sets.hi)),
                      exposed_copy_ns=iv.total(iv.subtract(sets.copies, sets.compute_or_comm)),
                      fp8_kernels=int(sets.kernels["is_fp8"].sum()))
    r.fusible_ns = _clipped_ns(comp[fusion_codes(comp["full_name"]) > 0], sets.lo, sets.hi)
    r.per_step_kernel_ns = _clipped_ns(comp[name_matches(comp["name"], PER_STEP_KERNELS)], sets.lo, sets.hi)
    r.norm_rows = norm_rows(comp)
    _utilisation(r, gpu, prof, sets)
    return r


def norm_rows(comp) -> int:
    """The median grid of the window's forward normalisation kernels (``NORM_FORWARD``): the
    rows one launch normalises, the tokens of a micro-batch on this GPU (per TP rank with sequence
    parallelism), for PyTorch's kernels exactly, for Transformer Engine's in proportion; q/k norms
    (rows x heads) scale with them. 0 where the window has none or the export no grids."""
    grid = comp["grid"].to_numpy(np.int64)[name_matches(comp["full_name"], NORM_FORWARD)]
    grid = grid[grid > 0]
    return int(np.median(grid)) if len(grid) else 0


def _clipped_ns(ops, lo: int, hi: int) -> int:
    """Summed duration of these kernels inside [lo, hi] (overlaps counted once per kernel)."""
    return int((np.minimum(ops["end"], hi) - np.maximum(ops["start"], lo)).clip(lower=0).sum())


def _utilisation(r: ComputeResult, gpu, prof, sets: WindowSets) -> None:
    comp, lo, hi = sets.compute_ops, sets.lo, sets.hi
    sm_count = sm_count_of(gpu, prof)
    busy = r.compute_ns
    grid = comp["grid"].to_numpy()
    known = grid > 0  # 0: the export has no (or damaged) grid dimensions
    if sm_count and busy and known.any():
        # occupancy proxy: share of SMs a kernel's grid can cover, weighted by kernel time,
        # over the window (idle and exposed communication count as 0)
        dur = (np.minimum(comp["end"], hi) - np.maximum(comp["start"], lo)).clip(lower=0).to_numpy()[known]
        cover = np.minimum(1.0, grid[known] / sm_count)
        r.sm_active_estimate = float((dur * cover).sum() / max(dur.sum(), 1)) * busy / max(hi - lo, 1)
        r.sm_active = r.sm_active_estimate
        r.sm_active_source = "estimate: grid size vs SM count, weighted by kernel time"
    gm = prof.gpu_metrics
    if not gm.empty:
        dev = gm[(gm["device"] == _metric_device(gpu, prof)) & (gm["timestamp"] >= lo) & (gm["timestamp"] < hi)]
        sm = dev[dev["metric"] == "sm_active"]["value"]
        if len(sm):
            r.sm_active = float(sm.mean()) / 100.0
            r.sm_active_source = "GPU_METRICS SMs Active (mean over the window)"
            ta = dev[dev["metric"] == "tensor_active"]["value"]
            r.tensor_active = float(ta.mean()) / 100.0 if len(ta) else None


def sm_count_of(gpu, prof) -> int:
    """The GPU's SMs as the export's TARGET_INFO_GPU gives them; 0 where it does not."""
    g = prof.gpus[prof.gpus["device"] == gpu.device]
    return int(g["sm_count"].iloc[0]) if len(g) and g["sm_count"].iloc[0] > 0 else 0


def _metric_device(gpu, prof) -> int:
    # GPU metrics number sources 0..n-1; with one GPU in the report that is this GPU
    devs = sorted(prof.kernels["device"].unique())
    return devs.index(gpu.device) if gpu.device in devs else 0


# ---------------------------------------------------------------------------------------------
# job level

# gain models (ms per step) from the job numbers; see docs/fixes.md
def _fp8(n: dict):
    g = n["gemm_ms"]
    return gain("fp8_measured", g * (1 - 1 / FP8_SPEEDUP), g * (1 - 1 / FP8_SPEEDUP_LOW),
                g * (1 - 1 / FP8_SPEEDUP_HIGH), g,
                f"GEMM time {g:.1f} ms/step x (1 - 1/{FP8_SPEEDUP}) (measured end-to-end FP8 speed-up)")


GAINS = {
    # grouped GEMM fills the SMs small grids leave idle; half of it, the tail still leaves some
    "compute_low_sm": lambda n: share_of("compute_low_sm", n["compute_ms"] * max(0.0, 1.0 - n["sm_busy"]),
                                         0.5, 0.0, 1.0, "compute time with SMs unfilled"),
    "fusion_families": lambda n: share_of("fusion_families", n["fusible_ms"], FUSION_SAVES, FUSION_SAVES / 2,
                                          1.0, "time of the kernels the named fusions replace"),
    "fp8_measured": _fp8,
}

def numbers(job: Job) -> dict:
    comp_ms = mean_per_step_ms(job, lambda a: a.compute.compute_ns)
    gemm_ms = mean_per_step_ms(job, lambda a: a.compute.gemm_ns)
    sm_busy = []
    for rec in job.records:
        c, window_ns = rec.analysis.compute, rec.analysis.window.window_ns
        if c.sm_active is not None and c.compute_ns:
            sm_busy.append(min(1.0, c.sm_active * window_ns / c.compute_ns))
    return dict(compute_ms=comp_ms, gemm_ms=gemm_ms, elementwise_ms=max(0.0, comp_ms - gemm_ms),
                fusible_ms=mean_per_step_ms(job, lambda a: a.compute.fusible_ns),
                per_step_kernel_ms=mean_per_step_ms(job, lambda a: a.compute.per_step_kernel_ns),
                sm_busy=float(np.mean(sm_busy)) if sm_busy else 1.0)


def facts(job: Job, numbers: dict) -> dict:
    kern_per_step = np.mean([r.analysis.host.kernels / r.iterations for r in job.records])
    return dict(many_small_gemms=bool(numbers["sm_busy"] < SMALL_GEMMS_SM_BUSY
                                      or kern_per_step > SMALL_GEMMS_KERNELS_PER_STEP))


def evidence(job: Job, numbers: dict) -> list[dict]:
    ev = [evidence_row("compute", "compute kernels", numbers["compute_ms"], "ms/step",
                       "union of compute kernel time"),
          evidence_row("compute", "GEMM kernels", numbers["gemm_ms"], "ms/step", "GEMM-type kernels")]
    sm = [r.analysis.compute.sm_active for r in job.records if r.analysis.compute.sm_active is not None]
    if sm:
        ev.append(evidence_row("compute", "SM active", float(np.mean(sm)), "fraction",
                               job.records[0].analysis.compute.sm_active_source))
    return ev


ANALYZER = Analyzer(name="compute", about="compute kernels, GEMMs, SM utilisation and the other exposed copies",
                    per_gpu_field="compute", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    gains=GAINS)
