"""Analyzer: the job's parallel layout (TP, CP, EP, ETP, DP, EDP, PP sizes) and the member
ranks of each group.

Sizes come from the captured command line: Megatron-LM flags (``--tensor-model-parallel-size``)
or Hydra overrides (Megatron-Bridge's ``model.tensor_model_parallel_size=2``, NeMo's
``trainer.strategy.tensor_model_parallel_size=2``: ``config.OVERRIDE_ARG``). Where neither is
captured (or reading it is turned off, ``PROFCLASS_IGNORE_COMMAND_LINE=1``), the TP, PP and
EP sizes are inferred from who runs collectives with whom (``layout_infer``).

Group membership follows Megatron-Core's ``parallel_state``: dense ranks are ordered
``tp-cp-ep-dp-pp`` (TP fastest; EP is 1 in the dense generator), expert ranks ``tp-ep-dp-pp``
with ETP, EP and the expert DP (EDP = world / (ETP * EP * PP)) and CP = 1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..config import OVERRIDE_ARG

SIZES = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "microbatches")
BRIDGE = "bridge overrides"  # the source of a size a Hydra override gave
UNDETERMINED = "not determined"  # the source of a size the traffic cannot tell (then null)
# the source of a size no override names, where one rank's traffic cannot tell it: Megatron-Bridge's
# model default (1); a recipe may set it otherwise in Python (``layout_infer.with_overrides``)
BRIDGE_DEFAULT = "bridge default (not on the launch line)"
# Megatron-LM flag and Hydra override key (its last part) of each size
FLAGS = {"tp": "--tensor-model-parallel-size", "cp": "--context-parallel-size",
         "pp": "--pipeline-model-parallel-size", "vpp": "--virtual-pipeline-model-parallel-size",
         "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
         "microbatches": "--num-microbatches"}
OVERRIDES = {"tp": "tensor_model_parallel_size", "cp": "context_parallel_size",
             "pp": "pipeline_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size",
             "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
# dense and expert rank orders of parallel_state (fastest first)
DENSE_ORDER = ("tp", "cp", "dp", "pp")
EXPERT_ORDER = ("etp", "ep", "edp", "pp")
GROUP_AXES = {"TP": ("dense", "tp"), "CP": ("dense", "cp"), "DP": ("dense", "dp"), "PP": ("dense", "pp"),
              "EP": ("expert", "ep"), "ETP": ("expert", "etp"), "EDP": ("expert", "edp")}


@dataclass
class Layout:
    world: int | None = None
    sizes: dict = field(default_factory=dict)  # size name -> int or None (unknown)
    source: dict = field(default_factory=dict)  # size name -> "command line" | "bridge overrides" | "inferred" | None
    # GPUs per node (LOCAL_WORLD_SIZE, else torchrun's --nproc-per-node): with Megatron's order
    # TP is the innermost group, so TP <= this keeps it on one node's NVLink
    gpus_per_node: int | None = None
    # what the traffic showed (layout_infer), for guessing groups where no size is known: the
    # collective types issued per layer, and whether a MoE router ran
    per_layer: set = field(default_factory=set)
    moe_router: bool = False
    # the world is the GPUs in the profile (no WORLD_SIZE, no torchrun sizes captured): right
    # only when every rank is in it
    world_from_gpus: bool = False
    # the micro and global batch sizes a command line gave (``fill`` derives the micro-batch
    # count from them once DP is known, which under Bridge overrides may be after the traffic)
    batch: dict = field(default_factory=dict)

    def size(self, name: str) -> int | None:
        return self.sizes.get(name)

    def complete(self) -> bool:
        """Every group size needed for membership is known and they multiply to the world."""
        s = self.sizes
        need = ("tp", "cp", "pp", "dp", "ep", "etp", "edp")
        return bool(self.world) and all(s.get(k) for k in need) and \
            s["tp"] * s["cp"] * s["pp"] * s["dp"] == self.world == s["etp"] * s["ep"] * s["edp"] * s["pp"]

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """Each group's member ranks for one global rank (empty when the layout is incomplete)."""
        if not self.complete() or rank is None or not 0 <= rank < self.world:
            return {}
        return {name: _members(self.sizes, rank, *axes) for name, axes in GROUP_AXES.items()}

    def to_dict(self) -> dict:
        return dict(world=self.world, sizes={k: self.sizes.get(k) for k in SIZES},
                    source={k: self.source.get(k) for k in SIZES},
                    order="tp-cp-ep-dp-pp", expert_order="tp-ep-dp-pp (ETP, EP, EDP)")


def _members(sizes: dict, rank: int, generator: str, axis: str) -> list[int]:
    """Ranks sharing every coordinate of ``rank`` but ``axis`` (parallel_state's masked groups)."""
    order = DENSE_ORDER if generator == "dense" else EXPERT_ORDER
    shape = [sizes[a] for a in reversed(order)]  # C order: slowest axis first
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    coord = list(np.unravel_index(rank, shape))
    coord[list(reversed(order)).index(axis)] = slice(None)
    return [int(r) for r in grid[tuple(coord)]]


def _int(v) -> int | None:
    try:
        return int(str(v))
    except ValueError:
        return None


def read_command_line(flags: dict, command: list[str]) -> tuple[dict, dict]:
    """Sizes found on the command line: Megatron-LM flags, then Bridge overrides."""
    sizes, source = {}, {}
    for name, flag in FLAGS.items():
        if isinstance(flags.get(flag), str) and _int(flags[flag]):
            sizes[name], source[name] = _int(flags[flag]), "command line"
    per_stage = _int(flags.get("--num-layers-per-virtual-pipeline-stage", "") or "")
    layers, pp = _int(flags.get("--num-layers", "") or ""), sizes.get("pp")
    if "vpp" not in sizes and per_stage and layers and pp:
        sizes["vpp"], source["vpp"] = layers // (pp * per_stage), "command line"
    overrides = {m.group(1): m.group(2) for m in map(OVERRIDE_ARG.match, command) if m}
    for name, key in OVERRIDES.items():
        if name not in sizes and _int(overrides.get(key, "")):
            sizes[name], source[name] = _int(overrides[key]), BRIDGE
    for key, flag in (("micro_batch_size", "--micro-batch-size"), ("global_batch_size", "--global-batch-size")):
        v = _int(overrides.get(key, "")) or _int(flags.get(flag, "") or "")
        if v:
            sizes[key] = v
    return sizes, source


def world_size(flags: dict, env: dict, n_gpus: int) -> int | None:
    """The job's world size: the captured WORLD_SIZE, else torchrun's ``--nproc-per-node`` x
    ``--nnodes``, else the GPUs seen (only right when every rank is in the profile)."""
    if _int(env.get("WORLD_SIZE", "") or ""):
        return _int(env["WORLD_SIZE"])
    nproc, nnodes = _int(flags.get("--nproc-per-node", flags.get("--nproc_per_node", "")) or ""), \
        _int(flags.get("--nnodes", "1") or "1")
    if nproc:
        return nproc * (nnodes or 1)
    return n_gpus


def build(flags: dict, command: list[str], env: dict, n_gpus: int) -> Layout:
    """The layout from the command line, completed by Megatron's defaults and derived sizes.
    Unknown sizes stay None; ``PROFCLASS_IGNORE_COMMAND_LINE=1`` ignores the command line and
    environment (the inference path)."""
    if os.environ.get("PROFCLASS_IGNORE_COMMAND_LINE") == "1":
        flags, command, env = {}, [], {}
    sizes, source = read_command_line(flags, command)
    layout = Layout(world_size(flags, env, n_gpus), sizes, source)
    layout.world_from_gpus = world_size(flags, env, 0) == 0
    layout.gpus_per_node = _int(env.get("LOCAL_WORLD_SIZE", "") or "") or \
        _int(flags.get("--nproc-per-node", flags.get("--nproc_per_node", "")) or "")
    fill(layout)
    return layout


def tp_within_node(layout: Layout) -> bool:
    """TP ranks share one node (and so its NVLink domain): consecutive ranks, TP innermost."""
    tp, per_node = layout.size("tp"), layout.gpus_per_node
    return bool(tp and per_node and tp <= per_node and per_node % tp == 0)


def fill(layout: Layout) -> None:
    """Megatron's defaults and derived sizes: TP/CP/PP/EP/VPP default to 1 when the sizes came
    from Megatron-LM's flags (its own defaults; Bridge overrides leave the sizes they do not name
    to the traffic: a recipe sets them in Python, ``layout_infer.with_overrides``), ETP to TP, DP
    and EDP from the world, micro-batches from global / (micro x DP)."""
    s, src = layout.sizes, layout.source
    origin = "command line" if "command line" in src.values() else None
    for name in ("tp", "cp", "pp", "vpp", "ep"):
        if s.get(name) is None and origin:
            s[name], src[name] = 1, origin
    if s.get("etp") is None and s.get("tp"):
        s["etp"], src["etp"] = s["tp"], src.get("tp")
    w = layout.world
    if w and all(s.get(k) for k in ("tp", "cp", "pp")) and w % (s["tp"] * s["cp"] * s["pp"]) == 0:
        s["dp"], src["dp"] = w // (s["tp"] * s["cp"] * s["pp"]), src.get("pp")
    if w and all(s.get(k) for k in ("etp", "ep", "pp")) and w % (s["etp"] * s["ep"] * s["pp"]) == 0:
        s["edp"], src["edp"] = w // (s["etp"] * s["ep"] * s["pp"]), src.get("ep")
    layout.batch.update({k: s.pop(k) for k in ("micro_batch_size", "global_batch_size") if k in s})
    mbs, gbs = layout.batch.get("micro_batch_size"), layout.batch.get("global_batch_size")
    s.pop("num_layers", None)
    if s.get("microbatches") is None and mbs and gbs and s.get("dp"):
        s["microbatches"], src["microbatches"] = gbs // (mbs * s["dp"]), src.get("dp")
    for k in SIZES:
        s.setdefault(k, None)
        src.setdefault(k, None)


def with_overrides(layout: Layout, told: dict, ran: bool) -> None:
    """The sizes Hydra overrides named (``told``: size -> (value, source)) over the traffic's
    reading. A size the traffic read that, with them, no longer fits the world is not
    determined. Where the traffic was not read (``ran`` False: one rank in the profile), the
    sizes no override names take Megatron-Bridge's model defaults (TP, CP, PP, EP and VPP 1,
    source ``BRIDGE_DEFAULT``: a recipe may set them otherwise in Python, and ``missing[]`` says
    so); where it was, VPP is left to the forward passes and the PP exchanges."""
    s, src = layout.sizes, layout.source
    for k, (v, how) in told.items():
        s[k], src[k] = v, how
    for k in ("dp", "edp"):  # derived again from the merged sizes
        s[k], src[k] = None, None
    w = layout.world
    for group in (("tp", "cp", "pp"), ("etp", "ep", "pp")):
        if w and all(s.get(k) for k in group) and w % int(np.prod([s[k] for k in group])):
            for k in (k for k in group if src.get(k) == "inferred"):
                s[k], src[k] = None, f"{UNDETERMINED}: the traffic's reading does not fit the world with the " \
                                     "launch line's overrides"
    for k in ("tp", "cp", "pp", "ep", "vpp"):
        if not ran and s.get(k) is None:
            s[k], src[k] = 1, BRIDGE_DEFAULT
    fill(layout)


def missing(job) -> list[str]:
    """What the layout could not see: sizes nobody gave, ranks outside the profile."""
    lay, out = job.layout, []
    unknown = [k for k in ("tp", "pp", "ep", "dp") if lay.size(k) is None]
    if unknown:
        out.append(f"parallel layout: {', '.join(unknown).upper()} size unknown (no Megatron flags or Bridge "
                   "overrides captured); collectives are grouped by their type, those a dense model issues in every layer as TP")
    why = sorted({v for v in lay.source.values() if isinstance(v, str) and v.startswith(UNDETERMINED)})
    out += [f"parallel layout: {w}" for w in why]
    assumed = [k for k in ("tp", "cp", "pp", "vpp", "ep") if lay.source.get(k) == BRIDGE_DEFAULT]
    if assumed:
        out.append(f"parallel layout: {', '.join(k.upper() for k in assumed)} taken as Megatron-Bridge's default (1): "
                   "no override on the launch line names them and one rank's traffic cannot tell them; a recipe may "
                   "set them otherwise in Python")
    steps = [k for k in ("vpp", "microbatches") if lay.size(k) is None]
    if steps and len(job.records) > 1:
        out.append(f"parallel layout: {' and '.join(k.upper() if k == 'vpp' else 'micro-batch count' for k in steps)} "
                   "unknown (not on the command line, and the forward passes per step did not show them: full "
                   "recompute re-runs forwards, or PP is unknown)")
    if lay.world and len(job.records) < lay.world:
        out.append(f"ranks {len(job.records)} of {lay.world}: waiting, stragglers, the pipeline bubble and stage "
                   "balance need every rank's profile (or one per PP stage)")
    return out
