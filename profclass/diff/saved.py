"""The two sides of a diff as ``Diagnosis`` objects: profiles are diagnosed, and a stored
diagnosis (the JSON of ``profclass diagnose --format json`` or of ``profclass hook``) is read
back."""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, fields

from ..contract import check_readable
from ..errors import ProfileError
from ..pipeline import Diagnosis, NotInJson, ReplayReport
from ..pipeline import diagnose as _diagnose


def load_saved(path: str) -> Diagnosis:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ProfileError(path, f"cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(path, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(doc, dict) and isinstance(doc.get("diagnosis"), dict):
        doc = doc["diagnosis"]  # a `profclass hook` record
    version = check_readable(doc, path) if isinstance(doc, dict) else None  # same major, or refused
    names = {f.name for f in fields(Diagnosis)}
    required = {f.name for f in fields(Diagnosis) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(doc, dict) or not required <= doc.keys():
        raise ProfileError(path, "not a profclass diagnosis (expected the JSON of 'profclass diagnose "
                                 "--format json' or of 'profclass hook')")
    if not doc.get("kernels"):
        raise ProfileError(path, "stored diagnosis has no per-kernel table (written by an older profclass); "
                                 "diff the profile itself")
    # saved_from: for the notes (profclass.contract)
    return Diagnosis(**{k: v for k, v in doc.items() if k in names and k not in ("extra", "replayed")},
                     replayed=ReplayReport(doc.get("replay") or {}, doc.get("plan") or []),
                     extra=NotInJson(saved_from=(path, version, doc.get("profclass_version"))))


def as_diagnosis(side, iteration_regex: str | None) -> Diagnosis:
    if isinstance(side, Diagnosis):
        return side
    paths = [side] if isinstance(side, (str, bytes)) or hasattr(side, "__fspath__") else list(side)
    paths = [os.fsdecode(p) for p in paths]
    if not paths:
        raise ProfileError("(none)", "no profile given")
    if len(paths) == 1 and paths[0].endswith(".json"):
        return load_saved(paths[0])
    return _diagnose(paths, iteration_regex=iteration_regex, keep_replay=True)  # the split replays it
