"""Transformer layers per pipeline stage, read from each rank's backward norm kernels, against
the layer count every PP capture was built with (its command's ``--num-layers`` or its config
file's ``model.layers``, split evenly over the stages by Megatron-Core)."""
from __future__ import annotations

import re

import pandas as pd
import pytest
import yaml
from conftest import CORPUS, ROOT

from profclass.analyzers.pipeline_bubbles import layers_per_microbatch


def _built_layers(p: dict, d) -> int | None:
    """The layer count the capture was built with: ``--num-layers`` on the command line nsys
    recorded, or the config file's ``model.layers`` (the wrapper's own launch line)."""
    flags = (d.config.get("command_line_flags") or {}).get("value") or {}
    if str(flags.get("--num-layers", "")).isdigit():
        return int(flags["--num-layers"])
    m = re.search(r"--config (\S+\.ya?ml)", p["command"])
    return yaml.safe_load((ROOT / m.group(1)).read_text())["model"]["layers"] if m else None


PIPELINED = {p["name"]: p for p in CORPUS["profile"] if p.get("parallel", {}).get("pp", 1) > 1}


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_layers_per_stage_match_the_construction(name, diagnosis):
    d = diagnosis(name)
    layers, pp = _built_layers(PIPELINED[name], d), PIPELINED[name]["parallel"]["pp"]
    if layers is None:
        pytest.skip("the layer count is set inside the workload's Python (a recipe)")
    read = [r["layers"] for r in d.pipeline["per_stage"]]
    assert set(read) - {None} == {layers // pp}, read
    assert read.count(None) <= len(read) // 4, read  # a rank whose window cuts a micro-batch stays unknown


def test_most_pipelined_captures_have_a_known_layer_count(diagnosis):
    known = [n for n, p in PIPELINED.items() if _built_layers(p, diagnosis(n)) is not None]
    assert len(known) >= 12, sorted(set(PIPELINED) - set(known))


def test_one_layer_per_stage_is_not_offered_interleaving(diagnosis):
    """The flagless TP 2 x PP 2 x EP 2 job runs one layer per stage: no virtual stage can be made,
    so pp_interleave (offered before the count existed, 20 ms/step) is not among its fixes."""
    d = diagnosis("mcore_wrapped_tp2_pp2_ep2")
    assert {r["layers"] for r in d.pipeline["per_stage"]} == {1}
    ids = [f["id"] for f in d.fixes]
    assert "pp_interleave" not in ids and "pp_microbatches" in ids
    assert any(e["metric"] == "pipeline layers per stage" for e in d.evidence)


def _agg(counts: dict) -> pd.DataFrame:
    return pd.DataFrame({"full_name": list(counts), "count": list(counts.values())})


def test_counts_that_disagree_leave_the_layers_unknown():
    norm = "layer_norm_grad_input_kernel_vectorized"
    soft = "softmax_warp_backward"
    assert layers_per_microbatch(_agg({norm: 8 * 5, soft: 8 * 2}), 8) == 2  # 2 L + 1 norms, L softmax
    assert layers_per_microbatch(_agg({norm: 8 * 4, soft: 8 * 6}), 8) == 2  # MoE: 3 L softmax
    assert layers_per_microbatch(_agg({norm: 8 * 8, soft: 8 * 2}), 8) is None  # QK norms: 4 L
    assert layers_per_microbatch(_agg({norm: 8 * 4 + 3, soft: 8 * 2}), 8) is None  # a cut micro-batch
    assert layers_per_microbatch(_agg({soft: 16}), 8) is None  # no norm kernels
    assert layers_per_microbatch(_agg({norm: 32}), 0) is None  # micro-batch count unknown
