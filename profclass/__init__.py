"""profclass: which wall holds a distributed training step back, from Nsight Systems profiles.

    import profclass
    d = profclass.diagnose("run.sqlite")        # or a list of rank files, or a directory
    d.verdict["wall"], d.walls, d.fixes
    r = profclass.diff("good.sqlite", "new.sqlite")  # regression triage: r.regression, r.verdict
    profclass.run_hook("run.nsys-rep")               # post-job hook: reports beside the profile
    profclass.train_log.read_untraced_step("train.log")  # the job's step without the profiler, from its log

The public names are imported on first use (PEP 562), so ``import profclass`` and the command
line's ``--help`` and ``explain`` do not pay for pandas and the rest of the pipeline.
"""
from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING

from .errors import ProfileError
from .version import __version__

__all__ = ["Diagnosis", "DiffResult", "HookResult", "ProfileError", "diagnose", "diff", "run_hook"]

# public name -> the submodule that defines it
_LAZY = {"Diagnosis": "pipeline", "diagnose": "pipeline", "DiffResult": "diff", "diff": "diff",
         "HookResult": "hook", "run_hook": "hook"}
# public submodules, imported on first use as well
_SUBMODULES = ("train_log",)

if TYPE_CHECKING:
    from .diff import DiffResult, diff
    from .hook import HookResult, run_hook
    from .pipeline import Diagnosis, diagnose


def __getattr__(name: str):
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)  # the import binds it here: no second look-up
    if name not in _LAZY:
        raise AttributeError(f"module 'profclass' has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


class _Package(types.ModuleType):
    """``profclass.diff`` is the function, as it was when this file imported it eagerly: the
    import system binds a submodule to its package's attribute when it first loads it, so a
    first ``from profclass.diff import ...`` would otherwise leave the module there."""

    def __setattr__(self, name, value):
        if name == "diff" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.diff":
            value = value.diff
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
