"""Make an N-rank job of per-rank exports from a real per-rank set (for many-rank runs).

    python bench/rank_copies.py fixtures/profiles/imbalance_4gpu_perrank 64 bench/out/ranks64

Rank k is a copy of source rank ``k mod len(sources)`` whose captured environment says
``RANK=k`` and ``WORLD_SIZE=N`` (what profclass reads to place a file in the job). Everything
else (kernels, timestamps, session start, command line) is the real capture's, so the job
is a real 4-rank job repeated: collectives still match across ranks.
"""
from __future__ import annotations

import glob
import os
import sqlite3
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_fixture import decompress  # noqa: E402


def make_rank_copies(source_dir: str, n: int, out_dir: str) -> list[str]:
    sources = sorted(glob.glob(os.path.join(source_dir, "rank*.sqlite*")),
                     key=lambda p: int("".join(ch for ch in os.path.basename(p).split(".")[0] if ch.isdigit())))
    if not sources:
        raise SystemExit(f"rank_copies: no rank*.sqlite[.zst|.xz] in {source_dir}")
    os.makedirs(out_dir, exist_ok=True)
    out = []
    for k in range(n):
        dst = os.path.join(out_dir, f"rank{k}.sqlite")
        out.append(dst)
        if os.path.exists(dst):
            continue
        decompress(sources[k % len(sources)], dst + ".part")
        con = sqlite3.connect(dst + ".part")
        for var, value in (("RANK", k), ("WORLD_SIZE", n)):
            con.execute("UPDATE META_DATA_CAPTURE SET value = ? WHERE name LIKE 'PROCESS_%:ENVIRONMENT_VARIABLE' "
                        "AND value LIKE ?", (f'{var}="{value}"', f"{var}=%"))
        con.commit()
        con.close()
        os.replace(dst + ".part", dst)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    files = make_rank_copies(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print(f"{len(files)} rank files in {sys.argv[3]}")
