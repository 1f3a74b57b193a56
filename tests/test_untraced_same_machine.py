"""The untraced step on the capture's own machine (workloads/untraced_same_machine.py): recomputed
from the same-machine calls' packed price files and untraced logs, as docs/replay.md states it."""
from __future__ import annotations

import importlib.util
import statistics

from conftest import ROOT

spec = importlib.util.spec_from_file_location("untraced_same_machine", ROOT / "workloads" / "untraced_same_machine.py")
usm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(usm)


def test_the_docs_state_what_the_packed_logs_give():
    rs = usm.rows()
    within = sum(abs(r["error"]) <= usm.WITHIN for r in rs)
    traced = sum(abs(r["traced_error"]) <= usm.WITHIN for r in rs)
    docs = (ROOT / "docs" / "replay.md").read_text()
    assert f"{within} of {len(rs)} bases within 5% of their own untraced timer (the\ntraced step itself: {traced})" in docs
    assert f"median |error| {statistics.median(abs(r['error']) for r in rs):.1f}%" in docs
    # every call of the same-machine series with a price file is read, each base's runs found
    assert {r["call"] for r in rs} >= {"AP", "AQ", "BB", "CA", "DG", "EA", "IA", "JA"}
    assert all(r["runs"] >= 2 for r in rs)


def test_a_base_priced_with_a_given_untraced_step_is_left_out():
    """Calibrated prices (``host_factor``) were solved to meet a given step: they are no test of
    the model's own untraced step."""
    packed = usm.gain_pairs._packed()
    import json
    given = {p["base"] for path, text in packed.items() if path.endswith("_prices.json")
             for p in json.loads(text)["pairs"] if p.get("host_factor")}
    assert given  # call BC's bases were priced calibrated
    assert not any(r["base"] in {g.rsplit("/", 1)[-1].removesuffix(".sqlite") for g in given} and r["call"] == "BC"
                   for r in usm.rows())
