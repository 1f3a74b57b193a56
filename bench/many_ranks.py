"""A job of N per-rank files on a local Dask cluster and through ``nsys recipe profclass
--mode dask-futures``: wall time, the client's peak RSS, the cost per rank, and how the
cross-rank analysis (the reducer) grows with the ranks.

    python bench/many_ranks.py --ranks 1024 --steps 128,256,512,1024 --workers 2

The job: bench/rank_copies.py of the real 4-rank ``imbalance_4gpu_perrank`` capture (2.7 MB per
rank as SQLite). Three measurements, one after the other:

1. map + reduce in this process as ``profclass diagnose DIR --scheduler local -j W`` runs them
   (``workers.summarise_files`` on a Dask LocalCluster of W one-thread worker processes, then
   ``pipeline.diagnose_summaries``); peak RSS is this process's (the client, with the Dask
   scheduler in it), from getrusage;
2. the reducer alone on the first n of those summaries for each n in --steps (a job of n ranks:
   each copy's captured WORLD_SIZE set to n, as rank_copies would have written it; the per-file
   summaries do not read it), best of --repeat runs;
3. ``nsys recipe profclass --mode dask-futures`` on the same folder with the recipe venv
   (NSYS_DASK_N_WORKERS=W), the client's peak RSS polled (psutil, every 0.1 s), and its JSON
   compared with 1's.
Writes the figures as JSON (--out) and prints them.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from rank_copies import make_rank_copies  # noqa: E402

SOURCE = os.path.join(ROOT, "fixtures", "profiles", "imbalance_4gpu_perrank")
NSYS = os.environ.get("NSYS", "/opt/nsys/usr/lib/nsight-systems/bin/nsys")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def map_reduce(folder: str, workers: int) -> dict:
    from profclass.inputs import listed
    from profclass.pipeline import diagnose_summaries
    from profclass.workers import summarise_files
    t0 = time.perf_counter()
    files = listed([folder])
    summaries = summarise_files(files, scheduler="local", jobs=workers)
    t1 = time.perf_counter()
    blob = [pickle.dumps(s) for s in summaries]  # for the reducer runs (it shifts clocks in place)
    t2 = time.perf_counter()
    d = diagnose_summaries(summaries, files, [folder])
    t3 = time.perf_counter()
    return dict(ranks=len(files), map_s=t1 - t0, reduce_s=t3 - t2, wall_s=(t1 - t0) + (t3 - t2),
                client_peak_rss_mib=_rss_mib(), summary_bytes=sum(map(len, blob)),
                verdict=d.verdict["wall"], json=d.to_json()), files, blob


def reducer_steps(files, blob, steps: list[int], repeat: int) -> list[dict]:
    from profclass.pipeline import diagnose_summaries
    out = []
    for n in steps:
        best = None
        for _ in range(repeat):
            summaries = [pickle.loads(b) for b in blob[:n]]
            for s in summaries:
                s.meta.env["WORLD_SIZE"] = str(n)
            t, c = time.perf_counter(), time.process_time()
            d = diagnose_summaries(summaries, files[:n], [f.given for f in files[:n]])
            # CPU time too: on a shared machine the wall time follows the other work's load
            dt, dc = time.perf_counter() - t, time.process_time() - c
            best = (dt, dc) if best is None else (min(best[0], dt), min(best[1], dc))
        out.append(dict(ranks=n, reduce_s=best[0], reduce_cpu_s=best[1], ms_per_rank=1e3 * best[0] / n,
                        cpu_ms_per_rank=1e3 * best[1] / n, verdict=d.verdict["wall"], gpus=len(d.devices)))
        print(f"  reducer, {n} ranks: {best[0]:.2f} s wall, {best[1]:.2f} s CPU ({1e3 * best[1] / n:.2f} CPU ms/rank)",
              flush=True)
    return out


def recipe(folder: str, out_dir: str, workers: int, recipe_bin: str) -> dict:
    import psutil
    from profclass.recipe import recipe_path
    env = {**os.environ, "PATH": f"{recipe_bin}{os.pathsep}{os.environ['PATH']}",
           "NSYS_RECIPE_PATH": recipe_path(), "NSYS_DASK_N_WORKERS": str(workers),
           "NSYS_DASK_THREADS_PER_WORKER": "1"}
    cmd = [NSYS, "recipe", "profclass", "--input", folder, "--output", out_dir, "--force-overwrite",
           "--mode", "dask-futures"]
    peak = [0]
    t = time.perf_counter()
    proc = psutil.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                for c in proc.children(recursive=True):
                    if any("nsys_recipe" in a for a in c.cmdline()):
                        peak[0] = max(peak[0], c.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.1)
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"nsys recipe failed ({proc.returncode}): {stderr[-2000:]}")
    with open(os.path.join(out_dir, "profclass.json")) as fh:
        text = fh.read()
    return dict(wall_s=wall, client_peak_rss_mib=peak[0] / 2**20, json=text, log=stdout.strip().splitlines()[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", default="128,256,512,1024")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(HERE, "out", "ranks{n}"))
    ap.add_argument("--recipe-bin", default=os.path.join(ROOT, ".venv-recipe", "bin"))
    ap.add_argument("--skip-recipe", action="store_true")
    ap.add_argument("--reducer-only", action="store_true",
                    help="the reducer steps alone, on the summaries the last full run kept (bench/out)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "many_ranks.json"))
    a = ap.parse_args()
    folder = a.dir.format(n=a.ranks)
    t = time.perf_counter()
    make_rank_copies(SOURCE, a.ranks, folder)
    print(f"{a.ranks} rank files in {folder} ({time.perf_counter() - t:.1f} s to make)", flush=True)
    res = dict(machine=f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start", ranks=a.ranks,
               workers=a.workers, source=os.path.relpath(SOURCE, ROOT))
    kept = os.path.join(HERE, "out", f"summaries{a.ranks}.pkl")
    if a.reducer_only:
        from profclass.inputs import listed
        with open(kept, "rb") as fh:
            blob = pickle.load(fh)
        res["reducer"] = reducer_steps(listed([folder]), blob, [int(x) for x in a.steps.split(",")], a.repeat)
        res["load_at_end"] = os.getloadavg()[0]
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        print(json.dumps(res, indent=1))
        return
    mr, files, blob = map_reduce(folder, a.workers)
    with open(kept, "wb") as fh:
        pickle.dump(blob, fh)
    print(f"  Dask LocalCluster ({a.workers} workers): map {mr['map_s']:.1f} s, reduce {mr['reduce_s']:.1f} s, "
          f"client peak {mr['client_peak_rss_mib']:.0f} MiB, summaries {mr['summary_bytes'] / 2**20:.0f} MiB "
          f"pickled; verdict {mr['verdict']}", flush=True)
    res["dask_local"] = {k: v for k, v in mr.items() if k != "json"}
    with open(os.path.join(HERE, "out", f"dask_local{a.ranks}.json"), "w") as fh:
        fh.write(mr["json"] + "\n")
    res["reducer"] = reducer_steps(files, blob, [int(x) for x in a.steps.split(",")], a.repeat)
    if not a.skip_recipe:
        rc = recipe(folder, os.path.join(HERE, "out", f"recipe{a.ranks}"), a.workers, a.recipe_bin)
        same = rc.pop("json") == mr["json"] + "\n"  # the recipe writes the JSON as diagnose -o does
        print(f"  nsys recipe --mode dask-futures: {rc['wall_s']:.1f} s, client peak "
              f"{rc['client_peak_rss_mib']:.0f} MiB; JSON {'identical' if same else 'DIFFERENT'}", flush=True)
        res["recipe_dask_futures"] = {**rc, "json_identical_to_dask_local": same}
    res["load_at_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
