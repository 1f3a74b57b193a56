"""Kernel taxonomy: which library and collective a kernel belongs to, and what else its name says.

The tables below are the data; ``classify_kernels`` applies them once per *distinct* kernel
name (a profile has thousands of names but millions of kernels) and broadcasts the result.
Counting only "nccl" as communication misses DeepEP, HybridEP and NVSHMEM kernels, so each
library has its own pattern, matched against the demangled name (DeepEP's short names are
just ``dispatch``/``combine``).
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

# (library, pattern on the demangled name); first match wins
COMM_LIBRARIES = [
    ("deepep", re.compile(r"deep_ep::|deepep", re.I)),
    # Transformer Engine's userbuffers: Megatron's --tp-comm-overlap moves TP's all-gather /
    # reduce-scatter out of NCCL into these (they spin while they wait, like DeepEP's)
    ("userbuffers", re.compile(r"userbuffers", re.I)),
    ("hybridep", re.compile(r"hybrid_?ep", re.I)),
    ("nccl", re.compile(r"^nccl|\bnccl(Dev)?Kernel|ncclKernel", re.I)),
    ("nvshmem", re.compile(r"nvshmem", re.I)),
]
# (collective, pattern); all-to-all covers NCCL SendRecv (PyTorch's all_to_all_single) and
# the dispatch/combine kernels of DeepEP and HybridEP
COLLECTIVES = [
    ("all_reduce", re.compile(r"AllReduce|all_reduce", re.I)),
    ("all_gather", re.compile(r"AllGather|all_gather", re.I)),
    ("reduce_scatter", re.compile(r"ReduceScatter|reduce_scatter", re.I)),
    ("broadcast", re.compile(r"Broadcast", re.I)),
    ("all_to_all", re.compile(r"SendRecv|AllToAll|all_to_all|alltoall|dispatch|combine|Send|Recv", re.I)),
    ("reduce", re.compile(r"Reduce", re.I)),
]
# userbuffers kernels name their collective by suffix (..._rs, ..._ag, ..._rs_oop); the
# ring-exchange ones (kuserbuffers_pushsendrecv, ...) serve both, so they stay "other" rather
# than match "Send|Recv" and pass for an EP/PP SendRecv
LIBRARY_COLLECTIVES = {"userbuffers": [("reduce_scatter", re.compile(r"_rs(?![a-z0-9])|reduce_scatter", re.I)),
                                       ("all_gather", re.compile(r"_ag(?![a-z0-9])|all_gather", re.I))]}
COLLECTIVE_TYPES = ["all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                    "reduce", "other"]
# which parallelism group a collective usually serves in Megatron-style MoE training
COLLECTIVE_GROUP = {"all_to_all": "EP", "all_reduce": "DP", "reduce_scatter": "DP",
                    "all_gather": "DP", "broadcast": "other", "reduce": "other", "other": "other"}

# kernels of the once-per-step optimizer work: PyTorch's foreach and fused optimizers, Apex's and
# Transformer Engine's fused Adam, and the gradient norm before them all run as
# multi_tensor_apply kernels (a forward or a backward launches none)
OPTIMIZER_KERNEL = ("multi_tensor_apply", "multi_tensor_adam")
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|_h?mma_|sm\d\d_.*tilesize|Kernel2$", re.I)
ATTENTION = re.compile(r"flash|fmha|sdpa|attn|attention", re.I)
FP8 = re.compile(r"fp8|e4m3|e5m2|f8f6f4|qmma|mxf8|nvfp4", re.I)
# grouped GEMMs: CUTLASS 3's grouped problem shape (torch._grouped_mm, TE's and Megatron's
# grouped MLPs) and the grouped_gemm package's kernels
GROUPED_GEMM = re.compile(r"GroupProblemShape|grouped_?gemm|grouped_mm", re.I)
# Forward/backward kernel pairs: with activation recompute the forward member runs more often
# than the backward one (twice per layer under full recompute).
FWD_BWD_PAIRS = [
    ("attention", re.compile(r"flash_fprop|flash_fwd|fmha.*fwd|fprop.*sdpa|sdpa.*fprop|attn_fwd", re.I),
     re.compile(r"flash_bprop|flash_bwd|fmha.*bwd|bprop.*sdpa|sdpa.*bprop|attn_bwd", re.I)),
    ("layer_norm", re.compile(r"(?<!grad_input_kernel)(layer_norm_kernel|LayerNormForward|"
                              r"rms_?norm.*f(or)?w(ar)?d|RowwiseMoments)", re.I),
     re.compile(r"layer_norm_grad_input|LayerNormBackward|rms_?norm.*b(ack)?w(ar)?d|"
                r"compute_internal_gradients", re.I)),
    ("softmax", re.compile(r"SoftMaxForward|softmax_warp_forward|scaled_masked_softmax_warp_forward", re.I),
     re.compile(r"SoftMaxBackward|softmax_warp_backward|scaled_masked_softmax_warp_backward", re.I)),
    ("gelu", re.compile(r"GeluCUDAKernelImpl|gelu_kernel|GeluForward", re.I),
     re.compile(r"GeluBackward|gelu_backward", re.I)),
    ("silu", re.compile(r"silu_kernel|SiLUKernel|swiglu(?!.*back)", re.I),
     re.compile(r"silu_backward|SiLUBackward|swiglu.*back|dswiglu", re.I)),
]


def _first(patterns, name: str, default: str) -> str:
    for label, pat in patterns:
        if pat.search(name):
            return label
    return default


def _collective(library: str, full_name: str) -> str:
    if library in LIBRARY_COLLECTIVES:  # matched on the function's name, not its argument list
        return _first(LIBRARY_COLLECTIVES[library], full_name.split("(", 1)[0], "other")
    return _first(COLLECTIVES, full_name, "other")


def describe_name(full_name: str) -> dict:
    """Everything the taxonomy says about one kernel name."""
    library = _first(COMM_LIBRARIES, full_name, "")
    pair, side = "", ""
    for label, fwd, bwd in FWD_BWD_PAIRS:
        if bwd.search(full_name):
            pair, side = label, "bwd"
            break
        if fwd.search(full_name):
            pair, side = label, "fwd"
            break
    return {
        "is_comm": bool(library),
        "library": library,
        "collective": _collective(library, full_name) if library else "",
        # attention kernels use the same tensor-core instructions (wgmma) but are not GEMMs
        "is_gemm": bool(GEMM.search(full_name)) and not library and not ATTENTION.search(full_name),
        "is_fp8": bool(FP8.search(full_name)),
        "pair": pair,
        "side": side,
    }


def classify_kernels(kernels: pd.DataFrame) -> pd.DataFrame:
    """Add is_comm, library, collective, is_gemm, is_fp8, pair, side columns to ``kernels``."""
    names = kernels["full_name"].astype("category")
    table = pd.DataFrame([describe_name(str(n)) for n in names.cat.categories])
    codes = names.cat.codes.to_numpy()
    out = kernels.copy()
    if table.empty:
        for col, dtype in (("is_comm", bool), ("library", object), ("collective", object),
                           ("is_gemm", bool), ("is_fp8", bool), ("pair", object), ("side", object)):
            out[col] = pd.Series(dtype=dtype)
        return out
    for col in table.columns:
        out[col] = table[col].to_numpy()[codes] if len(codes) else np.array([], dtype=table[col].dtype)
    return out


def collective_name(collective: str, group: str | None = None) -> str:
    """A collective's name for a reader: NCCL's SendRecv kernel inside the PP group is the
    pipeline's send/recv, not an all-to-all (the kernel, and so the type, is the same)."""
    return "send/recv" if group == "PP" and collective == "all_to_all" else collective


def collective_label(collective: str, group: str | None = None) -> str:
    """The name with its group, for rows that have no group column: "PP send/recv",
    "all_to_all (EP)"."""
    if group == "PP" and collective == "all_to_all":
        return "PP send/recv"
    return f"{collective} ({group})" if group else collective
