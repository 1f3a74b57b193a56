"""A launch line written as Hydra overrides (Megatron-Bridge's ``section.key=value``, the form a
Bridge recipe or a NeMo launcher passes) says what its Megatron-LM flags say: committed pairs
whose launch lines are rewritten into overrides, flag for flag (the timelines untouched), give
``diff`` the same recognised fixes, prices and realized gains as the pairs with their flags, and
``diagnose`` the same layout and fixes."""
from __future__ import annotations

import pytest

from conftest import profile_path, relaunched
from profclass.config import parse_flags, parse_overrides
from profclass.diff.compare import diff

# Bridge's config sections of the settings these pairs change (its "Megatron-LM to Megatron
# Bridge" mapping); every other flag goes to ``model.``
SECTIONS = {"manual_gc": "train", "manual_gc_interval": "train", "micro_batch_size": "train",
            "global_batch_size": "train", "overlap_grad_reduce": "ddp", "num_workers": "dataset"}


def as_overrides(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The workload's own flags (those after its script; a launcher's before it stay) as
    overrides: ``--manual-gc-interval 8`` -> ``train.manual_gc_interval=8``, a switch ``=true``."""
    script = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    if script is None:
        return command, args
    out, tail, i = args[:script + 1], args[script + 1:], 0
    while i < len(tail):
        tok = tail[i]
        if not tok.startswith("--"):
            out.append(tok)
        else:
            key, eq, value = tok[2:].partition("=")
            if not eq:
                has_value = i + 1 < len(tail) and not tail[i + 1].startswith("--")
                value, i = (tail[i + 1], i + 1) if has_value else ("true", i)
            key = key.replace("-", "_")
            out.append(f"{SECTIONS.get(key, 'model')}.{key}={value}")
        i += 1
    return command, out


@pytest.fixture(scope="module")
def bridged(tmp_path_factory):
    out, made = tmp_path_factory.mktemp("bridged"), {}

    def make(name: str) -> str:
        if name not in made:
            made[name] = relaunched(name, out / f"{name}.sqlite", as_overrides)
        return made[name]

    return make


def test_overrides_read_as_the_flags_they_set():
    args = ["train.py", "model.tensor_model_parallel_size=2", "++train.manual_gc=True", "ddp.overlap_grad_reduce=false",
            "trainer.strategy.pipeline_model_parallel_size=4", "model.fp8=hybrid", "dataset.sequence_length=4096",
            "model.recompute_granularity=null", "--nvtx-ranges", "model.moe_grouped_gemm=true",
            "model.sequence_parallel=true", "model.sequence_parallel=false"]
    # false and null leave a switch absent (readers test switches by presence); the last one wins
    assert parse_overrides(args) == {"--tensor-model-parallel-size": "2", "--manual-gc": True,
                                     "--pipeline-model-parallel-size": "4", "--fp8-format": "hybrid",
                                     "--seq-length": "4096", "--moe-grouped-gemm": True}
    # a switch followed by an override is a switch: the override is not its value
    assert parse_flags(args) == {"--nvtx-ranges": True}


# (base, candidate, the fix): the gc pair's fix_pairs.py flags, an MoE micro-batch change, a
# DP overlap (a ddp.* key), a micro-batch count on a pipeline
PAIRS = [("gc_base_1gpu", "gc_cand_1gpu", "host_gc"),
         ("mcore_ep2_small_mbs1", "mcore_ep2_small_mbs4", "host_bigger_launches"),
         ("mcore_gb_dp4_base", "mcore_gb_dp4_dpoverlap", "dp_overlap_grad_reduce"),
         ("mcore_gb_pp4_m4", "mcore_gb_pp4_m8", "pp_microbatches")]


@pytest.mark.parametrize("base, cand, fix", PAIRS, ids=[p[2] for p in PAIRS])
def test_a_pair_launched_with_overrides_is_its_flagged_twin(base, cand, fix, bridged):
    flagged = diff(str(profile_path(base)), str(profile_path(cand)))
    over = diff(bridged(base), bridged(cand))
    keys = ("fix", "detected_by", "predicted_gain_ms", "gain_low_ms", "gain_high_ms", "realized_gain_ms",
            "realized_per", "predicted_wall_after")
    rows = [{k: r[k] for k in keys} for r in over.fix_gains]
    assert rows == [{k: r[k] for k in keys} for r in flagged.fix_gains]
    row = next(r for r in rows if r["fix"] == fix)
    assert row["detected_by"].startswith(("on:--", "up:--"))  # by the flag the override set
    # and the configuration changes it lists are the flags' own
    said = lambda d: sorted((c["key"], str(c["base"]), str(c["candidate"])) for c in d.config_changes)  # noqa: E731
    assert said(over) == said(flagged) and said(over)


# (capture, where the bridged capture's TP, PP and EP come from): tp2sp_pp2's launch line names
# TP and PP, and EP off the traffic (a recipe may set it in Python); gb_dp4's names no size, so
# its bridged twin infers them all
SOURCES = [("mcore_dense_tp2sp_pp2", ("bridge overrides", "bridge overrides", "inferred")),
           ("mcore_gb_dp4_base", ("inferred", "inferred", "inferred"))]


@pytest.mark.parametrize("name, source", SOURCES, ids=[s[0] for s in SOURCES])
def test_a_capture_launched_with_overrides_is_diagnosed_as_its_flagged_twin(name, source, bridged):
    """The layout (its sizes from the overrides, the rest off the timeline), the verdict and the
    fixes with their prices."""
    import profclass

    flagged, over = profclass.diagnose(str(profile_path(name))), profclass.diagnose(bridged(name))
    assert over.layout["sizes"] == flagged.layout["sizes"]
    assert tuple(over.layout["source"][k] for k in ("tp", "pp", "ep")) == source
    assert over.verdict["wall"] == flagged.verdict["wall"]
    gains = lambda d: [(f["id"], f["expected_gain_ms"]) for f in d.fixes]  # noqa: E731
    assert gains(over) == gains(flagged)



# (capture, the one override its recipe-like launch line keeps): the other sizes are the recipe's,
# set in Python, and must come off the traffic, not default to 1 as Megatron-LM's flags would
PARTIAL = [("mcore_dense_tp2sp_pp2", "model.pipeline_model_parallel_size=2"),
           ("mcore_wrapped_dense_tp2_pp2", "model.tensor_model_parallel_size=2"),
           ("mcore_wrapped_tp2_pp2_ep2", "model.expert_model_parallel_size=2"),
           ("mcore_recipe_pp2_vpp2_ep2_m4", "model.expert_model_parallel_size=2"),
           ("mcore_tp2sp_ep2", "trainer.strategy.tensor_model_parallel_size=2")]


@pytest.mark.parametrize("name, override", PARTIAL, ids=[p[0] for p in PARTIAL])
def test_sizes_no_override_names_come_off_the_traffic(name, override, tmp_path):
    """A recipe's launch line that names one size: the layout is the constructed one (corpus.toml
    ``parallel``), the named size from the override, the others inferred."""
    import profclass
    from conftest import PROFILES

    path = relaunched(name, tmp_path / f"{name}.sqlite", lambda command, args: (command, ["recipe.py", override]))
    d = profclass.diagnose(path)
    par, src = PROFILES[name]["parallel"], d.layout["source"]
    assert {k: d.layout["sizes"][k] for k in ("tp", "pp", "vpp", "ep", "dp", "microbatches")} == \
        {k: par[k] for k in ("tp", "pp", "vpp", "ep", "dp", "microbatches")}
    named = {"tensor": "tp", "pipeline": "pp", "expert": "ep"}[override.split(".")[-1].split("_")[0]]
    assert src[named] == "bridge overrides"
    assert all(src[k] == "inferred" for k in ("tp", "pp", "ep") if k != named)


def test_one_rank_with_partial_overrides_says_what_it_assumed(diagnosis):
    """The Bridge capture of rank 0 alone names PP and EP: TP, CP and VPP are Bridge's default (1),
    said as an assumption, since one rank's traffic cannot tell them."""
    d = diagnosis("mcore_bridge_pp2_ep2")
    assert {k: d.layout["source"][k] for k in ("tp", "vpp")} == {"tp": "bridge default (not on the launch line)",
                                                                 "vpp": "bridge default (not on the launch line)"}
    assert d.layout["sizes"]["dp"] == 2 and d.layout["sizes"]["microbatches"] == 4  # 16 / (2 x 2)
    assert any("taken as Megatron-Bridge's default" in m for m in d.missing)
