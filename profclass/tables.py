"""The packaged TOML tables (``profclass/data/*.toml``): data the classify, fixes and pitfalls
stages read, kept out of the code so a threshold, fix or rule is a data change."""
from __future__ import annotations

from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_table(name: str) -> dict:
    """The parsed ``data/<name>.toml``."""
    return tomllib.loads(resources.files("profclass").joinpath(f"data/{name}.toml").read_text())
