"""The versioned output contract (profclass.contract, docs/json.md): every fixture's diagnosis and
every corpus diff validates against the shipped schema, the versions agree, released fields do
not vanish without a major version, docs/json.md is up to date, saved JSON reads back."""
from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import CORPUS, PROFILES, profile_path
from profclass import contract
from profclass.contract import SCHEMA_VERSION, field_paths, load_schema, major

ROOT = Path(__file__).resolve().parents[1]
FIELDS = Path(__file__).parent / "data" / f"schema_fields_v{major(SCHEMA_VERSION)}.txt"
PAIRS = CORPUS["pair"]
PAIR_IDS = [f"{p['base']}->{p['candidate']}" for p in PAIRS]


def _closed(schema):
    """The schema with additionalProperties: false on every object that lists its properties:
    the shipped schema is open (minor versions add fields), the test is not (the schema must
    describe every field the output has)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(s)
    return s


def _validate(kind: str, doc: dict) -> None:
    schema = load_schema(kind)
    for s in (schema, _closed(schema)):
        errors = sorted(jsonschema.Draft202012Validator(s).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}"[:300] for e in errors[:10])


@pytest.mark.parametrize("kind", contract.SCHEMA_KINDS)
def test_schema_is_valid_draft_2020_12_and_open(kind):
    schema = load_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION

    def objects(node):
        if isinstance(node, dict):
            if "properties" in node:
                yield node
            for v in node.values():
                yield from objects(v)
        elif isinstance(node, list):
            for v in node:
                yield from objects(v)
    # minor versions add fields: no object of the shipped schema may refuse unknown properties
    assert all(o.get("additionalProperties", True) is not False for o in objects(schema))


@pytest.mark.parametrize("kind", contract.SCHEMA_KINDS)
def test_every_field_has_a_description_and_examples_validate(kind):
    schema = load_schema(kind)
    rows = []
    contract_docs = pytest.importorskip("profclass.contract_docs")
    for name, prop in schema["properties"].items():
        contract_docs._row(name, prop, schema, rows)
        contract_docs._rows(prop, schema, name, rows)
        for ex in prop.get("examples", []):
            sub = dict(prop, **{"$defs": schema["$defs"]})
            jsonschema.Draft202012Validator(_closed(sub)).validate(ex)
    undescribed = [r for r in rows if r.rstrip().endswith("|  |")]
    assert not undescribed, undescribed[:5]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_fixture_diagnosis_validates(name, diagnosis):
    doc = json.loads(diagnosis(name).to_json())
    assert doc["schema_version"] == SCHEMA_VERSION == load_schema("diagnose")["properties"]["schema_version"]["const"]
    assert doc["profclass_version"] == contract.profclass_version()
    _validate("diagnose", doc)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_every_corpus_diff_validates(pair, diagnosis):
    from profclass.diff import diff
    doc = json.loads(diff(diagnosis(pair["base"]), diagnosis(pair["candidate"])).to_json())
    assert doc["schema_version"] == SCHEMA_VERSION == load_schema("diff")["properties"]["schema_version"]["const"]
    _validate("diff", doc)


def _released() -> tuple[str, set[str]]:
    lines = FIELDS.read_text().splitlines()
    version = lines[0].split()[2].rstrip(":")
    return version, {ln for ln in lines[1:] if ln and not ln.startswith("#")}


def _current() -> set[str]:
    return {f"{k}:{p}" for k in contract.SCHEMA_KINDS for p in field_paths(load_schema(k))}


def test_released_fields_are_kept_within_the_major():
    """Removing or renaming a field is a major change: every path of the released field list of
    this major must still be in the schema. (A new major starts a new schema_fields_v<N>.txt.)"""
    assert FIELDS.exists(), (f"no {FIELDS.name}: a new major version starts one with "
                             "'python -m profclass.contract_cli --fields'")
    version, released = _released()
    assert major(version) == major(SCHEMA_VERSION)
    gone = sorted(released - _current())
    assert not gone, (f"fields of schema {version} removed or renamed without a major version bump "
                      f"(SCHEMA_VERSION {SCHEMA_VERSION}): {gone[:10]}")


def test_added_fields_move_the_minor():
    """Fields the released list lacks are a minor change: the version must have moved past the
    list's, and the list is then regenerated (python -m profclass.contract_cli --fields)."""
    version, released = _released()
    added = sorted(_current() - released)
    if added:
        assert tuple(map(int, SCHEMA_VERSION.split("."))) > tuple(map(int, version.split("."))), (
            f"fields added since schema {version} without a minor version bump: {added[:10]}")
    assert FIELDS.read_text() == contract.fields_text(), (
        f"{FIELDS.name} is stale: python -m profclass.contract_cli --fields {FIELDS.relative_to(ROOT)}")


def test_the_field_list_update_refuses_unversioned_changes(tmp_path, monkeypatch):
    listed = tmp_path / "fields.txt"
    listed.write_text(contract.fields_text())
    real = contract.fields_text()
    monkeypatch.setattr(contract, "fields_text", lambda: real + "diagnose:brand_new\n")
    with pytest.raises(ValueError, match="bump the minor"):
        contract.update_fields(str(listed))
    major_, minor_ = (int(x) for x in contract.SCHEMA_VERSION.split(".")[:2])
    monkeypatch.setattr(contract, "SCHEMA_VERSION", f"{major_}.{minor_ + 1}.0")
    contract.update_fields(str(listed))  # a newer minor may add
    monkeypatch.setattr(contract, "fields_text", lambda: real.replace("diagnose:walls.host\n", ""))
    with pytest.raises(ValueError, match="new major"):
        contract.update_fields(str(listed))


def test_field_paths_notice_a_rename():
    schema = load_schema("diagnose")
    renamed = copy.deepcopy(schema)
    renamed["$defs"]["device"]["properties"]["features"]["properties"]["gemm_ns2"] = \
        renamed["$defs"]["device"]["properties"]["features"]["properties"].pop("gemm_ns")
    lost = field_paths(schema) - field_paths(renamed)
    assert lost == {"devices[].features.gemm_ns"}


def test_docs_json_md_is_up_to_date():
    from profclass.contract_docs import render_docs
    assert (ROOT / "docs" / "json.md").read_text() == render_docs(), \
        "docs/json.md is stale: python -m profclass.contract_cli --docs docs/json.md"


def test_schema_command_prints_the_shipped_schema_without_pandas():
    code = ("import sys\nfrom profclass.cli import main\ntry:\n    main(['schema', 'diff'])\n"
            "except SystemExit:\n    pass\nassert 'pandas' not in sys.modules, 'pandas was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == load_schema("diff")


def test_input_hashes_are_streamed_sha256(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * (contract.HASH_CHUNK * 2 + 7))
    d = tmp_path / "ranks"
    d.mkdir()
    (d / "r0.sqlite").write_bytes(b"r0")
    got = contract.input_hashes([str(f), str(d), str(tmp_path / "gone")])
    assert got[str(f)] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert got[str(d / "r0.sqlite")] == hashlib.sha256(b"r0").hexdigest()
    assert got[str(tmp_path / "gone")] is None


# ---------------------------------------------------------------------------------------------
# reading saved JSON back

def _save(tmp_path, diagnosis, name, edit=None, tag="") -> str:
    doc = json.loads(diagnosis(name).to_json())
    if edit:
        edit(doc)
    p = tmp_path / f"{name}{tag}.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_json_only_diff_equals_the_profile_diff(tmp_path, diagnosis):
    """kernels[] (the whole per-kernel table) is in the JSON: a diff of two saved diagnoses has
    the same numbers as a diff of the profiles, and says in its notes what it could not do."""
    from profclass.diff import diff
    base, cand = "comm_4gpu", "comm_4gpu_2xdispatch"
    live = diff(diagnosis(base), diagnosis(cand)).to_dict()
    saved = diff(_save(tmp_path, diagnosis, base), _save(tmp_path, diagnosis, cand)).to_dict()
    notes = saved.pop("notes")
    assert live.pop("notes") == [n for n in notes if "saved diagnosis" not in n]
    # the replayed split needs the graph, which no JSON holds: missing[] says so
    split_saved, split_live = saved["step"].pop("split"), live["step"].pop("split")
    assert split_live["parts"] and not split_saved["parts"]
    assert all("no replay inputs" in m for m in split_saved["missing"]) and len(split_saved["missing"]) == 2
    assert saved == live
    assert any(n.startswith("base: read from saved diagnosis") and "--iteration-range" in n for n in notes)
    _validate("diff", saved | {"notes": notes})
    _validate("diff", live | {"notes": notes, "step": {**live["step"], "split": split_live}})


def test_diff_refuses_saved_json_of_another_major(tmp_path, diagnosis):
    from profclass.errors import ProfileError
    from profclass.diff import diff
    good = _save(tmp_path, diagnosis, "compute_1gpu")
    other = f"{contract.major(contract.SCHEMA_VERSION) + 1}.0.0"  # the next major, whatever this one is
    bad = _save(tmp_path, diagnosis, "host_1gpu", lambda d: d.update(schema_version=other))
    with pytest.raises(ProfileError, match=rf"host_1gpu\.json: written with output schema {re.escape(other)}"):
        diff(good, bad)
    out = subprocess.run([sys.executable, "-m", "profclass", "diff", good, bad], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "host_1gpu.json" in out.stderr


def test_diff_reads_a_diagnosis_written_before_the_contract(tmp_path, diagnosis):
    from profclass.diff import diff

    def legacy(d):
        del d["schema_version"], d["profclass_version"]
    r = diff(_save(tmp_path, diagnosis, "compute_1gpu", legacy, tag="_old"), _save(tmp_path, diagnosis, "compute_1gpu"))
    assert any("written before schema_version existed" in n for n in r.notes)


def test_diff_refuses_json_that_is_not_a_diagnosis(tmp_path, diagnosis):
    from profclass.errors import ProfileError
    from profclass.diff import diff
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"name": "not profclass"}))
    with pytest.raises(ProfileError, match="other.json: not a profclass diagnosis"):
        diff(str(other), _save(tmp_path, diagnosis, "compute_1gpu"))
    bad = tmp_path / "badver.json"
    bad.write_text(json.dumps({"schema_version": "one"}))
    with pytest.raises(ProfileError, match="badver.json: schema_version 'one' is not a MAJOR.MINOR.PATCH"):
        diff(str(bad), _save(tmp_path, diagnosis, "compute_1gpu"))


def test_the_closed_check_catches_an_undescribed_field(diagnosis):
    doc = json.loads(diagnosis("compute_1gpu").to_json())
    doc["devices"][0]["features"]["new_thing_ns"] = 1
    with pytest.raises(AssertionError, match="new_thing_ns"):
        _validate("diagnose", doc)
    doc = json.loads(diagnosis("compute_1gpu").to_json())
    doc["walls"]["memory"]["share"] = 0  # an int is a number
    doc["devices"][0]["features"]["peak_memory_bytes"] = "unknown"
    with pytest.raises(AssertionError, match="peak_memory_bytes"):
        _validate("diagnose", doc)


def test_hook_record_carries_versions_and_input_hashes(tmp_path, diagnosis):
    from profclass.hook import run_hook
    prof = profile_path("compute_1gpu")
    base = _save(tmp_path, diagnosis, "compute_1gpu", tag="_baseline")
    res = run_hook(str(prof), out=str(tmp_path / "out"), baseline=base)
    rec = json.loads(Path(res.json_path).read_text())
    assert list(rec)[:2] == ["schema_version", "profclass_version"]
    assert rec["schema_version"] == SCHEMA_VERSION and rec["profclass_version"] == contract.profclass_version()
    assert rec["input_sha256"] == {str(prof): hashlib.sha256(prof.read_bytes()).hexdigest(),
                                   base: hashlib.sha256(Path(base).read_bytes()).hexdigest()}
    _validate("diagnose", rec["diagnosis"])
    _validate("diff", rec["diff"])
