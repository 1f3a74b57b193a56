"""What the run's configuration was, from the profile itself: the captured command line and
environment (META_DATA_CAPTURE) and what the kernels show. Every item keeps its source."""
from __future__ import annotations

import re

import pandas as pd

from .load import RawProfile

# MoE evidence in kernel names: the router's top-k, the token permutation, DeepEP/HybridEP; a
# dense model (mcore_dense_*) runs none of them
MOE_KERNEL = re.compile(r"topk|permute|moe_|deep_ep|hybrid_?ep|router", re.I)
# a training step: backward kernels (autograd's *Backward, attention bprop, dgrad/wgrad GEMMs)
# or an optimizer's (Adam, multi_tensor_apply); an inference pass or a solver runs neither
TRAINING_KERNEL = re.compile(r"backward|bwd|bprop|dgrad|wgrad|adam|multi_tensor_apply|optimizer", re.I)
HOPPER = re.compile(r"H100|H200|H800|H20\b|GH200", re.I)
NVL72 = re.compile(r"GB200|GB300", re.I)
BLACKWELL = re.compile(r"B200|B100|B300|RTX PRO 6000", re.I)
# a Hydra/OmegaConf override on a launch line: Megatron-Bridge's ``section.key=value``
# (``train.manual_gc=true``), NeMo's ``trainer.strategy.key=value``; a leading + or ++ adds a key
OVERRIDE_ARG = re.compile(r"^\+{0,2}(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)=(.*)$")
# Bridge's config fields are Megatron-LM's argument names (``--manual-gc`` is ``train.manual_gc``);
# those named otherwise, from Bridge's "Megatron-LM to Megatron Bridge" mapping (docs/diff.md)
RENAMED_FIELDS = {"fp8": "--fp8-format", "num_moe_experts": "--num-experts", "gated_linear_unit": "--swiglu",
                  "sequence_length": "--seq-length", "use_nsys_profiler": "--profile"}


def parse_flags(command: list[str]) -> dict[str, str | bool]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` from a command line."""
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(command):
        tok, nxt = command[i], command[i + 1] if i + 1 < len(command) else None
        if tok.startswith("--"):
            if "=" in tok:
                k, v = tok.split("=", 1)
                flags[k] = v
            # a Hydra override after a switch is an override, not the switch's value
            elif nxt is not None and not nxt.startswith("--") and not OVERRIDE_ARG.match(nxt):
                flags[tok] = nxt
                i += 1
            else:
                flags[tok] = True
        i += 1
    return flags


def parse_overrides(command: list[str]) -> dict[str, str | bool]:
    """Hydra/OmegaConf overrides on a command line as the Megatron-LM flags they set: the key's
    last part with dashes (``ddp.overlap_grad_reduce=true`` is ``--overlap-grad-reduce``,
    ``RENAMED_FIELDS`` otherwise). ``true`` is a switch set; ``false`` and ``null`` leave the
    flag absent, as a switch not given (readers test a switch by its presence); other values as
    written. A later override of the same key wins."""
    out: dict[str, str | bool] = {}
    for m in filter(None, map(OVERRIDE_ARG.match, command)):
        key, value = m.groups()
        flag, low = RENAMED_FIELDS.get(key) or "--" + key.replace("_", "-"), value.strip("'\"").lower()
        out.pop(flag, None)
        if low not in ("false", "null", "none", "~"):
            out[flag] = True if low == "true" else value
    return out


def platform(gpu_name: str) -> str:
    if NVL72.search(gpu_name):
        return "nvl72"
    if BLACKWELL.search(gpu_name):
        return "blackwell"
    if HOPPER.search(gpu_name):
        return "hopper"
    return "other"


# the ``config`` items ``run_flags`` reads: the launch line's flags and its overrides
RUN_FLAG_ITEMS = ("command_line_flags", "config_overrides")


def run_flags(cfg: dict) -> dict:
    """The run's settings as Megatron-LM flags (flag -> value) from a ``config`` section
    (``derive``'s, or a stored diagnosis's): the launch line's flags, and its Hydra overrides
    (``config_overrides``) where no flag says the same; empty when neither was captured."""
    flags = (cfg.get("command_line_flags") or {}).get("value") or {}
    return {**((cfg.get("config_overrides") or {}).get("value") or {}), **flags}


def item(value, source: str) -> dict:
    return {"value": value, "source": source}


def derive(profiles: list[RawProfile], ops: pd.DataFrame, n_gpus: int, recompute_ratio: float,
           cuda_graphs: bool, ep_size: int | None = None, moe_router: bool = True,
           kernel_names: pd.Series | None = None, ep_source: str | None = None) -> dict[str, dict]:
    """The ``config`` section: one entry per setting, each with where it was seen.
    ``kernel_names``: the distinct kernel names of the job (the ``moe`` and ``scope`` items);
    ``ep_source``: where the layout's EP size came from ("inferred" from the traffic, or flags)."""
    cfg: dict[str, dict] = {}
    flags: dict[str, str | bool] = {}
    overrides: dict[str, str | bool] = {}
    env: dict[str, str] = {}
    for p in profiles:
        flags.update(parse_flags(p.command))
        overrides.update(parse_overrides(p.command))
        env.update(p.env)
    if flags:
        cfg["command_line_flags"] = item({k: v for k, v in flags.items()}, "META_DATA_CAPTURE command line")
    if overrides:
        cfg["config_overrides"] = item(overrides, "META_DATA_CAPTURE command line: Hydra overrides (section.key=value) "
                                                  "as the Megatron-LM flags they set")
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "CUDA_DEVICE_MAX_CONNECTIONS",
                "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "PYTORCH_CUDA_ALLOC_CONF", "NVTE_FLASH_ATTN"):
        if var in env:
            cfg[var] = item(env[var], "META_DATA_CAPTURE environment")
    names = [str(n) for g in profiles for n in g.gpus["name"].unique()]
    gpu = names[0] if names else ""
    cfg["gpu"] = item(gpu or "unknown", "TARGET_INFO_GPU" if gpu else "not in profile")
    cfg["platform"] = item(platform(gpu), "GPU name")
    cfg["gpus_in_job"] = item(n_gpus, "kernel activity per (process, device)")
    disp, src = _dispatcher(ops[ops["is_comm"]], n_gpus, ep_size, moe_router)
    said = run_flags(cfg)  # the flags and overrides just stored: a flag wins over an override of one setting
    source = lambda flag: "command line" if flag in flags else "command line (Hydra override)"  # noqa: E731
    flag_disp = said.get("--moe-token-dispatcher-type")
    if isinstance(flag_disp, str):
        cfg["moe_token_dispatcher_type"] = item(flag_disp, source("--moe-token-dispatcher-type"))
    cfg["dispatcher"] = item(disp, src)
    if ep_size:
        cfg["expert_parallel"] = item(ep_size > 1, "the layout's EP size")
    else:
        cfg["expert_parallel"] = item(bool(n_gpus > 1 and disp != "none"), "expert token exchange between GPUs")
    names = kernel_names if kernel_names is not None else pd.Series([], dtype=str)
    cfg["moe"] = _moe(disp, ep_size if ep_source != "inferred" or moe_router else None, names)
    cfg["scope"] = _scope(names)
    cfg["cuda_graphs"] = item(bool(cuda_graphs), "cudaGraphLaunch calls / graph kernels")
    cfg["cuda_graph_trace"] = _graph_trace(bool(cuda_graphs), names)
    cfg["fp8"] = item(bool(ops["is_fp8"].any()), "FP8 GEMM kernel names")
    cfg["recompute"] = item("full" if recompute_ratio >= 0.5 else ("partial" if recompute_ratio >= 0.05 else "none"),
                            f"forward/backward kernel pairs (ratio {recompute_ratio:.2f})")
    for flag, key in (("--recompute-granularity", "recompute_granularity"),
                      ("--expert-model-parallel-size", "expert_model_parallel_size"),
                      ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                      ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                      ("--context-parallel-size", "context_parallel_size"),
                      ("--seq-length", "seq_length")):
        if said.get(flag) is not None:
            cfg[key] = item(said[flag], source(flag))
    return cfg


def _dispatcher(comm: pd.DataFrame, n_gpus: int, ep_size: int | None, moe_router: bool) -> tuple[str, str]:
    """The token dispatcher the communication kernels show, and why."""
    libs = set(comm["library"].astype(str))
    colls = set(comm["collective"].astype(str))
    if "hybridep" in libs:
        return "hybridep", "HybridEP kernels"
    if "deepep" in libs:
        return "deepep", "DeepEP kernels (deep_ep::)"
    if ep_size == 1 or not moe_router:
        # SendRecv is then the pipeline's, all-gathers TP's or the optimizer's
        return "none", ("the layout's EP size is 1" if ep_size == 1 else "no MoE router (top-k) kernels")
    if "all_to_all" in colls:
        return "alltoall", "NCCL all-to-all / SendRecv kernels"
    if "all_gather" in colls and n_gpus > 1:
        return "allgather", "NCCL all-gather kernels, no all-to-all"
    return "none", "no expert-parallel communication kernels"


def _moe(dispatcher: str, ep_size: int | None, names: pd.Series) -> dict:
    """Whether the profile shows a mixture-of-experts model: expert-parallel dispatch (EP > 1,
    DeepEP/HybridEP) or MoE kernels (router top-k, token permutation). ``ep_size``: None where
    EP was only inferred from SendRecv partners with no router kernels (a solver's halo
    exchange between two ranks of one program looks the same)."""
    if dispatcher in ("deepep", "hybridep"):
        return item(True, f"{dispatcher} dispatcher kernels")
    if ep_size and ep_size > 1:
        return item(True, f"the layout's EP size ({ep_size})")
    hits = names[names.str.contains(MOE_KERNEL)] if len(names) else names
    if len(hits):
        return item(True, f"MoE kernels ({len(hits)} names, e.g. {str(hits.iloc[0])[:60]})")
    return item(False, "no router (top-k), token permutation or expert-dispatch kernels, EP not over 1")


def _graph_trace(cuda_graphs: bool, names: pd.Series) -> dict:
    """How CUDA graphs were traced: ``graph`` (nsys's default: one row per graph launch, the
    kernels inside unseen), ``node`` (``--cuda-graph-trace=node``: every kernel, with its graph
    node id), or ``none`` (no graphs)."""
    from .load.tables import GRAPH_LAUNCH_NAME

    if len(names) and names.str.startswith(GRAPH_LAUNCH_NAME).any():
        return item("graph", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE rows: graph launches, not their kernels")
    if cuda_graphs:
        return item("node", "kernels with a graph node id (--cuda-graph-trace=node)")
    return item("none", "no graph launches")


def graph_trace_missing(cfg: dict[str, dict]) -> list[str]:
    """The ``missing[]`` note of a graph-level trace."""
    if (cfg.get("cuda_graph_trace") or {}).get("value") != "graph":
        return []
    return ["kernels inside CUDA graphs: traced at graph level (nsys's default), each graph launch is one GPU work "
            "item counted as compute; which kernels and collectives run inside is not visible (capture with "
            "--cuda-graph-trace=node)"]


def _scope(names: pd.Series) -> dict:
    """``training``: a training step (backward or optimizer kernels), what the walls, fixes and
    gain models are built for; ``other`` (inference, a solver, a capture without backward)."""
    if len(names) and names.str.contains(TRAINING_KERNEL).any():
        return item("training", "backward or optimizer kernels")
    from .load.tables import GRAPH_LAUNCH_NAME

    if len(names) and names.str.startswith(GRAPH_LAUNCH_NAME).any():
        # the step's kernels are inside graphs traced at graph level: nothing tells either way
        return item("training", "assumed: the kernels inside the CUDA graphs are not visible (graph-level trace)")
    return item("other", "no backward or optimizer kernels: not a training step")


def scope_missing(cfg: dict[str, dict]) -> list[str]:
    """The ``missing[]`` note of a profile that is not a training step profclass knows."""
    scope = cfg.get("scope") or {}
    if scope.get("value", "training") == "training":
        return []
    return [f"scope: not a training step ({scope['source']}); the walls and the verdict stand, the advice is "
            "limited to fixes that apply to any CUDA program (no MoE, parallelism, recompute or optimizer fixes)"]


def config_facts(cfg: dict[str, dict]) -> dict:
    """The configuration as the named facts ``data/fixes.toml`` tests."""
    return dict(ep=cfg["expert_parallel"]["value"], dispatcher=cfg["dispatcher"]["value"],
                platform=cfg["platform"]["value"], cuda_graphs=cfg["cuda_graphs"]["value"],
                fp8=cfg["fp8"]["value"], recompute=cfg["recompute"]["value"] == "full",
                moe=cfg["moe"]["value"] if "moe" in cfg else True,
                scope=cfg["scope"]["value"] if "scope" in cfg else "training",
                launched_with_overrides=launched_with_overrides(cfg))


def launched_with_overrides(cfg: dict) -> bool:
    """Whether the launch line set Hydra overrides (a Bridge recipe, NeMo): advice is then told as
    overrides (``fixes[].overrides``, ``pitfalls[].overrides``)."""
    return "config_overrides" in cfg
