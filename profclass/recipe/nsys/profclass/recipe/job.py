"""Stand-in for ``profclass.recipe.job``, imported only when the Python that ``nsys recipe``
runs has no profclass installed (the real module lives in the installed package)."""
import sys

raise ImportError(
    f"profclass is not installed in the Python that nsys recipe runs ({sys.executable}); "
    "install it there with its recipe extra: pip install 'profclass[recipe]' "
    "(numpy<2, pandas<2.3, pyarrow<17, psutil, dask[distributed]), and put that Python first on PATH")
