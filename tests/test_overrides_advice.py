"""A fix's Hydra overrides (``fixes.toml`` ``overrides``) say what its Megatron-LM flags say, and
the reports give them to a job launched with overrides (a Bridge recipe, NeMo) in place of flags."""
from __future__ import annotations

import re

import pytest

from conftest import profile_path, relaunched
from profclass.config import parse_overrides
from profclass.fixes import load_table

# Megatron-Core's config field -> Megatron-LM's flag, where the two are named otherwise (megatron-core
# 0.19.2's TransformerConfig against Megatron-LM's arguments.py; Bridge's own keys, its mapping table)
NAMED_OTHERWISE = {"--num-layers-in-first-pipeline-stage": "--decoder-first-pipeline-num-layers",
                   "--num-layers-in-last-pipeline-stage": "--decoder-last-pipeline-num-layers",
                   "--skip-getting-attention-mask-from-dataset": "--no-create-attention-mask-in-dataloader",
                   "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank"}


@pytest.mark.parametrize("fix", [f for f in load_table() if f.get("overrides")], ids=lambda f: f["id"])
def test_each_override_sets_a_flag_the_fix_names(fix):
    """Read back as flags (``parse_overrides``), every override is one the fix's flags text names:
    the flag itself, its config field's name (in prose), or the flag Megatron-LM names otherwise."""
    said = fix["flags"] + " " + fix.get("moe_flags", "")
    # every section.key named, with a value or without ("train.global_batch_size (larger)"), as the
    # flag parse_overrides reads it as
    keys = re.findall(r"(?<![\w.])(?:[a-z_]+\.)+([a-z_0-9]+)\b", fix["overrides"] + " " + fix.get("moe_overrides", ""))
    sets = list(parse_overrides([f"x.{k}=1" for k in keys]))
    assert sets, fix["id"]
    named = set(re.findall(r"[\w-]+", said))  # whole words: a truncated key is no match
    for flag in sets:
        assert {flag, flag[2:].replace("-", "_"), NAMED_OTHERWISE.get(flag)} & named, (fix["id"], flag)


def test_a_job_launched_with_overrides_is_told_them(tmp_path):
    """dpnooverlap_4gpu relaunched as a recipe with one override: its DP-overlap fix reads
    ``ddp.overlap_grad_reduce=true``, in the JSON and the text report; launched with its flags,
    the same fix carries none."""
    import profclass
    from profclass.report import render_text

    path = relaunched("dpnooverlap_4gpu", tmp_path / "d.sqlite",
                      lambda command, args: (command, ["recipe.py", "train.micro_batch_size=1"]))
    over, flagged = profclass.diagnose(path), profclass.diagnose(str(profile_path("dpnooverlap_4gpu")))
    fix = next(f for f in over.fixes if f["id"] == "dp_overlap_grad_reduce")
    assert fix["overrides"].startswith("ddp.overlap_grad_reduce=true")
    assert all(f["overrides"] is None for f in flagged.fixes)
    text = render_text(over)
    assert "overrides: ddp.overlap_grad_reduce=true" in text and "flags: --overlap-grad-reduce" not in text
