"""The versioned output contract of profclass's JSON (``diagnose``, ``diff``, ``hook``).

Every JSON output carries ``schema_version`` (semantic versioning of the *output*, not of the
code: a minor bump adds fields, a major bump removes or renames one or changes a meaning) and
``profclass_version`` (the package that wrote it). The JSON Schemas (draft 2020-12) that
describe the output exactly are package data, ``profclass/data/schema/<kind>.schema.json``;
``profclass schema diagnose|diff`` prints them and docs/json.md is generated from them
(``python -m profclass.contract_cli --docs``).

Changing the output (see docs/json.md, "Changing the output"):

- add a field  -> describe it in the schema, bump the MINOR of ``SCHEMA_VERSION`` (and the
  schema's ``schema_version`` const), update tests/data/schema_fields_v1.txt
  (``python -m profclass.contract_cli --fields tests/data/schema_fields_v1.txt``, which refuses added
  fields without a newer version and removed ones without a new major) and docs/json.md;
- remove or rename a field, or change what one means -> bump the MAJOR, and start a new
  ``schema_fields_v<major>.txt``.

This module is imported by the command line before anything heavy: it must not import
pandas, numpy or the analysis.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import resources

from .errors import ProfileError

SCHEMA_VERSION = "2.35.0"
SCHEMA_KINDS = ("diagnose", "diff")
HASH_CHUNK = 1 << 20  # sha256 of the inputs is streamed in 1 MiB chunks


def profclass_version() -> str:
    """``profclass.__version__``, which is also the package's version (pyproject reads it):
    importing importlib.metadata to ask the installed metadata cost ~40 ms of every run."""
    from .version import __version__
    return __version__


def major(version: str) -> int:
    """The major of a ``MAJOR.MINOR.PATCH`` string; ValueError when it is not one."""
    parts = str(version).split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a MAJOR.MINOR.PATCH version: {version!r}")
    return int(parts[0])


def stamp(payload: dict) -> dict:
    """``payload`` with ``schema_version`` and ``profclass_version`` first."""
    return {"schema_version": SCHEMA_VERSION, "profclass_version": profclass_version(), **payload}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def input_hashes(paths) -> dict[str, str | None]:
    """sha256 of every input file (the files inside a directory, walked in order); ``None``
    for a path that cannot be read (the hook reports, it does not fail over a hash)."""
    out: dict[str, str | None] = {}
    for p in paths:
        p = os.fsdecode(p)
        if os.path.isdir(p):
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs)
        else:
            files = [p]
        for f in files:
            try:
                out[f] = file_sha256(f)
            except OSError:
                out[f] = None
    return out


# ---------------------------------------------------------------------------------------------
# reading saved JSON back

def check_readable(doc: dict, path: str) -> str | None:
    """Refuse a saved diagnosis this version cannot read (ProfileError naming the file):
    a ``schema_version`` of another major, or one that is not a version. Returns the version,
    or ``None`` for a diagnosis written before the contract (same shape as 1.0.0 without the
    version fields; the caller checks that the shape is a diagnosis)."""
    if "schema_version" not in doc:
        return None
    v = doc["schema_version"]
    try:
        m = major(v)
    except ValueError:
        raise ProfileError(path, f"schema_version {v!r} is not a MAJOR.MINOR.PATCH version") from None
    if m != major(SCHEMA_VERSION):
        raise ProfileError(path, f"written with output schema {v} (profclass {doc.get('profclass_version', '?')}); "
                                 f"this profclass reads schema {major(SCHEMA_VERSION)}.x: diff the profiles, or "
                                 f"re-run 'profclass diagnose --format json' with this version")
    return v


def saved_side_notes(base, candidate) -> list[str]:
    """What a diff cannot do for a side read from saved JSON instead of a profile (diff's notes).

    Everything diff compares is in the saved diagnosis (step times per iteration, walls,
    features, collectives, config, and the full per-kernel table ``kernels``), so the numbers are
    those of a diff of the profiles; what is lost is re-analysis: the iteration window and the
    analysis are those of the profclass that wrote the JSON."""
    notes = []
    for name, d in (("base", base), ("candidate", candidate)):
        saved = getattr(d, "saved_from", None)
        if not saved:
            continue
        path, version, writer = saved
        made = f"schema {version}, profclass {writer}" if version else "written before schema_version existed"
        notes.append(f"{name}: read from saved diagnosis {path} ({made}): its iteration window and analysis are "
                     "those it was written with (--iteration-range does not apply to it)")
        if writer and writer != profclass_version():
            notes.append(f"{name}: analysed by profclass {writer}, not {profclass_version()}: part of the change "
                         "can be the analyser's, not the run's")
    return notes


# ---------------------------------------------------------------------------------------------
# the schemas

def schema_text(kind: str) -> str:
    """The shipped JSON Schema of ``kind`` (diagnose | diff), as text."""
    if kind not in SCHEMA_KINDS:
        raise ValueError(f"no schema {kind!r}; choose from {', '.join(SCHEMA_KINDS)}")
    return resources.files("profclass").joinpath("data", "schema", f"{kind}.schema.json").read_text("utf-8")


def load_schema(kind: str) -> dict:
    return json.loads(schema_text(kind))


def _resolve(schema: dict, root: dict) -> dict:
    ref = schema.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return _resolve(root["$defs"][ref[len("#/$defs/"):]], root)
    return schema


def _branches(schema: dict, root: dict) -> list[dict]:
    schema = _resolve(schema, root)
    subs = schema.get("anyOf") or schema.get("oneOf")
    if subs:
        return [b for s in subs for b in _branches(s, root)]
    return [schema]


def field_paths(schema: dict, root: dict | None = None, prefix: str = "") -> set[str]:
    """Every named property of the schema as a path (``devices[].features.gemm_ns``; ``*`` is
    a map's free key). A removed or renamed field removes its path."""
    root = root or schema
    out: set[str] = set()
    for s in _branches(schema, root):
        for name, sub in (s.get("properties") or {}).items():
            p = f"{prefix}.{name}" if prefix else name
            out.add(p)
            out |= field_paths(sub, root, p)
        if isinstance(s.get("additionalProperties"), dict):
            out |= field_paths(s["additionalProperties"], root, f"{prefix}.*" if prefix else "*")
        if isinstance(s.get("items"), dict):
            out |= field_paths(s["items"], root, f"{prefix}[]")
    return out


def fields_text() -> str:
    """tests/data/schema_fields_v<major>.txt: the released field paths of every schema."""
    lines = [f"# schema {SCHEMA_VERSION}: field paths of the shipped schemas (python -m profclass.contract_cli --fields FILE)"]
    for kind in SCHEMA_KINDS:
        lines += [f"{kind}:{p}" for p in sorted(field_paths(load_schema(kind)))]
    return "\n".join(lines) + "\n"


def _version_tuple(v: str) -> tuple[int, ...]:
    major(v)
    return tuple(int(x) for x in v.split("."))


def update_fields(path: str) -> str:
    """Rewrite the released field list at ``path`` for the current schemas; refuses (ValueError)
    to record added fields without a newer version, or removed ones without a new major."""
    new = fields_text()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        old_version = lines[0].split()[2].rstrip(":")
        old = {ln for ln in lines[1:] if ln and not ln.startswith("#")}
        cur = set(new.splitlines()[1:])
        if old - cur and major(old_version) == major(SCHEMA_VERSION):
            raise ValueError(f"fields removed or renamed since schema {old_version} need a new major version "
                             f"(and a new schema_fields_v<major>.txt): {sorted(old - cur)[:5]}")
        if cur - old and _version_tuple(SCHEMA_VERSION) <= _version_tuple(old_version):
            raise ValueError(f"fields added since schema {old_version}: bump the minor of SCHEMA_VERSION "
                             f"first: {sorted(cur - old)[:5]}")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)
    return path
