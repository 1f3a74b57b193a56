"""Run the mapper of one of NVIDIA's recipes on one export; write its table as Parquet.

    python recipe_mapper.py RECIPE REPORT.nsys-rep OUT.parquet [RECIPE ARGS]

Run by the recipe venv's Python (tests/test_nvidia_crosscheck.py). The mapper is called as the
recipe's own ``mapper_func`` calls it, with arguments parsed by the recipe's own parser, on the
export beside REPORT (``REPORT.sqlite``: the framework reads an export newer than its report
instead of exporting again). The one change: table reads ask for that SQLite export instead of
the framework's default Parquet folder (the same nsys export of the same report, in the form the
fixtures are committed in). For ``nccl_gpu_overlap_trace`` it adds ``is_nccl``: the kernels the
recipe took for NCCL (launched inside NCCL's NVTX ranges), recorded from its overlap calls.
"""
import sys

NSYS_PACKAGES = "/opt/nsys/usr/lib/x86_64-linux-gnu/nsight-systems/target-linux-x64/python/packages"
sys.path.insert(0, NSYS_PACKAGES)

import nsys_recipe  # noqa: E402,F401 (sets up the framework's paths and SQLite extension)
from nsys_recipe import data_service, recipe_loader  # noqa: E402
from nsys_recipe.lib import overlap  # noqa: E402

_read_tables = data_service.DataService.read_tables


def _read_sqlite(self, table_column_dict, hints=None):
    return _read_tables(self, table_column_dict, {"format": "sqlite", **(hints or {})})


data_service.DataService.read_tables = _read_sqlite
nccl_rows = []
_overlap_sum = overlap.calculate_overlap_sum


def _recording(df1, df2=None, divisor=1):
    # per GPU the recipe calls (NCCL, None), (NCCL, compute), (compute, NCCL), (compute, None)
    if df2 is None:
        nccl_rows.append(df1[["start", "end", "pid", "deviceId"]].copy() if len(nccl_rows) % 2 == 0 else None)
    return _overlap_sum(df1, df2, divisor)


overlap.calculate_overlap_sum = _recording

if __name__ == "__main__":
    import pandas as pd
    name, report, out, *extra = sys.argv[1:]
    cls = recipe_loader.get_recipe_class_from_name(name)
    parsed = cls.get_argument_parser().parse_args(["--input", report, *extra])
    _, df = cls._mapper_func(report, parsed)
    if name == "nccl_gpu_overlap_trace":
        nccl = pd.concat([r for r in nccl_rows if r is not None]).rename(
            columns={"start": "Start", "end": "End", "pid": "PID", "deviceId": "DeviceID"})
        df = df.merge(nccl.assign(is_nccl=True), on=["Start", "End", "PID", "DeviceID"], how="left")
        df["is_nccl"] = df["is_nccl"].fillna(False).astype(bool)
    df.to_parquet(out)
