"""A fix's Hydra overrides (``fixes.toml`` ``overrides``) say what its Megatron-LM flags say, and
the reports give them to a job launched with overrides (a Bridge recipe, NeMo) in place of flags."""
from __future__ import annotations

import re

import pytest

from conftest import profile_path, relaunched
from profclass.config import parse_overrides
from profclass.fixes import load_table
from profclass.pitfalls import load_rules

# Megatron-Core's config field -> Megatron-LM's flag, where the two are named otherwise (megatron-core
# 0.19.2's TransformerConfig against Megatron-LM's arguments.py; Bridge's own keys, its mapping table)
NAMED_OTHERWISE = {"--num-layers-in-first-pipeline-stage": "--decoder-first-pipeline-num-layers",
                   "--num-layers-in-last-pipeline-stage": "--decoder-last-pipeline-num-layers",
                   "--skip-getting-attention-mask-from-dataset": "--no-create-attention-mask-in-dataloader",
                   "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank"}


def _each_override_is_named(overrides: str, said: str, what: str) -> None:
    """Read back as flags (``parse_overrides``), every override in ``overrides`` is one ``said``
    (the flags text) names: the flag itself, its config field's name (in prose), or the flag
    Megatron-LM names otherwise."""
    # every section.key named, with a value or without ("train.global_batch_size (larger)"), as the
    # flag parse_overrides reads it as
    keys = re.findall(r"(?<![\w.])(?:[a-z_]+\.)+([a-z_0-9]+)\b", overrides)
    sets = list(parse_overrides([f"x.{k}=1" for k in keys]))
    assert sets, what
    named = set(re.findall(r"[\w-]+", said))  # whole words: a truncated key is no match
    for flag in sets:
        assert {flag, flag[2:].replace("-", "_"), NAMED_OTHERWISE.get(flag)} & named, (what, flag)


@pytest.mark.parametrize("fix", [f for f in load_table() if f.get("overrides")], ids=lambda f: f["id"])
def test_each_override_sets_a_flag_the_fix_names(fix):
    _each_override_is_named(fix["overrides"] + " " + fix.get("moe_overrides", ""),
                            fix["flags"] + " " + fix.get("moe_flags", ""), fix["id"])


@pytest.mark.parametrize("rule", [r for r in load_rules() if r.get("overrides")], ids=lambda r: r["id"])
def test_each_pitfall_override_sets_a_flag_its_fix_names(rule):
    _each_override_is_named(rule["overrides"], rule["fix"], rule["id"])


def test_every_pitfall_fix_naming_a_megatron_flag_has_an_override_form():
    """A rule whose fix names a Megatron-LM flag (``--x``, not nsys's ``--cuda-memory-usage`` alone)
    says it as overrides too: a recipe's user is never told a flag its launch line cannot take."""
    for rule in load_rules():
        flags = set(re.findall(r"--[a-z][\w-]+", rule["fix"])) - {"--cuda-memory-usage"}
        assert not flags or rule.get("overrides"), rule["id"]


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


@pytest.mark.parametrize("name, rule, told", [
    # flagless full recompute, read off the timeline; memory usage not captured
    ("mcore_wrapped_pp2_rc_m2", "full_recompute_memory_unknown", "model.recompute_granularity=selective"),
    ("memory_1gpu", "allocator_churn_every_step", "train.empty_unused_memory_level=0"),  # an emptying every step
])
def test_a_pitfall_is_told_in_overrides_to_a_job_launched_with_them(name, rule, told, tmp_path):
    """A capture relaunched as a recipe with one override is told its pitfall's fix as overrides, in
    the JSON and the text report; launched as it was, the same pitfall carries none."""
    import profclass
    from profclass.report import render_text

    path = relaunched(name, tmp_path / "r.sqlite", lambda command, args: (command, ["recipe.py", "train.micro_batch_size=1"]))
    over, plain = profclass.diagnose(path), profclass.diagnose(str(profile_path(name)))
    (found,) = [p for p in over.pitfalls if p["rule"] == rule]
    assert told in found["overrides"] and told not in found["fix"]
    (before,) = [p for p in plain.pitfalls if p["rule"] == rule]
    assert before["overrides"] is None and before["fix"] == found["fix"]
    text = " ".join(render_text(over).split())  # the console wraps long lines
    assert f"Fix: {found['overrides']}" in text and f"Fix: {found['fix']}" not in text


def test_a_diff_pitfall_is_told_in_overrides(tmp_path):
    """Routing modes that differ, set by override on one side: the pair's pitfall says the override."""
    from profclass.diff.compare import diff

    base = relaunched("mcore_alltoall_4gpu", tmp_path / "b.sqlite",
                      lambda command, args: (command, ["recipe.py", "train.micro_batch_size=1"]))
    cand = relaunched("mcore_alltoall_4gpu_balanced", tmp_path / "c.sqlite",
                      lambda command, args: (command, ["recipe.py", "model.moe_router_force_load_balancing=true"]))
    (found,) = [p for p in diff(base, cand).pitfalls if p["rule"] == "routing_mode_differs"]
    assert found["overrides"] == "keep model.moe_router_force_load_balancing the same on both sides"
