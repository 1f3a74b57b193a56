#!/usr/bin/env python3
"""What the replay adds to a diagnosis: the diagnosis's wall time, the time in the replay's
per-file trace building and in its job-level stage (graph, scenarios, plan), and peak RSS.

    python bench/replay_cost.py bench/out/dpoverlap_4gpu_1G.sqlite [--rounds 3]
    python bench/replay_cost.py fixtures/profiles/dpnooverlap_4gpu.sqlite.xz --without dp_overlap_grad_reduce

The replay's share is (trace building + job stage) over the whole diagnosis, measured in the
same run (issue 30: at most 25% on the 1 GB bench export). Trace building runs inside the
per-file stage, in up to two threads: its time is summed over threads (an upper bound on the
wall time it adds). ``--without FIX``: that fix's transform left out of the table (it keeps its
share model), for what one transform adds.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--without", help="a fix id whose transform is left out")
    args = ap.parse_args(argv)
    import profclass
    from profclass import fixes, ranks
    from profclass.replay import run as replay_run

    if args.without:
        table = fixes.load_table
        fixes.load_table = lambda: [{k: v for k, v in f.items() if not (k == "transform" and f["id"] == args.without)}
                                    for f in table()]

    spent = {"trace": 0.0, "job": 0.0}
    lock = threading.Lock()

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent[key] += time.perf_counter() - t0
        return wrapper

    ranks.replay_trace = timed("trace", ranks.replay_trace)
    replay_run.replay_job = timed("job", replay_run.replay_job)
    import profclass.pipeline as pipeline
    pipeline.replay_run = replay_run
    rows = []
    for _ in range(args.rounds):
        spent.update(trace=0.0, job=0.0)
        t0 = time.perf_counter()
        d = profclass.diagnose(args.path)
        total = time.perf_counter() - t0
        rows.append((total, spent["trace"], spent["job"]))
        print(f"diagnose {total:.2f} s; replay trace building {spent['trace']:.2f} s, job stage {spent['job']:.2f} s "
              f"({100 * (spent['trace'] + spent['job']) / total:.1f}% of the run); graph nodes "
              f"{d.replay.get('graph', {}).get('nodes')}, iterations replayed {d.replay.get('graph', {}).get('iterations')}",
              flush=True)
    share = statistics.median((t + j) / tot for tot, t, j in rows)
    print(f"median replay share {100 * share:.1f}%; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
