"""profclass: which wall holds a distributed training step back, from Nsight Systems profiles.

    import profclass
    d = profclass.diagnose("run.sqlite")        # or a list of rank files, or a directory
    d.verdict["wall"], d.walls, d.fixes
"""
from .errors import ProfileError
from .pipeline import Diagnosis, diagnose

__all__ = ["Diagnosis", "ProfileError", "diagnose"]
__version__ = "0.1.0"
