"""The thirtieth session's calls AP-AS, the thirty-second's AU, AW and AX, the thirty-third's
BB and BC, the thirty-fourth's BE, BF and BG, the thirty-fifth's BI, BJ and BL, the thirty-sixth's BN and BP
the thirty-seventh's BR, BT and BU, the thirty-eighth's BV, BW and BX, the thirty-ninth's CA, CB and CC
the fortieth's CD, CE and CF, the forty-first's DA, DB and DC, the forty-second's DD, DE and DF and the
forty-third's DG, DH, DI and DK, the forty-fourth's EA, EC and EE, the forty-fifth's FC, the forty-sixth's GA and the
forty-ninth's IA and IB and the fiftieth's JA (docs/notes.md), judged again from their packed timer logs (fixtures/timers.tar.xz,
timers/s30/, s32/, s33/, s34/, s35/, s36/, s37/, s38/, s39/, s40/, s41/, s42/, s43/, s44/, s45/: its twins' ROUTING lines left out,
s46/, s49/ and s50/) by
workloads/judge_pairs.py's rule. Each pair's
base, candidate and price are read from the notebook's registration rows (AR, AS: prices
committed before the run) or from the prices the call wrote on its machine (AP, AQ), never from
the outcome tables, so what the notebook reports is recomputed here from the logs. The bases of
these pairs are not committed (fixtures/ is at its limit), so the prices themselves are not."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from conftest import ROOT


def _module(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gain_pairs = _module("gain_pairs", ROOT / "fixtures" / "gain_pairs.py")
judge_pairs = _module("judge_pairs", ROOT / "workloads" / "judge_pairs.py")
LOGS = {"AP": "fixtures/timers/s30/", "AQ": "fixtures/timers/s30/", "AR": "fixtures/timers/s30/",
        "AS": "fixtures/timers/s30/", "AU": "fixtures/timers/s32/", "AW": "fixtures/timers/s32/",
        "AX": "fixtures/timers/s32/", "BB": "fixtures/timers/s33/",
        "BC": "fixtures/timers/s33/", "BE": "fixtures/timers/s34/", "BF": "fixtures/timers/s34/",
        "BG": "fixtures/timers/s34/", "BI": "fixtures/timers/s35/", "BJ": "fixtures/timers/s35/",
        "BL": "fixtures/timers/s35/", "BN": "fixtures/timers/s36/", "BO": "fixtures/timers/s36/",
        "BP": "fixtures/timers/s36/", "BR": "fixtures/timers/s37/", "BT": "fixtures/timers/s37/", "BU": "fixtures/timers/s37/",
        "BV": "fixtures/timers/s38/", "BW": "fixtures/timers/s38/",
        "BX": "fixtures/timers/s38/", "CA": "fixtures/timers/s39/", "CB": "fixtures/timers/s39/",
        "CC": "fixtures/timers/s39/", "CD": "fixtures/timers/s40/", "CE": "fixtures/timers/s40/",
        "CF": "fixtures/timers/s40/", "DA": "fixtures/timers/s41/",
        "DB": "fixtures/timers/s41/", "DC": "fixtures/timers/s41/", "DD": "fixtures/timers/s42/",
        "DE": "fixtures/timers/s42/",
        "DF": "fixtures/timers/s42/", "DG": "fixtures/timers/s43/", "DH": "fixtures/timers/s43/",
        "DI": "fixtures/timers/s43/", "DK": "fixtures/timers/s43/", "EA": "fixtures/timers/s44/",
        "EC": "fixtures/timers/s44/", "EE": "fixtures/timers/s44/", "FC": "fixtures/timers/s45/",
        "GA": "fixtures/timers/s46/", "GB": "fixtures/timers/s46/",
        "GC": "fixtures/timers/s46/", "IA": "fixtures/timers/s49/", "IB": "fixtures/timers/s49/",
        "JA": "fixtures/timers/s50/", "KA": "fixtures/timers/s54/",
        "LA": "fixtures/timers/s55/", "LB": "fixtures/timers/s55/", "MA": "fixtures/timers/s56/",
        "MB": "fixtures/timers/s57/", "MC": "fixtures/timers/s57/", "MD": "fixtures/timers/s58/",
        "ME": "fixtures/timers/s58/", "MF": "fixtures/timers/s59/", "MG": "fixtures/timers/s60/",
        "MH": "fixtures/timers/s60/", "MI": "fixtures/timers/s61/", "MJ": "fixtures/timers/s61/",
        "MK": "fixtures/timers/s61/"}
ROW = re.compile(r"^\| (A[PQRSUWX]\d|B[BCEFGIJLNPRTUVWX]\d|C[A-F]\d|D[A-K]\d|E[A-F]\d|F[AENS]\d|G[ABC]\d|I[AB]\d|J[A-C]\d) "
                 r"`(\w+)` -> `(\w+)`[^|]*\|(.*)$", re.M)
# each pair's runs (log prefix) and steady window where its registration says other than the
# call's own prefix and iterations 10..30: call BB's MoE stage ran 16 steps (6..16), BB3 and
# BB4 beside their own base runs (bb2_), its dense stage 24 (8..24); call BC's dense stage 20
# (8..20), its MoE stage 14 (6..14)
RUNS = {"BB1": ("bb", 6, 16), "BB2": ("bb", 6, 16), "BB9": ("bb", 6, 16), "BB3": ("bb2", 6, 16),
        "BB4": ("bb2", 6, 16), "BB5": ("bb", 8, 24), "BB6": ("bb", 8, 24), "BB7": ("bb", 8, 24),
        "BB8": ("bb", 8, 24), "BC1": ("bc", 8, 20), "BC2": ("bc", 8, 20), "BC3": ("bc", 6, 14),
        "BC4": ("bc", 6, 14), "BE1": ("be", 6, 16), "BE2": ("be", 6, 16), "BE3": ("be2", 6, 16),
        "BE4": ("be2", 6, 16), "BE5": ("be2", 6, 16), "BE6": ("be", 8, 20), "BE7": ("be", 8, 20),
        "BE8": ("be", 8, 20), "BF1": ("bf", 6, 16), "BF2": ("bf", 6, 16), "BF3": ("bf", 6, 16),
        "BG1": ("bg", 6, 14), "BG2": ("bg", 6, 14), "BG3": ("bg", 6, 14),
        **{f"BI{i}": ("bi", 6, 30) for i in range(1, 8)}, **{f"BJ{i}": ("bj", 6, 30) for i in range(1, 6)},
        "BL1": ("bl", 6, 30), "BL2": ("bl", 6, 30), **{f"BN{i}": ("bn", 6, 30) for i in range(1, 7)},
        **{f"BP{i}": ("bp", 6, 30) for i in range(1, 5)}, "BR1": ("br", 6, 30), "BR2": ("br", 6, 30),
        "BR3": ("br", 6, 16), "BR4": ("br", 6, 16), "BR6": ("br", 8, 20),
        "BT1": ("bt", 6, 16), "BT2": ("bt", 6, 16), **{f"BT{i}": ("bt", 6, 30) for i in range(3, 6)},
        "BU1": ("bu", 6, 30), "BU2": ("bu", 6, 30), "BV1": ("bv", 6, 16), "BV3": ("bv", 6, 16),
        "BV2": ("bv", 6, 30), "BV4": ("bv", 6, 30), "BW1": ("bw", 6, 16), "BW2": ("bw", 6, 30),
        **{f"BX{i}": ("bx", 6, 30) for i in range(1, 4)}, **{f"CA{i}": ("ca", 6, 30) for i in range(1, 7)},
        **{f"CB{i}": ("cb", 6, 30) for i in range(1, 5)}, "CC1": ("cc", 6, 30), "CC2": ("cc", 6, 30),
        **{f"CD{i}": ("cd", 6, 30) for i in range(1, 6)}, **{f"CE{i}": ("ce", 6, 30) for i in range(1, 5)},
        # call CF's small-base pairs by their second pair of replicates (call CF3: CF2's ran 5.0-6.9% apart)
        "CF1": ("cf3", 6, 30), "CF2": ("cf3", 6, 30), "CF3": ("cf", 6, 30),
        **{f"DA{i}": ("da", 6, 30) for i in range(1, 5)}, "DB1": ("db", 6, 30), "DC1": ("dc", 6, 30),
        "DD1": ("dd", 6, 30), "DE1": ("de", 6, 30), "DF1": ("df", 6, 30),
        "DF2": ("df", 6, 30), "DG1": ("dg", 6, 30), "DG2": ("dg", 6, 30), "DH1": ("dh", 6, 30),
        "DI1": ("di", 6, 30), "DI2": ("di", 6, 30), "DJ1": ("dj", 6, 30), "DJ2": ("dj", 6, 30),
        "DK1": ("dk", 6, 30), "DK2": ("dk", 6, 30), "EA1": ("ea", 6, 30), "EA2": ("ea", 6, 30),
        "EB1": ("eb", 6, 30), "EC1": ("ec", 6, 30), "ED1": ("ed", 6, 30), "ED2": ("ed", 6, 30),
        "EE1": ("ee", 6, 30), "EF1": ("ef", 6, 30), "FA1": ("fa", 6, 30), "FS1": ("fs", 6, 30),
        "FS2": ("fs", 6, 30), "FN1": ("fn", 6, 30), "FE1": ("fe", 6, 30), "FE2": ("fe", 6, 30),
        "GA1": ("ga", 6, 30), "GA2": ("ga", 6, 30), "GA3": ("ga", 6, 30), "GA4": ("ga", 6, 30),
        "GB1": ("gb", 6, 30), "GB2": ("gb", 6, 30), "GC1": ("gc", 6, 30), "GC2": ("gc", 6, 30),
        "IA1": ("ia", 6, 30), "IB1": ("ib", 6, 30), "JA1": ("ja", 6, 30), "JB1": ("ja", 6, 30),
        "JC1": ("ja", 6, 30)}
# calls BI, BJ, BL and BN register their bases by their capture (calls BH's and BM's exports); their twins
# ran the capture's config
BASE_CONFIG = {"bh_dp2": "bh_dp2_rc", "bh_ep2": "bh_ep2_rc", "bm_pp2_moe": "bm_pp2_moe_rc",
               "bv_l6_2": "bv_pp2_l6_2", "bv_l1_3": "bv_pp2_l1_3", "bx_moe_l3_1": "bx_pp2_moe_l3_1",
               "ca_small": "ca_small_pageable", "ca_mid": "ca_mid_pageable", "cb_small": "cb_small_pageable",
               "cb_mid": "cb_mid_pageable", "cc_big": "cc_big_pageable", "cd_small": "cd_small_pageable",
               "cd_smallpin": "cd_small_pin", "cd_mid": "cd_mid_pageable", "ce_big": "ce_big_pageable",
               "ce_bigpin": "ce_big_pin", "cf_small": "cd_small_pageable", "cf_mid": "cd_mid_pageable",
               "db_base": "db_dp2_do_ovlg", "dc_base": "dc_dp2_do_ovlg", "dd_l1": "dd_ep2_learned",
               "de_l1": "de_ep2_learned", "df_base": "dd_ep2_balanced", "dg_base": "dg_ep2_learned",
               "dh_base": "dd_ep2_learned", "di_base": "di_ep2_learned", "dj_base": "dj_ep2_learned",
               "dk_base": "dk_ep2_learned", "ea_base": "ea_moe1_learned", "eb_base": "eb_moe1_learned",
               "ec_base": "ec_pp2_learned", "ed_base": "ed_ep2_learned", "ee_base": "ee_pp2_learned",
               "ef_base": "ef_ep2_learned", "fa_learned": "fa_ep2_learned", "fa_skew15": "fa_ep2_skew15",
               "fb_aux0": "fb_ep2_aux0", "fb_e16_skew10": "fb_ep2_e16_skew10",
               "ga_dp2": "ga_dp2_rc_emc1", "ga_ep2": "ga_ep2_rc_emc2", "ga_pp2": "ga_pp2_norc_emc1",
               "ga_small": "ga_ep2_small_emc2", "gb_dp2": "ga_dp2_rc_emc1", "gb_ep2": "ga_ep2_rc_emc2",
               "gc_pp2": "ga_pp2_norc_emc1", "gc_small": "ga_ep2_small_emc2",
               "ia_base": "ia_moe1_learned", "ib_base": "ib_moe2_learned", "ja_base": "ja_moe2_learned",
               "jb_base": "jb_moe1_learned", "jc_base": "jc_moe3_learned"}
# call BI's prices were written under the capture call's labels (bi_prices.json: BH1-BH7 are BI1-BI7)
PRICE_LABEL = {f"BI{i}": f"BH{i}" for i in range(1, 8)}
# candidates that ran twice the base's micro-batches a step, judged per the base's (registered "per 4")
PER_BASE_MICROBATCHES = {"BE1": 2, "BF1": 2, "BF2": 2, "BF3": 2, "BG2": 2, "BG3": 2, "BN5": 2, "BP3": 2, "BV3": 2,
                          "BV4": 2, "BW1": 2, "BW2": 2}
# prices written after the call's first file, and the device calls that ran their twins (BE5: priced
# once 994b2e4 could, before call_be2 ran its twin)
LATE_PRICES = {"BE5": ("be5_prices.json", ("be2",))}
PRICE = re.compile(r"\| (-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\] \|")


def _read(name: str, call: str = "AP") -> str | None:
    try:
        return gain_pairs.timer_text(LOGS[call] + name)
    except FileNotFoundError:
        return None


def _registration(call: str) -> str:
    notes = (ROOT / "docs" / "notes.md").read_text()
    # one registration may hold two device calls' pairs ("Calls FC and FD: ...")
    heading = next(h for h in re.findall(r"^### (Calls? .*)$", notes, re.M)
                   if h.startswith((f"Call {call}:", f"Calls {call} and ")))
    return notes.split(f"### {heading}")[1].split("\n### ")[0]


def _row_price(label: str, rest: str, call: str) -> dict:
    """A registration row's price; a pair registered after its row (``LATE_PRICES``) from the file
    the notebook's paragraph quotes."""
    if label in LATE_PRICES:
        p = next(p for p in json.loads(_read(LATE_PRICES[label][0], call))["pairs"] if p["label"] == label)
        return {k: p[k] for k in ("best_ms", "low_ms", "high_ms")}
    best, low, high = map(float, PRICE.search("|" + rest).groups())
    return {"best_ms": best, "low_ms": low, "high_ms": high}


def _judged(call: str) -> list[dict]:
    """The call's pairs as registered, judged from the logs (steady iterations 10..30 unless
    ``RUNS`` says otherwise)."""
    rows = ROW.findall(_registration(call))
    assert rows, call
    prefix = call.lower()
    if call in ("AP", "AQ", "GB", "GC"):  # priced on the machine, in the call
        prices = {p["label"]: p for p in json.loads(_read(f"{prefix}_prices.json", call))["pairs"]}
    else:
        prices = {}
        for label, _, _, rest in rows:
            prices[label] = _row_price(label, rest, call)
    out = []
    for label, base, cand, _ in rows:
        runs, first, last = RUNS.get(label, (prefix, 10, 30))
        per = f"/{PER_BASE_MICROBATCHES[label]}" if label in PER_BASE_MICROBATCHES else ""
        out += judge_pairs.judge_call(prices, lambda name: _read(name, call), first, last,
                                      [f"{label}={runs}:{BASE_CONFIG.get(base, base)}:{cand}{per}"])
    return out


@pytest.mark.parametrize("call, measured, in_range, within", [
    ("AP", 1, 1, 0), ("AQ", 5, 5, 4), ("AR", 3, 2, 2), ("AS", 1, 1, 1), ("AU", 6, 6, 6), ("AW", 6, 6, 5),
    ("AX", 2, 2, 1), ("BB", 0, 0, 0), ("BC", 0, 0, 0), ("BE", 8, 8, 8), ("BF", 3, 3, 3),
    ("BG", 3, 3, 3), ("BI", 7, 7, 7), ("BJ", 5, 5, 5), ("BL", 2, 2, 2),
    ("BN", 6, 5, 5), ("BP", 4, 4, 2), ("BR", 5, 5, 4), ("BT", 5, 4, 4), ("BU", 2, 2, 2),
    ("BV", 4, 4, 4), ("BW", 2, 2, 2), ("BX", 3, 3, 2), ("CA", 2, 0, 0), ("CB", 0, 0, 0),
    ("CC", 2, 2, 2), ("CD", 0, 0, 0), ("CE", 4, 4, 4), ("CF", 2, 2, 1), ("DA", 0, 0, 0), ("DB", 1, 1, 1),
    ("DC", 0, 0, 0), ("DD", 1, 1, 1), ("DE", 0, 0, 0), ("DF", 2, 2, 2), ("DG", 0, 0, 0), ("DH", 1, 0, 0),
    ("DI", 0, 0, 0), ("DK", 2, 2, 1), ("EA", 0, 0, 0), ("EC", 3, 2, 2), ("EE", 0, 0, 0),
    ("FC", 1, 1, 1), ("GA", 3, 3, 3), ("GB", 2, 2, 2), ("GC", 1, 1, 1), ("IA", 1, 1, 0),
    ("IB", 0, 0, 0), ("JA", 1, 1, 1)])
def test_each_call_judged_from_its_logs_is_what_the_notebook_reports(call, measured, in_range, within):
    judged = [j for j in _judged(call) if j.get("measured")]
    assert (len(judged), sum(j["in_range"] for j in judged), sum(j["within"] for j in judged)) == \
        (measured, in_range, within)


@pytest.mark.parametrize("call", ["AP", "AQ"])
def test_in_call_prices_were_written_before_the_first_twin_started(call):
    """same_machine_pairs.sh prices the bases between their capture and the twins: the prices'
    UTC time precedes every untraced run's start stamp in the call's own log."""
    prefix = call.lower()
    written = json.loads(_read(f"{prefix}_prices.json"))["written_utc"].replace("+00:00", "Z")
    starts = re.findall(rf"^== {prefix}_\w+_u[12] rc=0 \S+ start=(\S+)", _read(f"{prefix}_run.log"), re.M)
    assert len(starts) >= 10
    assert all(written <= s for s in starts), (written, min(starts))


@pytest.mark.parametrize("call, pairs, drivers", [("AU", 6, ("au1", "au2")), ("AW", 8, ("aw1", "aw2")),
                                                  ("AX", 2, ("ax",)), ("BB", 9, ("bb1", "bb2", "bb3")),
                                                  ("BC", 4, ("bc",)), ("BE", 8, ("be1", "be2", "be3")),
                                                  ("BF", 3, ("bf",)), ("BG", 3, ("bg",)),
                                                  ("BI", 7, ("bi1", "bi2")), ("BJ", 5, ("bj",)),
                                                  ("BL", 2, ("bl",)), ("BN", 6, ("bn1", "bn2")),
                                                  ("BP", 4, ("bp",)), ("BR", 5, ("br1", "br2")),
                                                  ("BT", 5, ("bt1", "bt2")), ("BU", 2, ("bu",)),
                                                  ("BV", 4, ("bv2", "bv3")), ("BW", 2, ("bw",)),
                                                  ("BX", 3, ("bx2",)), ("CA", 6, ("ca2", "ca3")),
                                                  ("CB", 4, ("cb2", "cb3")), ("CC", 2, ("cc2",)),
                                                  ("CD", 5, ("cd2", "cd3")), ("CE", 4, ("ce2",)),
                                                  ("CF", 3, ("cf2", "cf3")),
                                                  ("DA", 4, ("da2", "da3", "da4")),
                                                  ("DB", 1, ("db2",)), ("DC", 1, ("dc2",)),
                                                  ("DD", 1, ("dd2",)), ("DE", 1, ("de2",)),
                                                  ("DF", 2, ("df2",)), ("DG", 2, ("dg2",)),
                                                  ("DH", 1, ("dh2",)), ("DI", 4, ("di2",)),
                                                  ("DK", 2, ("dk2",)), ("EA", 3, ("ea2",)), ("EC", 3, ("ec2",)),
                                                  ("EE", 2, ("ee2",)), ("FC", 6, ("fc", "fd")),
                                                  ("GA", 4, ("ga2", "ga3")), ("JA", 3, ("ja2",))])
def test_registered_prices_are_the_ones_written_before_the_twins_ran(call, pairs, drivers):
    """Calls AU-BL (registered the brief's way): the notebook's prices are price_pairs.py's file,
    whose UTC time precedes the start of each device call that ran the twins (a late price's, of
    the calls that ran its twin)."""
    rows = ROW.findall(_registration(call))
    assert len(rows) == pairs
    for label, _, _, rest in rows:
        file, its_drivers = LATE_PRICES.get(label, (f"{call.lower()}_prices.json", drivers))
        written = json.loads(_read(file, call))
        p = next(p for p in written["pairs"] if p["label"] == PRICE_LABEL.get(label, label))
        assert _row_price(label, rest, call) == {k: p[k] for k in ("best_ms", "low_ms", "high_ms")}, label
        if label in LATE_PRICES:  # the notebook quotes it where it registers it
            assert f"{p['best_ms']} [{p['low_ms']}, {p['high_ms']}]" in _registration(call), label
        stamp = written["written_utc"].replace("+00:00", "Z")
        for driver in (f"{d}_driver.log" for d in its_drivers):
            start = re.search(r"start (\S+)", _read(driver, call)).group(1)
            assert stamp < start, (label, stamp, driver, start)


def test_a_run_that_did_not_finish_leaves_its_pair_unmeasured():
    price = {"best_ms": 1.0, "low_ms": 0.0, "high_ms": 2.0}
    assert judge_pairs.judge(price, [100.0, None], [99.0, 99.0]) == {"measured": False, "why": "a run did not finish"}
    j = judge_pairs.judge(price, [100.0, 106.0], [99.0, 99.0])
    assert not j["measured"] and j["apart"][0] == pytest.approx(0.06)


def test_call_bb_unmeasured_pairs_judged_on_their_replicates_mean_as_the_notebook_reports():
    """Call BB's nine pairs all missed the 5% agreement rule (host-paced stages); the notebook
    also reports them on the two replicates' mean, outside the registered rule: 8 in range, 2
    within target, every run apart by 5.3% or more."""
    judged = _judged("BB")
    assert len(judged) == 9 and not any(j["measured"] for j in judged)
    assert min(max(j["apart"]) for j in judged) > 0.05
    assert (sum(j["in_range"] for j in judged), sum(j["within"] for j in judged)) == (8, 2)
    assert sorted(j["label"] for j in judged if j["within"]) == ["BB3", "BB7"]


def test_call_bc_unmeasured_pairs_on_their_replicates_mean_as_the_notebook_reports():
    """Call BC (priced on the calibrated host): none measured under the 5% rule; on the
    replicates' means all four inside their ranges, none within target."""
    judged = _judged("BC")
    assert len(judged) == 4 and not any(j["measured"] for j in judged)
    assert (sum(j["in_range"] for j in judged), sum(j["within"] for j in judged)) == (4, 0)


def test_call_bc_was_calibrated_to_its_capture_runs_own_steps_not_the_twins():
    """The step each of call BC's prices was calibrated to is the mean of its base's capture run's
    untraced steps 5..16 (before the capture range), recomputed from call BA's packed logs."""
    prices = json.loads(_read("bc_prices.json", "BC"))["pairs"]
    own = {}
    for base, log in (("ba_dense.sqlite", "ba_ba_dense.log"), ("ba_moe32.sqlite", "ba_ba_moe32.log")):
        steps = [float(ms) for it, ms in judge_pairs.STEP.findall(_read(log, "BC")) if 5 <= int(it) <= 16]
        assert len(steps) == 12
        own[base] = round(sum(steps) / len(steps), 1)
    for p in prices:
        assert p["given_untraced_step_ms"] == own[p["base"]], p["label"]
        assert 0.8 < p["host_factor"] < 0.9


def test_call_bn_overlap_miss_is_the_collectors_pauses_as_the_notebook_reports():
    """BN1's candidate (the reduce-scatter and the parameter all-gather overlapped) paused at
    steps 24 and 26 of both runs, 140-230 ms over its steady ~108 ms, where the base never
    did; call BO ran it again printing rank 0's collector times: a generation-2 collection
    (~160 ms) at step 24. Without those two steps BN1 realizes about 3 ms (priced 3.46)."""
    steps = lambda name: {int(i): float(ms) for i, ms in judge_pairs.STEP.findall(_read(name + ".log", "BN"))}  # noqa: E731
    for run in ("bn_bn_dp2_do_ovl_u1", "bn_bn_dp2_do_ovl_u2"):
        s = steps(run)
        slow = sorted(i for i in range(6, 31) if s[i] > 130.0)
        assert slow == [24, 26], run
        assert all(abs(s[i] - 108.3) < 1.0 for i in range(6, 31) if i not in slow), run
    assert not [i for r in ("bn_bm_dp2_do_u1", "bn_bm_dp2_do_u2") for i, ms in steps(r).items() if 6 <= i and ms > 130.0]
    gc = _read("bo_dp2_do_ovl_gc.log", "BO")
    gen2 = re.findall(r"^GC_MS it=(\d+) .*gen2=([\d.]+)", gc, re.M)
    assert [(int(i), float(ms) > 100) for i, ms in gen2] == [(24, True)]
    base = sum(sum(v for i, v in steps(r).items() if 6 <= i <= 30) / 25 for r in ("bn_bm_dp2_do_u1", "bn_bm_dp2_do_u2")) / 2
    cand = sum(sum(v for i, v in steps(r).items() if 6 <= i <= 30 and i not in (24, 26)) / 23
               for r in ("bn_bn_dp2_do_ovl_u1", "bn_bn_dp2_do_ovl_u2")) / 2
    assert 2.5 < base - cand < 3.5


def test_call_bt_overlap_base_paused_for_the_collector_as_the_notebook_reports():
    """BT5's base (the distributed optimizer with both overlaps, 2 micro-batches a step) paused at
    steps 24 and 26 of both runs, 130-190 ms over its steady ~108 ms, as BN1's candidate (the same
    configuration) did in call BN; its candidate (one micro-batch of twice the rows) never paused.
    Without those two steps BT5 realizes about 6 ms (priced 5.65)."""
    steps = lambda name: {int(i): float(ms) for i, ms in judge_pairs.STEP.findall(_read(name + ".log", "BT"))}  # noqa: E731
    for run in ("bt_bo_dp2_do_ovl_u1", "bt_bo_dp2_do_ovl_u2"):
        s = steps(run)
        assert sorted(i for i in range(6, 31) if s[i] > 130.0) == [24, 26], run
    cands = [steps(r) for r in ("bt_bt_dp2_do_ovl_mbs2_u1", "bt_bt_dp2_do_ovl_mbs2_u2")]
    assert all(ms < 110.0 for s in cands for i, ms in s.items() if i >= 6)
    base = sum(sum(v for i, v in steps(r).items() if 6 <= i <= 30 and i not in (24, 26)) / 23
               for r in ("bt_bo_dp2_do_ovl_u1", "bt_bo_dp2_do_ovl_u2")) / 2
    cand = sum(sum(v for i, v in s.items() if 6 <= i <= 30) / 25 for s in cands) / 2
    assert 5.5 < base - cand < 7.0


@pytest.mark.parametrize("call, replicates, in_range, within", [
    ("CB", ("cb", "cb3"), ["CB1", "CB3", "CB4"], ["CB1", "CB4"]),
    ("CD", ("cd", "cd3"), ["CD1", "CD3", "CD4", "CD5"], ["CD1", "CD3", "CD5"]),
    ("DA", ("da", "da4"), ["DA2", "DA3", "DA4"], ["DA4"])])
def test_unmeasured_calls_on_all_four_replicates_as_the_notebook_reports(call, replicates, in_range, within):
    """Calls CB, CD and DA went unmeasured in both pairs of replicates (CB2 and CB3, CD2 and CD3:
    host-paced one-GPU bases whose runs drift 7-29% apart on one lease; DA2/DA3 and DA4: host-paced
    two-GPU bases, 5-23% apart); the notebook also
    reports them on the mean of all four runs of each configuration, outside the registered rule."""
    rows = ROW.findall(_registration(call))
    prices = {label: _row_price(label, rest, call) for label, _, _, rest in rows}
    pairs = [(label, BASE_CONFIG.get(base, base), cand) for label, base, cand, _ in rows]
    for runs in replicates:
        judged = judge_pairs.judge_call(prices, lambda name: _read(name, call), 6, 30,
                                        [f"{label}={runs}:{base}:{cand}" for label, base, cand in pairs])
        assert not any(j["measured"] for j in judged), runs
    mean = lambda cfg: sum(judge_pairs.run_mean(_read(f"{p}_{cfg}_{u}.log", call), 6, 30)  # noqa: E731
                           for p in replicates for u in ("u1", "u2")) / 4
    hits = []
    for label, base, cand in pairs:
        b = mean(base)
        realized = b - mean(cand)
        p = prices[label]
        hits.append((label, gain_pairs.replay_in_range(p["low_ms"], p["high_ms"], realized, b),
                     gain_pairs.replay_within(p["best_ms"], realized, b)))
    assert [h[0] for h in hits if h[1]] == in_range
    assert [h[0] for h in hits if h[2]] == within


def test_call_cf_first_replicates_left_every_pair_unmeasured_its_second_measured_the_small_base():
    """Call CF2's replicates ran 5.0-38.5% apart (every pair unmeasured); call CF3 ran the small
    base's three configurations again (its prices unchanged) and they agreed: CF1 and CF2 are
    judged by those, CF3 (the mid base, not run again) stays unmeasured."""
    rows = ROW.findall(_registration("CF"))
    prices = {label: _row_price(label, rest, "CF") for label, _, _, rest in rows}
    first = judge_pairs.judge_call(prices, lambda name: _read(name, "CF"), 6, 30,
                                   [f"{label}=cf:{BASE_CONFIG[base]}:{cand}" for label, base, cand, _ in rows])
    assert not any(j["measured"] for j in first)
    second = {j["label"]: j for j in _judged("CF")}
    assert [label for label, j in second.items() if j.get("measured")] == ["CF1", "CF2"]


def test_call_db_second_replicates_left_its_pair_unmeasured():
    """Call DB registered two pairs of replicates (prefixes db, db2) without saying which judges:
    the first measured it (above), the second ran its candidate 5.0% apart (65.89, 69.21 ms)."""
    rows = ROW.findall(_registration("DB"))
    prices = {label: _row_price(label, rest, "DB") for label, _, _, rest in rows}
    (j,) = judge_pairs.judge_call(prices, lambda name: _read(name, "DB"), 6, 30,
                                  ["DB1=db2:db_dp2_do_ovlg:db_dp2_do_ovl"])
    assert not j["measured"]


def test_call_dc_first_replicates_unmeasured_its_second_a_loss():
    """Call DC registered its first pair of replicates to judge (15.7% apart: unmeasured) and the
    second to be reported beside it: measured there, the candidate ran slower (-6.09 against 0.47
    priced), outside the range."""
    rows = ROW.findall(_registration("DC"))
    prices = {label: _row_price(label, rest, "DC") for label, _, _, rest in rows}
    (j,) = judge_pairs.judge_call(prices, lambda name: _read(name, "DC"), 6, 30,
                                  ["DC1=dc2:dc_dp2_do_ovlg:dc_dp2_do_ovl"])
    assert j["measured"] and not j["in_range"] and -6.2 < j["realized"] < -6.0


def test_call_dd_second_replicates_agree_with_the_first():
    """Call DD's second pair of replicates (reported beside the first, which judges): measured
    too, and inside the range and within target as well (3.42 realized against 3.06 priced)."""
    rows = ROW.findall(_registration("DD"))
    prices = {label: _row_price(label, rest, "DD") for label, _, _, rest in rows}
    (j,) = judge_pairs.judge_call(prices, lambda name: _read(name, "DD"), 6, 30,
                                  ["DD1=dd2:dd_ep2_learned:dd_ep2_balanced"])
    assert j["measured"] and j["in_range"] and j["within"] and 3.3 < j["realized"] < 3.5


def test_call_de_replicates_unmeasured_both_above_the_range():
    """Call DE's host-paced pair: each pair of replicates ran its learned-routing base 5.0% and
    8.1% apart (unmeasured), and both realized more than the registered high end (21.66 and 36.59
    against 14.96 [7.74, 17.21])."""
    rows = ROW.findall(_registration("DE"))
    prices = {label: _row_price(label, rest, "DE") for label, _, _, rest in rows}
    js = judge_pairs.judge_call(prices, lambda name: _read(name, "DE"), 6, 30,
                                [f"DE1={p}:de_ep2_learned:de_ep2_balanced" for p in ("de", "de2")])
    assert [j["measured"] for j in js] == [False, False]
    assert [round(j["realized"], 2) for j in js] == [21.66, 36.59]


def test_call_ea_unmeasured_pairs_on_their_replicates_mean_as_the_notebook_reports():
    """Call EA's learned-routing one-GPU bases did not repeat within 5% (10% and 16% apart); on the
    replicates' means EA1 and EA2 inside their ranges, EA2 within target, and EB1's padding gained
    more in each replicate than its range's high end allows."""
    judged = {j["label"]: j for j in _judged("EA")}
    assert sorted(judged) == ["EA1", "EA2", "EB1"] and not any(j["measured"] for j in judged.values())
    assert [(judged[k]["in_range"], judged[k]["within"]) for k in ("EA1", "EA2", "EB1")] == \
        [(True, False), (True, True), (False, False)]
    eb1 = judged["EB1"]
    assert min(eb1["per_run"]) > eb1["price"]["high_ms"] + 0.03 * eb1["step"]


def test_call_fc_unmeasured_pairs_on_their_replicates_mean_as_the_notebook_reports():
    """Calls FC and FD (host-paced EP 2 stages, learned routing): FN1 alone measured; on the
    replicates' means all six inside their ranges and all but FA1 within target."""
    judged = {j["label"]: j for j in _judged("FC")}
    assert sorted(judged) == ["FA1", "FE1", "FE2", "FN1", "FS1", "FS2"]
    assert [k for k, j in judged.items() if j["measured"]] == ["FN1"]
    assert all(j["in_range"] for j in judged.values())
    assert sorted(k for k, j in judged.items() if not j["within"]) == ["FA1"]


def test_call_ga_allocator_churn_measured_within_target_and_low():
    """Call GA (Megatron-LM's --empty-unused-memory-level, from a config): the three GPU-bound stages
    measured, each inside its range and within target, and each realized gain above its price (the
    transform keeps the allocator's CPU time between its calls, as registered: "leans low"); the
    host-paced stage's base runs 27% apart."""
    judged = {j["label"]: j for j in _judged("GA")}
    assert sorted(judged) == ["GA1", "GA2", "GA3", "GA4"]
    measured = {k: j for k, j in judged.items() if j.get("measured")}
    assert sorted(measured) == ["GA1", "GA2", "GA3"]
    best = {label: _row_price(label, rest, "GA")["best_ms"] for label, _, _, rest in ROW.findall(_registration("GA"))}
    assert all(j["in_range"] and j["within"] and j["realized"] > best[k] for k, j in measured.items())


def test_call_gb_one_lease_meets_the_gains_from_above():
    """Call GB (GA's DP 2 and EP 2 pairs, base and candidate captured and run on one lease, priced in
    the call): both measured and within target, each price above its gain by less than 2 ms, where
    GA's (two leases) were 6.8 and 7.1 ms below."""
    prices = {p["label"]: p for p in json.loads(_read("gb_prices.json", "GB"))["pairs"]}
    for j in _judged("GB"):
        assert j["measured"] and j["within"], j["label"]
        assert 0 < prices[j["label"]]["best_ms"] - j["realized"] < 2.0, j["label"]


def _fifty_fourth(call: str) -> dict:
    """Calls KA-KC (fifty-fourth session; logs under timers/s54/): the prices price_pairs.py wrote,
    checked to be the ones the registration quotes and written before the device call started."""
    prefix = call.lower()
    written = json.loads(_read(f"{prefix}_call.json", "KA"))
    reg = _registration(call)
    for p in written["pairs"]:
        assert f"| {p['best_ms']:.2f} [{p['low_ms']:.2f}, {p['high_ms']:.2f}] |" in reg, p["label"]
    start = re.search(r"start (\S+)", _read(f"{prefix}_driver.log", "KA")).group(1)
    assert written["written_utc"].replace("+00:00", "Z") < start
    return {p["label"]: p for p in written["pairs"]}


def _judged_s54(prices: dict, first: int, last: int, specs: list[str]) -> list[dict]:
    return judge_pairs.judge_call(prices, lambda name: _read(name, "KA"), first, last, specs)


def test_call_ka_judged_from_its_logs_as_the_notebook_reports():
    """Call KA: the logs give what the notebook reports: KA1 and KA2 unmeasured (the memory
    stage's runs drift 10.9% and 7.8% apart), KA3 measured, in range and outside the target
    (20.92 realized against 13.03). Its rows name moe_train.py changes, not configs, so the
    pairs are spelled out here."""
    prices = _fifty_fourth("KA")
    judged = (_judged_s54(prices, 10, 29, ["KA1=ka:mem:memnocache", "KA2=ka:mem:memnooffload"])
              + _judged_s54(prices, 6, 30, ["KA3=ka:ia_moe1_learned:ka_moe1_mbs4_m1"]))
    assert [j["measured"] for j in judged] == [False, False, True]
    ka3 = judged[2]
    assert (ka3["in_range"], ka3["within"]) == (True, False) and round(ka3["realized"], 2) == 20.92


def test_call_kb_judged_from_its_logs_as_the_notebook_reports():
    """Call KB: call KA's memory-stage pairs on runs of 80 iterations, judged on 50..79 as
    registered: KB1 measured, in range by the 3% slack, over-priced (5.48 realized against
    12.41); KB2 unmeasured (its candidate's runs 22% apart)."""
    judged = _judged_s54(_fifty_fourth("KB"), 50, 79, ["KB1=kb:mem:memnocache", "KB2=kb:mem:memnooffload"])
    assert [j["measured"] for j in judged] == [True, False]
    assert (judged[0]["in_range"], judged[0]["within"]) == (True, False) and round(judged[0]["realized"], 2) == 5.48


def test_call_kc_judged_from_its_logs_as_the_notebook_reports():
    """Call KC: two of the plan's fixes together; unmeasured, the dropless base's two runs
    18.5% apart."""
    (j,) = _judged_s54(_fifty_fourth("KC"), 6, 30, ["KC1=kc:ia_moe1_learned:kc_moe1_capacity_mbs4_m1"])
    assert not j["measured"] and round(max(j["apart"]), 3) == 0.185


def _fifty_fifth(call: str, commit: str, labels: list[str]) -> dict:
    """Calls LA and LC (fifty-fifth session; logs under timers/s55/): priced on the device by the
    commit that registered the pairs, and written before the first twin started."""
    prefix = call.lower()
    written = json.loads(_read(f"{prefix}_call.json", "LA"))
    assert written["commit"] == commit and f"`same_machine_pairs.sh call_{prefix}`" in _registration(call)
    stamps = _read(f"{prefix}_call.out", "LA")
    first_twin = re.search(rf"^== {prefix}_\w+_u1 rc=0 wall=\d+s start=(\S+)", stamps, re.M).group(1)
    assert written["written_utc"].replace("+00:00", "Z") <= first_twin
    assert [p["label"] for p in written["pairs"]] == labels
    return {p["label"]: p for p in written["pairs"]}


def test_call_la_judged_from_its_logs_as_the_notebook_reports():
    """Call LA: the recompute scenario's three pairs unmeasured (its base's two runs 7.2% apart,
    every candidate's within 1%), the memory scenario's allocator churn, priced from a window
    past the warm-up, measured, in range and within target (9.22 realized against 7.50)."""
    prices = _fifty_fifth("LA", "4a26c229", ["LA1", "LA2", "LA3", "LA4"])
    read = lambda name: _read(name, "LA")  # noqa: E731
    rc = judge_pairs.judge_call(prices, read, 10, 29, ["LA1=la:rc:norc", "LA2=la:rc:mbs8/2", "LA3=la:rc:norc_mbs8/2"])
    assert [j["measured"] for j in rc] == [False] * 3 and round(max(rc[0]["apart"]), 3) == 0.072
    (mem,) = judge_pairs.judge_call(prices, read, 50, 79, ["LA4=la:mem:memnocache"])
    assert (mem["measured"], mem["in_range"], mem["within"]) == (True, True, True)
    assert round(mem["realized"], 2) == 9.22


LB_RUNS = ["compute", "recompute", "host", "offload", "memory", "ap_dense_s1k_rc", "ap_moe8", "ia_moe1_learned"]


def test_call_lb_early_window_against_the_later_run_as_the_notebook_reports():
    """Call LB: what a whole-run capture of the first 8 iterations keeps (profclass's own
    steady-window rule), against the same untraced run's iterations 50..79, from the packed timers."""
    early_window = _module("early_window", ROOT / "workloads" / "early_window.py")
    ratios = {r: early_window.early_and_later(_read(f"lb_{r}.log", "LB"))["ratio"] for r in LB_RUNS}
    assert ratios == {"compute": 1.503, "recompute": 1.319, "host": 0.947, "offload": 1.246, "memory": 1.535,
                      "ap_dense_s1k_rc": 1.238, "ap_moe8": 1.414, "ia_moe1_learned": 1.288}
    assert sum(v > 1.10 for v in ratios.values()) == 7  # "several more than 10% off": the line stands


def test_call_lc_judged_from_its_logs_as_the_notebook_reports():
    """Call LC: call LA's recompute-scenario pairs on a base captured over iterations 55..60 and
    runs judged on 50..79: all three measured, in range and within target."""
    prices = _fifty_fifth("LC", "18ab9336", ["LC1", "LC2", "LC3"])
    judged = judge_pairs.judge_call(prices, lambda name: _read(name, "LA"), 50, 79,
                                    ["LC1=lc:rc:norc", "LC2=lc:rc:mbs8/2", "LC3=lc:rc:norc_mbs8/2"])
    assert [(j["measured"], j["in_range"], j["within"]) for j in judged] == [(True, True, True)] * 3
    assert [round(j["realized"], 2) for j in judged] == [18.72, 22.84, 39.41]


def test_call_ld_judged_from_its_logs_as_the_notebook_reports():
    """Call LD: the offload pair on a late-captured memory-stage base; unmeasured a third time
    (the no-offload runs 13.4% apart)."""
    prices = _fifty_fifth("LD", "1cb94b66", ["LD1"])
    (j,) = judge_pairs.judge_call(prices, lambda name: _read(name, "LA"), 50, 79, ["LD1=ld:mem:memnooffload"])
    assert not j["measured"] and round(max(j["apart"]), 3) == 0.134


def test_call_ma_judged_from_its_logs_as_the_notebook_reports():
    """Call MA (fifty-sixth session): the bigger micro-batch on a flagless dense stage, priced in the
    call, measured, in range and within target (2.46 realized against 2.26); diff's decisions,
    written before the untraced runs, read twice the work a step off the timeline for 1 x 4 and
    called it an improvement per the base's work, as the untraced timers' per-work change (-5.0%
    and -4.8%, beyond 3% of the step) says; the raw step was +90.6%."""
    prices = _stamped_before_the_twins("MA", "d8bf8c15")
    read = lambda name: _read(name, "MA")  # noqa: E731
    (j,) = judge_pairs.judge_call(prices, read, 20, 39, ["MA1=ma:dense:dense_mbs2"])
    assert (j["measured"], j["in_range"], j["within"]) == (True, True, True) and round(j["realized"], 2) == 2.46
    diffs = json.loads(_read("ma_diffs.json", "MA"))
    m4, mbs2 = diffs["ma_dense_m4"], diffs["ma_dense_mbs2"]
    assert mbs2["step"]["work"] is None  # the same rows x micro-batches: judged as measured
    work = m4["step"]["work"]
    assert work["ratio"] == 2.0 and work["basis"].startswith("base 4096 rows x 2")
    assert m4["change"] == "improvement" and m4["step"]["delta_pct"] > 0  # raw: +90.6%
    runs = {c: [judge_pairs.run_mean(read(f"{c}_{r}.log"), 20, 39) for r in ("u1", "u2")]
            for c in ("ma_dense", "ma_dense_m4")}
    per_work = [c / 2 / b - 1 for b, c in zip(runs["ma_dense"], runs["ma_dense_m4"])]
    assert all(x < -0.03 for x in per_work)  # the timers: less time per the base's work, beyond 3%


def _stamped_before_the_twins(call: str, commit: str, diffs: int = 2) -> dict:
    """The call's prices, written by ``commit`` (the commit its registration names the call in)
    and, with its ``diffs`` diffs, before its first untraced run."""
    prefix = call.lower()
    written = json.loads(_read(f"{prefix}_call.json", call))
    registration = " ".join(_registration(call).split())  # the notebook wraps its lines
    assert written["commit"] == commit and f"`same_machine_pairs.sh call_{prefix}`" in registration
    stamps = _read(f"{prefix}_call.out", call)
    first_twin = re.search(rf"^== {prefix}_\w+_u1 rc=0 wall=\d+s start=(\S+)", stamps, re.M).group(1)
    assert written["written_utc"].replace("+00:00", "Z") <= first_twin
    written_diffs = re.findall(r"^DIFF_WRITTEN \w+ (\S+)", stamps, re.M)
    assert len(written_diffs) == diffs and all(t <= first_twin for t in written_diffs)
    return {p["label"]: p for p in written["pairs"]}


@pytest.mark.parametrize("call, commit, first, last, judged, dense_decision", [
    ("MB", "f58e05cd", 20, 39, [(False, None, None)] * 3, "improvement"),
    ("MC", "c3f2786e", 50, 79, [(True, False, False), (True, False, False), (False, None, None)],
     "no significant change")])
def test_calls_mb_and_mc_judged_from_their_logs_as_the_notebook_reports(call, commit, first, last, judged,
                                                                        dense_decision):
    """Calls MB and MC (fifty-seventh session): more micro-batches of one size on one-stage jobs,
    priced per the base's work by the accumulate transform in the call, held out. MB measured
    nothing (its host drifted within runs); MC, the same call with 80-step runs, measured the
    MoE stage's two pairs, both over-priced and outside their ranges (17.43 against 28.07, 28.74
    against 41.44), and not the dense stage's. diff read twice the work a step off the timeline
    on both x2 pairs and judged them per the base's work (the MoE pair an improvement in both
    calls; the dense pair's traced steps spread too wide in MC to call); where the untraced
    per-work change is measured (MC's MoE pair, about -19.5%) it is an improvement too."""
    prices = _stamped_before_the_twins(call, commit)
    p = call.lower()
    read = lambda name: _read(name, call)  # noqa: E731
    got = judge_pairs.judge_call(prices, read, first, last, [f"{call}1={p}:moe1:moe1_m4/2", f"{call}2={p}:moe1:moe1_m8/4",
                                                             f"{call}3={p}:dense_s1k:dense_s1k_m4/2"])
    assert [(j["measured"], j.get("in_range"), j.get("within")) if j["measured"] else (False, None, None)
            for j in got] == judged
    if call == "MC":
        assert [round(j["realized"], 2) for j in got[:2]] == [17.43, 28.74]
    diffs = json.loads(_read(f"{p}_diffs.json", call))
    for name in ("mb_moe1_m4", "mb_dense_s1k_m4"):
        work = diffs[name]["step"]["work"]
        assert work["ratio"] == 2.0 and " rows x 2 micro-batches" in work["basis"]
        assert diffs[name]["step"]["delta_pct"] > 0  # the raw step grew
    assert [diffs[n]["change"] for n in ("mb_moe1_m4", "mb_dense_s1k_m4")] == ["improvement", dense_decision]
    runs = {c: [judge_pairs.run_mean(read(f"{p}_{c}_{r}.log"), first, last) for r in ("u1", "u2")]
            for c in ("moe1", "moe1_m4")}
    agree = all(max(r) / min(r) - 1 <= judge_pairs.AGREE for r in runs.values())
    assert agree == (call == "MC")  # MB's MoE base runs 11.8% apart
    if agree:
        assert all(c / 2 / b - 1 < -0.03 for b, c in zip(runs["moe1"], runs["moe1_m4"]))


def test_call_md_judged_from_its_logs_as_the_notebook_reports():
    """Call MD (fifty-eighth session): the accumulate transform after the phase fix, held out, on
    call MC's one-GPU MoE stage with force-balanced and with learned routing, priced in the call
    before any untraced run. Both force-balanced pairs land inside their ranges and within target
    (13.35 against 14.18, 21.79 against 21.27); the learned pair, priced the same, realizes 11.05
    against 14.11, a miss (call MC's learned pair realized 17.43, above the same price)."""
    prices = _stamped_before_the_twins("MD", "709740ac", diffs=0)
    assert [prices[k]["best_ms"] for k in ("MD1", "MD2", "MD3")] == [14.18, 21.27, 14.11]
    got = judge_pairs.judge_call(prices, lambda name: _read(name, "MD"), 50, 79,
                                 ["MD1=md:moe1_bal:moe1_bal_m4/2", "MD2=md:moe1_bal:moe1_bal_m8/4",
                                  "MD3=md:moe1_lrn:moe1_lrn_m4/2"])
    assert [(j["measured"], j["in_range"], j["within"]) for j in got] == [(True, True, True), (True, True, True),
                                                                         (True, False, False)]
    assert [round(j["realized"], 2) for j in got] == [13.35, 21.79, 11.05]


def test_call_me_measured_nothing_and_its_diff_read_the_work_as_the_notebook_reports():
    """Call ME (fifty-eighth session): the accumulate transform on a GPU-paced dense stage and a
    two-layer force-balanced MoE stage, priced and diffed in the call before any untraced run.
    Nothing measured: every candidate's two runs are more than 5% apart (their steps jump between
    two levels). diff read twice the work a step off the timeline on the dense x2 pair and called
    it an improvement per the base's work; with no measured untraced change it is not judged."""
    prices = _stamped_before_the_twins("ME", "638892a7", diffs=1)
    assert [prices[k]["best_ms"] for k in ("ME1", "ME2", "ME3")] == [6.66, 8.36, 15.07]
    got = judge_pairs.judge_call(prices, lambda name: _read(name, "ME"), 50, 79,
                                 ["ME1=me:dense_h4k:dense_h4k_m4/2", "ME2=me:dense_h4k:dense_h4k_m8/4",
                                  "ME3=me:moe2_bal:moe2_bal_m4/2"])
    assert [j["measured"] for j in got] == [False] * 3
    assert [round(100 * max(j["apart"]), 1) for j in got] == [8.8, 12.0, 6.5]
    diff = json.loads(_read("me_diffs.json", "ME"))
    assert diff["change"] == "improvement" and diff["step"]["delta_pct"] > 0  # raw: the step grew
    assert diff["step"]["work"]["ratio"] == 2.0 and diff["step"]["work"]["delta_pct"] < -3


def test_call_me_floors_fit_one_line_at_the_gpus_pace():
    """Call ME's dense stage: its untraced runs' fastest steps at 2, 4 and 8 micro-batches fit one
    line (a micro-batch's time, 10.2 ms, and a step's once-a-step time), giving 9.7 and 14.6 per the
    base's work where the replay then priced 6.7 and 8.4. The report's caveat quoted them as the
    replay's slower host until call MI found the cause elsewhere (the dropped turn's gradient-norm
    sync the accumulate transform kept), so it quotes them no more."""
    from profclass.replay.notes import untraced_caveat

    floor = {m: min(min(float(ms) for it, ms in judge_pairs.STEP.findall(_read(f"me_dense_h4k{s}_{r}.log", "ME"))
                        if 50 <= int(it) <= 79) for r in ("u1", "u2"))
             for m, s in ((2, ""), (4, "_m4"), (8, "_m8"))}
    gains = [floor[2] - floor[k] * 2 / k for k in (4, 8)]
    per_mb = [(floor[4] - floor[2]) / 2, (floor[8] - floor[4]) / 4]
    assert abs(per_mb[0] - per_mb[1]) < 0.1 and round(per_mb[0], 1) == 10.2
    assert [round(g, 1) for g in gains] == [9.7, 14.6]
    prices = _stamped_before_the_twins("ME", "638892a7", diffs=1)
    assert [prices["ME1"]["best_ms"], prices["ME2"]["best_ms"]] == pytest.approx([6.66, 8.36], abs=0.005)
    assert f"{gains[0]:.1f}" not in untraced_caveat(90.0, 100.0, ("x",))


def test_call_mf_judged_from_its_logs_as_the_notebook_reports():
    """Call MF (fifty-ninth session): diff's decision, on the captured windows and with the capture
    runs' own logs, written before any untraced run on a one-GPU MoE stage. The truth is the
    construction (two captures of one configuration: no change) or the untraced timers' change
    (no change within 3% of the base's step, else its sign); all four decisions are right either
    way. The recompute-off price lands in its range and misses the target (17.29 against 12.34):
    its traced price is the traced gain, its untraced base step is 4.7% slower than the runs."""
    prices = _stamped_before_the_twins("MF", "93ae6513", diffs=4)
    assert prices["MF1"]["best_ms"] == 17.29 and prices["MF2"]["best_ms"] is None  # no EP: no routing price
    read = lambda name: _read(name, "MF")  # noqa: E731
    (j,) = judge_pairs.judge_call(prices, read, 50, 79, ["MF1=mf:mf_moe1_bal_rc:md_moe1_bal"])
    assert (j["measured"], j["in_range"], j["within"]) == (True, True, False) and round(j["realized"], 2) == 12.34
    runs = {c: [judge_pairs.run_mean(read(f"mf_{c}_u{r}.log"), 50, 79) for r in (1, 2)]
            for c in ("md_moe1_bal", "mf_moe1_bal_rc", "md_moe1_lrn")}
    assert all(max(v) / min(v) - 1 <= judge_pairs.AGREE for v in runs.values())  # every pair measured

    def truth(base: str, cand: str) -> str:
        b, c = sum(runs[base]) / 2, sum(runs[cand]) / 2
        return "no significant change" if abs(c - b) <= 0.03 * b else ("regression" if c > b else "improvement")

    expected = {"twin": "no significant change", "rc_off": truth("mf_moe1_bal_rc", "md_moe1_bal"),
                "rc_on": truth("md_moe1_bal", "mf_moe1_bal_rc"), "learned": truth("md_moe1_bal", "md_moe1_lrn")}
    assert list(expected.values()) == ["no significant change", "improvement", "regression", "regression"]
    diffs = json.loads(read("mf_diffs.json"))
    for name, want in expected.items():
        assert diffs[name]["change"] == diffs[f"{name}_logs"]["change"] == want, name
        assert "timer" not in diffs[name] and diffs[f"{name}_logs"]["timer"]["values"] == [50, 50]
    assert diffs["rc_off"]["fix"] == diffs["rc_off_logs"]["fix"] == ["recompute_off"]  # led by the recognised change
    # the logs' change is nearer the untraced one than the traced windows' on every changed pair
    for name, (base, cand) in (("rc_on", ("md_moe1_bal", "mf_moe1_bal_rc")), ("learned", ("md_moe1_bal", "md_moe1_lrn"))):
        untraced = 100 * (sum(runs[cand]) / sum(runs[base]) - 1)
        assert abs(diffs[f"{name}_logs"]["timer"]["delta_pct"] - untraced) < abs(diffs[name]["delta_pct"] - untraced)


def test_call_mg_judged_from_its_logs_as_the_notebook_reports():
    """Call MG (sixtieth session): MF1 and ME1 priced again on a fresh machine before any untraced
    run. MG1 (recompute off) is not measured: its base's two runs are 5.6% apart (its gain 16.04,
    inside 18.75 [12.08, 22.58] all the same); MG2 (the dense stage's micro-batches x2, per the base's
    work) is measured, inside its range and within target (8.38 against 7.2; ME's replicates of it
    were never measured)."""
    prices = _stamped_before_the_twins("MG", "6ceff1ca", diffs=0)
    assert [prices[k]["best_ms"] for k in ("MG1", "MG2")] == [18.75, 7.2]
    got = judge_pairs.judge_call(prices, lambda name: _read(name, "MG"), 50, 79,
                                 ["MG1=mg:mf_moe1_bal_rc:md_moe1_bal", "MG2=mg:me_dense_h4k:me_dense_h4k_m4/2"])
    assert [j["measured"] for j in got] == [False, True]
    assert round(100 * max(got[0]["apart"]), 1) == 5.6 and round(got[0]["realized"], 2) == 16.04
    assert (got[1]["in_range"], got[1]["within"], round(got[1]["realized"], 2)) == (True, True, 8.38)


def test_call_mh_the_capture_logs_calibration_judged_as_the_notebook_reports():
    """Call MH (sixtieth session): each pair priced before any untraced run as shipped (MH1-MH3) and
    on the host calibrated to its base capture run's own log (MH4-MH6). As shipped: 2 of 3 within
    target; calibrated: 1 of 3. That machine's capture logs ran at or above the untraced runs, so the
    calibration slowed the host (x1.10 on the recompute base, x1.27 on the dense stage) and both
    host-paced prices moved away from their outcomes; the force-balanced stage's log was within 2%
    of its replay and left it as it was."""
    prices = _stamped_before_the_twins("MH", "6e4f77b2", diffs=0)
    from profclass import train_log
    for label, base in (("MH4", "rc"), ("MH5", "bal"), ("MH6", "dense")):  # the given step is the packed log's
        step = train_log.untraced_step(train_log.parse(_read(f"mh_{base}_capture.log", "MH"), base)).step_ms
        assert prices[label]["train_log"] == f"mh_{base}.log"
        assert prices[label]["given_untraced_step_ms"] == pytest.approx(step, abs=1e-3)
    assert [prices[f"MH{i}"]["host_factor"] for i in (4, 5, 6)] == [1.1022, 1.0, 1.2703]
    specs = ["MH{}=mh:mf_moe1_bal_rc:md_moe1_bal", "MH{}=mh:md_moe1_bal:md_moe1_bal_m4/2",
             "MH{}=mh:me_dense_h4k:me_dense_h4k_m4/2"]
    got = judge_pairs.judge_call(prices, lambda name: _read(name, "MH"), 50, 79,
                                 [spec.format(i) for i, spec in enumerate(specs * 2, start=1)])
    assert all(j["measured"] for j in got)
    assert [round(j["realized"], 2) for j in got[:3]] == [13.78, 14.33, 9.86]
    assert [(j["in_range"], j["within"]) for j in got] == [(True, True), (True, True), (False, False),
                                                           (True, False), (True, True), (False, False)]


def _judged_call(call: str, commit: str, specs: list[str]) -> tuple[dict, list[dict]]:
    """A same-machine call's prices, stamped before its twins (no diffs), and its pairs judged on
    50..79 (call MD's rule) from its packed logs."""
    prices = _stamped_before_the_twins(call, commit, diffs=0)
    return prices, judge_pairs.judge_call(prices, lambda name: _read(name, call), 50, 79, specs)


def test_call_mi_the_one_stage_accumulate_price_judged_from_its_logs_as_the_notebook_reports():
    """Call MI (sixty-first session): the accumulate transform as shipped then, on call ME's dense
    stage at 2 and 4 micro-batches and a new dense shape. MI1 measured and short, outside its range
    (8.92 against 4.9 [3.62, 6.48]: the dropped turn's gradient-norm sync, found in its export after
    the run); MI2-MI4 unmeasured (the x8 runs 14.7% apart, the h2k runs 8.2%)."""
    prices, got = _judged_call("MI", "4ccf9d54", [
        "MI1=mi:me_dense_h4k:me_dense_h4k_m4/2", "MI2=mi:me_dense_h4k:me_dense_h4k_m8/4",
        "MI3=mi:me_dense_h4k_m4:me_dense_h4k_m8/2", "MI4=mi:mi_dense_h2k:mi_dense_h2k_m4/2"])
    assert [prices[f"MI{i}"]["best_ms"] for i in range(1, 5)] == [4.9, 6.3, 4.65, 4.06]
    assert [j["measured"] for j in got] == [True, False, False, False]
    assert (got[0]["in_range"], got[0]["within"], round(got[0]["realized"], 2)) == (False, False, 8.92)
    assert [round(100 * max(j["apart"]), 1) for j in got[1:]] == [14.7, 14.7, 8.2]


def test_call_mj_the_rebuilt_accumulate_price_held_out_as_the_notebook_reports():
    """Call MJ (sixty-first session): the accumulate transform rebuilt after call MI (whole turns
    dropped with their syncs), held out on two new shapes and the learned-routing stage. Only MJ4
    measured, short and outside its range (20.30 against 14.04 [13.33, 14.04]); the dense pairs
    inside their ranges and within target but unmeasured (runs 5.3% and 7.2% apart), the new MoE
    stage's runs 12.3% apart."""
    prices, got = _judged_call("MJ", "43291be4", [
        "MJ1=mj:mj_dense_h3k:mj_dense_h3k_m4/2", "MJ2=mj:mj_dense_h3k:mj_dense_h3k_m6/3",
        "MJ3=mj:mj_moe_e4:mj_moe_e4_m4/2", "MJ4=mj:md_moe1_lrn:md_moe1_lrn_m4/2"])
    assert [prices[f"MJ{i}"]["best_ms"] for i in range(1, 5)] == [6.03, 8.57, 4.76, 14.04]
    assert [j["measured"] for j in got] == [False, False, False, True]
    assert (got[3]["in_range"], got[3]["within"], round(got[3]["realized"], 2)) == (False, False, 20.30)
    assert [(j["in_range"], j["within"]) for j in got[:2]] == [(True, True), (True, True)]
    assert [round(100 * max(j["apart"]), 1) for j in got[:3]] == [5.3, 7.2, 12.3]


def test_call_mk_calls_mjs_pairs_again_as_the_notebook_reports():
    """Call MK (sixty-first session): call MJ's three pairs again on a fresh machine, the transform
    unchanged. None measured (the x2 dense runs 6.0% apart, the x3 11.0%, the MoE stage's 16.3%); the
    dense stage realized 7.08 against 7.15 in MJ, priced 7.0 and 6.03, and the MoE stage gained
    0.23 against MJ's 0.83, priced 4.71 and 4.76: over-priced in both, as registered."""
    prices, got = _judged_call("MK", "2a823fd9", [
        "MK1=mk:mj_dense_h3k:mj_dense_h3k_m4/2", "MK2=mk:mj_dense_h3k:mj_dense_h3k_m6/3",
        "MK3=mk:mj_moe_e4:mj_moe_e4_m4/2"])
    assert [prices[f"MK{i}"]["best_ms"] for i in range(1, 4)] == [7.0, 10.72, 4.71]
    assert not any(j["measured"] for j in got)
    assert [round(100 * max(j["apart"]), 1) for j in got] == [6.0, 11.0, 16.3]
    assert [round(j["realized"], 2) for j in got] == [7.08, 9.01, 0.23]
    assert [(j["in_range"], j["within"]) for j in got] == [(True, True), (True, False), (False, False)]
