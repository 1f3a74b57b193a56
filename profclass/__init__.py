"""profclass: which wall holds a distributed training step back, from Nsight Systems profiles.

    import profclass
    d = profclass.diagnose("run.sqlite")        # or a list of rank files, or a directory
    d.verdict["wall"], d.walls, d.fixes
    r = profclass.diff("good.sqlite", "new.sqlite")  # regression triage: r.regression, r.verdict
    profclass.run_hook("run.nsys-rep")               # post-job hook: reports beside the profile
"""
from .errors import ProfileError

__all__ = ["Diagnosis", "DiffResult", "HookResult", "ProfileError", "diagnose", "diff", "run_hook"]
__version__ = "0.1.0"

# The analysis (pandas, numpy) loads on first use, so that light commands (`profclass schema`,
# profclass.contract) start fast. `profclass.diff` is the function, as it always was, even after
# the submodule profclass.diff is imported (the import system then sets the attribute: ignored).
import sys as _sys
import types as _types

_LAZY = {"Diagnosis": "pipeline", "diagnose": "pipeline", "DiffResult": "diff", "diff": "diff",
         "HookResult": "hook", "run_hook": "hook"}


class _Package(_types.ModuleType):
    def __getattr__(self, name):
        if name in _LAZY:
            import importlib
            return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name == "diff" and isinstance(value, _types.ModuleType):
            return  # the submodule; profclass.diff stays the function
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
