"""Errors profclass reports to users as one line (exit code 2), never as a traceback."""
from __future__ import annotations


class ProfileError(Exception):
    """Bad input: names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # travels back from worker processes (--jobs, Dask) intact
        return (type(self), (self.path, self.problem))
