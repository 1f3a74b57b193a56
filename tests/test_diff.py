"""`profclass diff` on the corpus's real regression/improvement pairs, self-diffs, and the rules
underneath (the significance test, kernel-name normalisation)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import CORPUS, PROFILES, profile_path

import profclass
from profclass.classify import WALLS
from profclass.diff import DiffResult, diff, one_line, render_markdown, render_text, step_test
from profclass.kernel_table import normalise_name

PAIRS = CORPUS["pair"]
PAIR_IDS = [f"{p['base']}->{p['candidate']}" for p in PAIRS]


def cli(*args):
    return subprocess.run([sys.executable, "-c", "from profclass.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


# --- the corpus pairs -------------------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_pair_sign_magnitude_and_wall(pair, diagnosis):
    r = diff(diagnosis(pair["base"]), diagnosis(pair["candidate"]))
    workload_ratio = PROFILES[pair["candidate"]]["workload_step_ms"] / PROFILES[pair["base"]]["workload_step_ms"]
    # magnitude: the profile's step ratio within 5% of the workload's own timer ratio
    assert abs(r.step["ratio"] / workload_ratio - 1) <= 0.05, (r.step["ratio"], workload_ratio)
    assert r.significant
    if pair["kind"] == "regression":
        assert r.regression and not r.improvement and r.change == "regression"
        assert r.step["ratio"] > 1 and r.step["delta_ms"] > 0
    else:
        assert r.improvement and not r.regression and r.change == "improvement"
        assert r.step["ratio"] < 1 and r.step["delta_ms"] < 0
    # the wall that changed, named in the verdict and moving in the step's direction
    assert r.verdict["wall"] == pair["wall"]
    assert pair["wall"] in r.verdict["summary"]
    assert np.sign(r.walls_delta_ms[pair["wall"]]) == np.sign(r.step["delta_ms"])
    assert r.verdict["summary"].startswith("Regression" if pair["kind"] == "regression" else "Improvement")
    # the walls account for the step change (both are means over the same steady window)
    assert abs(sum(r.walls_delta_ms.values()) - r.step["delta_ms"]) <= 0.05 * abs(r.step["delta_ms"]) + 0.5


def test_regression_pair_details(diagnosis):
    """Twice the all-to-all volume: the SendRecv kernel takes the extra time, the collective mix
    keeps its calls, and the command-line flag that differs is reported."""
    r = diff(diagnosis("comm_4gpu"), diagnosis("comm_4gpu_2xdispatch"))
    top = r.kernels[0]
    assert top["name"] == "ncclDevKernel_SendRecv" and top["status"] == "changed"
    assert top["collective"] == "all_to_all"
    assert top["delta_ms_per_step"] > 0.5 * r.step["delta_ms"]
    assert top["base"]["count_per_step"] == pytest.approx(top["candidate"]["count_per_step"])
    a2a = next(c for c in r.components if c["metric"] == "all_to_all (EP) exposed")
    assert a2a["delta"] == pytest.approx(r.walls_delta_ms["communication"], rel=0.1)
    assert {"key": "--dispatch-copies", "base": None, "candidate": "2", "source": "command line"} in r.config_changes


def test_improvement_pair_details(diagnosis):
    """Overlapping the gradient all-reduce: bucketed all-reduce kernels appear, overlap rises,
    exposed all-reduce falls, and --overlap-grad-reduce is the configuration change."""
    r = diff(diagnosis("dpnooverlap_4gpu"), diagnosis("dpoverlap_4gpu"))
    ar = next(c for c in r.communication["collectives"] if c["collective"] == "all_reduce")
    assert ar["candidate"]["calls_per_step"] > ar["base"]["calls_per_step"]
    assert ar["delta_exposed_ms"] < 0
    ov = r.communication["overlap_share"]
    assert ov["candidate"] > ov["base"]
    assert any("hidden under compute" in c for c in r.communication["changes"])
    assert any(c["key"] == "--overlap-grad-reduce" for c in r.config_changes)
    assert any(k.startswith("ncclDevKernel_AllReduce") for k in r.appeared)
    assert "all_reduce (DP) exposed" in r.verdict["summary"]


def test_a_recognised_fix_says_the_wall_it_left_next(diagnosis):
    """Twice the micro-batches on the host-paced PP 4 job: the bubble (communication) was the base
    path's largest wall; the replay's next wall and the candidate's own path both say host, and
    the text report sets them side by side."""
    b, c = diagnosis("mcore_pp4_m4"), diagnosis("mcore_pp4_m8")
    r = diff(b, c)
    row = next(x for x in r.fix_gains if x["fix"] == "pp_microbatches")
    assert max(b.replay["critical_path_ms"].items(), key=lambda kv: kv[1])[0] == "communication"
    assert row["predicted_wall_after"] == row["candidate_wall"] == "host"
    assert "then the host wall predicted, the candidate's path: host" in render_text(r)


@pytest.mark.parametrize("name", sorted({p[k] for p in PAIRS for k in ("base", "candidate")}))
def test_self_diff_reports_no_change(name, diagnosis):
    d = diagnosis(name)
    r = diff(d, d)
    assert not r.significant and not r.regression and not r.improvement
    assert r.change == "no significant change" and r.verdict["wall"] is None
    assert r.step["ratio"] == 1.0 and r.step["delta_ms"] == 0
    assert r.step["test"]["p_value"] == 1.0
    assert all(v == 0 for v in r.walls_delta_ms.values())
    assert all(k["delta_ms_per_step"] == 0 and k["status"] == "changed" for k in r.kernels)
    assert not r.appeared and not r.vanished and not r.config_changes and not r.communication["changes"]
    assert r.verdict["summary"].startswith("No significant change")


def test_same_job_two_layouts_is_no_change(diagnosis):
    """The imbalance workload captured as one report and as one report per rank (a directory):
    the same job, so no significant change and the same kernels on both sides."""
    r = diff(str(profile_path("imbalance_4gpu_perrank")), diagnosis("imbalance_4gpu"))
    assert not r.significant
    assert abs(r.step["ratio"] - 1) < 0.05
    assert not r.appeared and not r.vanished
    assert r.base["gpus"] == r.candidate["gpus"] == 4


def test_kernel_table_matches_collectives(diagnosis):
    """Communication kernels' time per step in the kernel table equals the collectives' transfer
    plus wait time (two independent sums over the same window)."""
    d = diagnosis("comm_4gpu")
    by_type: dict[str, float] = {}
    for k in d.kernels:
        if k["is_comm"]:
            by_type[k["collective"]] = by_type.get(k["collective"], 0.0) + k["ms_per_step"]
    for c in d.collectives:
        assert by_type[c["collective"]] == pytest.approx(c["transfer_ms_per_step"] + c["wait_ms_per_step"],
                                                         rel=0.01, abs=0.01)


# --- CLI, formats, inputs ----------------------------------------------------------------------

def test_cli_json_keys_and_fail_above(tmp_path, diagnosis):
    base, cand = profile_path("compute_4gpu"), profile_path("compute_4gpu_syncs")
    p = cli("diff", base, cand, "--format", "json", "--fail-above", "5")
    assert p.returncode == 4, p.stderr
    doc = json.loads(p.stdout)
    assert doc["step"]["base_ms"] > 0 and doc["step"]["candidate_ms"] > doc["step"]["base_ms"]
    assert doc["step"]["ratio"] == pytest.approx(doc["step"]["candidate_ms"] / doc["step"]["base_ms"], rel=1e-3)
    assert doc["regression"] is True and doc["significant"] is True
    assert doc["verdict"]["wall"] == "host" and doc["verdict"]["summary"]
    assert set(doc["walls_delta_ms"]) == set(WALLS)
    assert doc["kernels"] and {"name", "base", "candidate", "delta_ms_per_step", "status"} <= doc["kernels"][0].keys()
    # the same regression (from stored diagnoses) passes a threshold above its size
    stored = []
    for name in ("compute_4gpu", "compute_4gpu_syncs"):
        stored.append(tmp_path / f"{name}.json")
        stored[-1].write_text(diagnosis(name).to_json())
    assert cli("diff", *stored, "--fail-above", "50").returncode == 0
    assert cli("diff", *stored, "--fail-above", "10").returncode == 4


def test_cli_improvement_never_fails_and_markdown(tmp_path):
    out = tmp_path / "comment.md"
    p = cli("diff", profile_path("dpnooverlap_4gpu"), profile_path("dpoverlap_4gpu"), "--format", "markdown",
            "--fail-above", "0", "-o", out)
    assert p.returncode == 0, p.stderr
    md = out.read_text()
    assert md.startswith("## profclass diff: **Improvement**")
    assert "| communication |" in md and "--overlap-grad-reduce" in md


def test_cli_bad_input_and_usage(tmp_path):
    p = cli("diff", profile_path("compute_4gpu"), tmp_path / "missing.sqlite")
    assert p.returncode == 2
    assert p.stderr.strip() == f"profclass: error: {tmp_path / 'missing.sqlite'}: no such file or directory"
    assert "Traceback" not in p.stderr
    assert cli("diff", profile_path("compute_4gpu")).returncode == 2
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a diagnosis"}')
    p = cli("diff", bad, profile_path("compute_4gpu"))
    assert p.returncode == 2 and "not a profclass diagnosis" in p.stderr


def test_rank_files_as_a_side_and_stored_json_baseline(tmp_path, diagnosis):
    """Rank files joined by commas, and a stored diagnosis JSON as the base, give the same numbers
    as diagnosing the profiles directly."""
    ranks = sorted((profile_path("imbalance_4gpu_perrank")).iterdir())
    stored = tmp_path / "base.json"
    stored.write_text(diagnosis("imbalance_4gpu").to_json())
    p = cli("diff", stored, ",".join(map(str, ranks)), "--format", "json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    direct = diff(diagnosis("imbalance_4gpu"), str(profile_path("imbalance_4gpu_perrank")))
    assert doc["step"]["ratio"] == pytest.approx(direct.step["ratio"], abs=1e-4)
    assert doc["walls_delta_ms"] == pytest.approx(direct.walls_delta_ms, abs=1e-3)
    assert len(doc["candidate"]["inputs"]) == 4


def test_renderers_and_api(diagnosis):
    r = profclass.diff(diagnosis("comm_4gpu"), diagnosis("comm_4gpu_2xdispatch"))
    assert isinstance(r, DiffResult)
    text = render_text(r)
    assert "REGRESSION" in text.upper() and "ncclDevKernel_SendRecv" in text
    assert "Regression" in render_markdown(r)
    line = one_line(r)
    assert "\n" not in line and "regression" in line and "communication" in line
    json.loads(r.to_json())
    # what the text prints is data, never rich markup: a bracketed word in a note stays
    r.notes = [*r.notes, "set [moe_router] scope"]
    assert "Note: set [moe_router] scope" in render_text(r)


# --- the rules underneath ----------------------------------------------------------------------

def test_step_test_uses_the_spread_not_a_fixed_percentage():
    rng = np.random.default_rng(0)
    base = 100 + rng.normal(0, 0.5, 10)
    # +5% with a tight spread: significant
    assert step_test(base, base * 1.05)["significant"]
    # +5% drowned in a +-30 ms spread: not significant, although above any fixed percentage
    noisy_b, noisy_c = 100 + rng.normal(0, 30, 5), 105 + rng.normal(0, 30, 5)
    t = step_test(noisy_b, noisy_c)
    assert not t["significant"] and t["p_value"] > 0.05
    # +1% with almost no spread: statistically clear, but below the minimum effect
    t = step_test(base, base + 1.0)
    assert t["p_value"] < 1e-3 and not t["significant"]
    assert step_test(base, base + 1.0, min_effect=0.005)["significant"]
    # identical samples
    t = step_test(base, base)
    assert t["p_value"] == 1.0 and not t["significant"] and t["ci95_delta_ms"][0] < 0 < t["ci95_delta_ms"][1]


def test_step_test_without_spread():
    t = step_test([100.0], [104.0])
    assert t["p_value"] is None and "untested" in t["method"] and not t["significant"]
    assert step_test([100.0], [106.0])["significant"]
    assert step_test([100.0, 100.0], [103.0, 103.0])["significant"]  # exact: no spread at all
    assert not step_test([100.0, 100.0], [100.0, 100.0])["significant"]


@pytest.mark.parametrize("raw, expected", [
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<float>, "
     "std::array<char *, (unsigned long)3>>(int, T2, T3)",
     "at::native::vectorized_elementwise_kernel<(int)N, at::native::CUDAFunctor_add<float>, "
     "std::array<char *, (unsigned long)N>>"),
    ("nvjet_sm90_tst_128x144_64x6_1x2_h_bz_TNT", "nvjet_sm90_tst_N_N_N_h_bz_TNT"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)", "ncclDevKernel_SendRecv"),
    ("triton_poi_fused_add_mul_12", "triton_poi_fused_add_mul_N"),
    ("memcpy DtoH", "memcpy DtoH"),
])
def test_normalise_name(raw, expected):
    assert normalise_name(raw) == expected


def test_normalise_name_keeps_what_matters():
    # dtype and functor identity survive; tile sizes and vector widths do not
    assert normalise_name("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)") != \
        normalise_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)")
    assert normalise_name("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_TNT") == \
        normalise_name("nvjet_sm90_tst_128x256_64x5_1x2_v_bz_TNT")
    assert normalise_name("f<(int)1>(int, T1)") == "f<(int)N>"


def test_pipeline_send_recv_is_not_an_all_to_all(diagnosis):
    """PP send/recv and the EP all-to-all share NCCL's SendRecv kernel: the diff's communication
    rows keep them apart by group, and the text names the PP one as such."""
    r = diff(diagnosis("mcore_pp2_ep2_m4"), diagnosis("mcore_pp2_ep2_vpp2_m4"))
    groups = {(m["collective"], m["group"]) for m in r.communication["collectives"]}
    assert {("all_to_all", "PP"), ("all_to_all", "EP")} <= groups
    pp = next(m for m in r.communication["collectives"] if m["group"] == "PP" and m["collective"] == "all_to_all")
    assert pp["candidate"]["calls_per_step"] > pp["base"]["calls_per_step"]  # VPP 2: more exchanges
    text = render_text(r, width=400)
    assert "PP send/recv" in text and "all_to_all (EP)" in text
    # the kernel table's PP share of SendRecv ("send/recv") counts as the PP row's calls: no row
    # holds time without calls, nor calls without a group (the dense PP 4 pair has only PP ones)
    dense = diff(diagnosis("mcore_gb_pp4_m8"), diagnosis("mcore_gb_pp4_vpp2_m8"))
    for res in (r, dense):
        for m in res.communication["collectives"]:
            assert m["group"], m
            for side in ("base", "candidate"):
                assert m[side]["calls_per_step"] > 0 or m[side]["transfer_ms"] + m[side]["wait_ms"] == 0, m
    pp = next(m for m in dense.communication["collectives"] if m["group"] == "PP" and m["collective"] == "all_to_all")
    for side, d in (("base", diagnosis("mcore_gb_pp4_m8")), ("candidate", diagnosis("mcore_gb_pp4_vpp2_m8"))):
        table = sum(k["count_per_step"] for k in d.kernels if k["collective"] == "send/recv")
        assert pp[side]["calls_per_step"] == pytest.approx(table) and table > 0
    assert pp["candidate"]["calls_per_step"] > pp["base"]["calls_per_step"]  # interleaving adds exchanges


def test_recompute_rows_follow_the_walls_table(diagnosis):
    """Full recompute with a card far from capacity (rc_full_ample -> rc_none_ample): the memory
    wall holds none of it, so the 'inside the walls' rows put it in the walls it runs in, not
    under memory (it was memory 0.00 ms/step next to ~76 ms/step of recompute under memory)."""
    b, c = diagnosis("mcore_rc_full_ample"), diagnosis("mcore_rc_none_ample")
    r = diff(b, c)
    rows = {x["metric"]: x for x in r.components}
    charged = rows["recompute charged to memory (card near capacity)"]
    kept = rows["recompute kept in the walls it runs in (card not near capacity)"]
    assert charged["wall"] == "memory" and charged["base"] == 0.0 == b.walls["memory"]["ms_per_step"] * 0
    assert b.walls["memory"]["ms_per_step"] < 1.0
    assert kept["wall"] == "compute" and kept["base"] > 50 and kept["candidate"] < 5
    assert sum(x["base"] for x in r.components if x["wall"] == "memory" and x["unit"] == "ms/step") \
        <= b.walls["memory"]["ms_per_step"] + 1.0


def test_a_recognised_change_leads_and_is_charged_to_its_wall(diagnosis):
    """rc_full_ample -> rc_none_ample turns recompute off (config recompute full -> none): the
    verdict leads with that change and its measured saving, charged to memory (the seeds'
    lever for recompute) though the time ran in compute, communication and host."""
    r = diff(diagnosis("mcore_rc_full_ample"), diagnosis("mcore_rc_none_ample"))
    (fg,) = [f for f in r.fix_gains if f["fix"] == "recompute_off"]
    assert r.verdict["wall"] == "memory"
    assert r.verdict["summary"].startswith("Improvement from a recognised change: Turn activation recompute off")
    assert f"saved {fg['realized_gain_ms']:.1f} ms/step" in r.verdict["summary"]
    assert "Measured: step" in r.verdict["summary"]


def test_the_applied_fix_is_priced_as_diagnose_prices_it_with_and_without_the_profiler():
    """``fix_gains[]`` of a pair whose change has a replay transform (recompute off): the
    untraced price is what ``diagnose(base, price_fixes=...)`` lists, and the price with the
    profiler kept is diagnose's traced one (the gain-pair tables' two columns), each from its own
    code path (diff's shared replayer; diagnose's replay stage)."""
    base, cand = profile_path("mcore_rc_full_ample"), profile_path("mcore_rc_none_ample")
    r = diff(str(base), str(cand))
    (fg,) = [f for f in r.fix_gains if f["fix"] == "recompute_off"]
    asked = profclass.diagnose(str(base), price_fixes=("recompute_off",)).replay["requested"]["recompute_off"]
    assert fg["predicted_gain_ms"] == pytest.approx(asked["best_ms"], abs=0.011)
    assert fg["predicted_gain_traced_ms"] == pytest.approx(asked["traced"]["best_ms"], abs=0.011)
    # tracing slows the host, so the launches the recomputed forward drops are worth more traced
    assert fg["predicted_gain_traced_ms"] > fg["predicted_gain_ms"]
    assert f"{fg['predicted_gain_traced_ms']:.1f} with the profiler kept" in render_text(r)


def test_an_interleaved_schedules_p2p_mode_change_applies_the_overlap_fix():
    """Batched -> overlapped P2P on an interleaved job is the ``pp_overlap_p2p`` fix, read off the
    pipeline analyzer's mode where no flag says it (a config file's switch: probe 26b's pair,
    docs/notes.md, twenty-fifth session, whose exports are not committed); the mode of a 1F1B
    job (VPP 1, whose calls are batched) is no setting, so 1F1B -> interleaved is not it."""
    from types import SimpleNamespace

    from profclass.diff.fix_gains import _applied, side_settings
    from profclass.fixes import load_table

    def side(vpp, p2p):
        return side_settings(SimpleNamespace(config={}, layout={"sizes": {"vpp": vpp}},
                                         pipeline={"virtual_stages": vpp, "p2p": p2p}))

    (fix,) = [f for f in load_table() if f["id"] == "pp_overlap_p2p"]
    signs = dict(fp8=False, libraries=set(), graphs=False)

    def applied(b, c):
        return any(_applied(cond, b, c, signs, signs)[0] for cond in fix["applied_when"])

    assert applied(side(2, "batched"), side(2, "overlapped"))
    assert not applied(side(2, "overlapped"), side(2, "batched"))
    assert not applied(side(1, "batched"), side(2, "overlapped"))
