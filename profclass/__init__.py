"""profclass: which wall holds a distributed training step back, from Nsight Systems profiles.

    import profclass
    d = profclass.diagnose("run.sqlite")        # or a list of rank files, or a directory
    d.verdict["wall"], d.walls, d.fixes
    r = profclass.diff("good.sqlite", "new.sqlite")  # regression triage: r.regression, r.verdict
    profclass.run_hook("run.nsys-rep")               # post-job hook: reports beside the profile
"""
from .errors import ProfileError
from .pipeline import Diagnosis, diagnose
from .diff import DiffResult, diff
from .hook import HookResult, run_hook

__all__ = ["Diagnosis", "DiffResult", "HookResult", "ProfileError", "diagnose", "diff", "run_hook"]
__version__ = "0.1.0"
