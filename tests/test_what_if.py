"""``profclass diagnose --what-if``: fixes priced by the replay on request, alone or together,
in the JSON (``replay.requested``, valid against the schema) and every report; a request the
replay cannot price is a ``missing[]`` line; an unknown fix id is a usage error (exit 2)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import profile_path
from test_contract import _validate

from profclass.cli import main

TOGETHER = "offload_last_resort+moe_drop_and_pad"


@pytest.fixture(scope="module")
def asked():
    path = str(profile_path("memory_offload_1gpu"))
    run = CliRunner().invoke(main, ["diagnose", "-q", "--format", "json", path,
                                    "--what-if", TOGETHER, "--what-if", "recompute_off"])
    assert run.exit_code == 0, run.output
    return path, json.loads(run.output)


def test_json_holds_each_priced_request_and_says_why_one_is_not(asked):
    _, d = asked
    _validate("diagnose", d)  # closed: the schema describes replay.requested
    p = d["replay"]["requested"][TOGETHER]
    assert p["low_ms"] <= p["best_ms"] <= p["high_ms"] < d["replay"]["untraced_step_ms"]
    # together: the plan's first two steps (offload, then drop-and-pad) bank the same
    assert [s["id"] for s in d["plan"][:2]] == TOGETHER.split("+")
    assert p["best_ms"] == pytest.approx(sum(s["gain_ms"] for s in d["plan"][:2]), abs=0.05)
    assert "recompute_off" not in d["replay"]["requested"]  # no recompute in this profile
    assert any(m.startswith("what-if recompute_off: not priced") for m in d["missing"])


@pytest.mark.parametrize("fmt", ["text", "markdown", "html"])
def test_every_report_shows_the_requests(asked, fmt):
    path, d = asked
    run = CliRunner().invoke(main, ["diagnose", "-q", "--format", fmt, path,
                                    "--what-if", TOGETHER, "--what-if", "recompute_off"])
    assert run.exit_code == 0, run.output
    flat = " ".join(run.output.split())
    best = d["replay"]["requested"][TOGETHER]["best_ms"]
    assert f"({TOGETHER}): -{best:.1f} ms/step" in flat
    assert "What if recompute_off: not priced" in flat


def test_an_unknown_fix_is_a_usage_error_naming_it():
    run = CliRunner().invoke(main, ["diagnose", "-q", str(profile_path("memory_offload_1gpu")),
                                    "--what-if", "recompute_off+no_such_fix"])
    assert run.exit_code == 2
    assert "no replay transform for no_such_fix" in run.output
