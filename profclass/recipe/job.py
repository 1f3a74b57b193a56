"""The ``profclass`` recipe for Nsight Systems' recipe framework (``nsys recipe profclass``).

Written against the framework's recipe interface (``nsys_recipe.lib.recipe.Recipe``: an
argument parser, ``run(context)``, output files and the ``.nsys-analysis`` record), not
against any of NVIDIA's recipes. The mapper is profclass's per-report summary
(``ranks.summarise_file``, one task per report on the framework's context: in this process,
a process pool, or Dask workers), the reducer the job analysis (``pipeline.diagnose_summaries``),
so the JSON is ``profclass diagnose``'s for the same inputs in every mode.

Inputs are what ``profclass diagnose`` takes: .nsys-rep reports, SQLite exports (plain, .zst,
.xz), or directories of them. A worker exports (.nsys-rep) or decompresses its own report;
nothing is written beside the inputs.
"""
from __future__ import annotations

import sys
from datetime import datetime

try:
    from nsys_recipe.lib import recipe as _framework
except ImportError as exc:  # imported outside `nsys recipe`
    raise ImportError(f"profclass.recipe.job runs inside Nsight Systems' recipe framework "
                      f"(nsys recipe profclass; set NSYS_RECIPE_PATH=$(profclass recipe-path)): {exc}") from None

from . import RECIPE_NAME, recipe_dir
from ..errors import ProfileError

try:  # everything the mapper and the reducer import, now: a missing package is one clear line
    from ..html import render_html
    from ..inputs import listed
    from ..pipeline import diagnose_summaries
    from ..ranks import summarise_file
    from ..report import one_line, render_markdown
except ImportError as exc:
    raise ImportError(f"profclass cannot run in the Python that nsys recipe runs ({sys.executable}): {exc}; "
                      f"install profclass there with its recipe extra: pip install 'profclass[recipe]'") from None

OUTPUTS = {"profclass.json": "JSON", "profclass.md": "Markdown", "profclass.html": "HTML"}


class ProfclassRecipe(_framework.Recipe):
    """profclass's diagnosis of one job, as an nsys recipe."""

    # the metadata sits in the recipe folder, not beside this module (see profclass.recipe)
    recipe_dir = recipe_dir()
    recipe_name = RECIPE_NAME

    @classmethod
    def get_argument_parser(cls):
        from nsys_recipe.lib.args import Option
        parser = super().get_argument_parser()
        # profclass's own --input: the framework's takes .nsys-rep alone, profclass reads exports too
        parser.add_recipe_argument(
            "--input", nargs="+", required=True, metavar="PATH",
            help="Reports of one job: one holding every rank, one per rank, or directories of them "
                 "(.nsys-rep, .sqlite, .sqlite.zst, .sqlite.xz).")
        parser.add_recipe_argument(Option.OUTPUT)
        parser.add_recipe_argument(Option.FORCE_OVERWRITE)
        parser.add_recipe_argument(
            "--iteration-range", default=None, metavar="REGEX",
            help="Regex for NVTX ranges that mark one iteration (default: iteration/step/ProfilerStep#N).")
        return parser

    def run(self, context):
        super().run(context)
        paths = list(self.get_parsed_arg("input"))
        regex = self.get_parsed_arg("iteration_range")
        try:
            files = listed(paths)
            summaries = context.wait(context.map(
                summarise_file, [f.given for f in files], [f.sqlite for f in files], range(len(files)),
                [regex] * len(files)))
            d = diagnose_summaries(summaries, files, paths, regex)
        except ProfileError as exc:  # bad input: one line and exit 2, as profclass diagnose
            print(f"profclass: error: {' '.join(str(exc).split())}", file=sys.stderr)
            raise SystemExit(2) from None
        self._write(d)
        self._analysis_dict.update({"InputFiles": paths, "Outputs": self._output_files,
                                    "Verdict": d.verdict["wall"], "Confidence": d.verdict["confidence"]})
        self._analysis_dict["EndTime"] = str(datetime.now())
        self.create_analysis_file()
        print(one_line(d))

    def _write(self, d) -> None:
        texts = {"profclass.json": d.to_json() + "\n", "profclass.md": render_markdown(d),
                 "profclass.html": render_html(d)}
        for name, kind in OUTPUTS.items():
            with open(self.add_output_file(name, kind), "w", encoding="utf-8") as fh:
                fh.write(texts[name])
