"""``nsys recipe profclass``: profclass inside Nsight Systems' recipe framework.

``nsys recipe NAME`` loads a recipe from ``$NSYS_RECIPE_PATH/NAME/metadata.json`` and imports
``NAME.<module_name>`` with that folder appended to ``sys.path``. The recipe is named
``profclass``, so that import is ``profclass.recipe.job``: the installed profclass package's own
module when the recipe's Python has profclass (it comes first on ``sys.path``), else the
stand-in under ``nsys/profclass/recipe/`` that says how to install it. Importing this package
imports nothing of nsys; ``profclass.recipe.job`` needs the framework (it runs inside it).
"""
from __future__ import annotations

import os

RECIPE_NAME = "profclass"


def recipe_path() -> str:
    """The folder to put in ``NSYS_RECIPE_PATH``: it holds ``profclass/metadata.json``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsys")


def recipe_dir() -> str:
    """The recipe's own folder (its metadata.json)."""
    return os.path.join(recipe_path(), RECIPE_NAME)
