"""Side-by-side benchmark: profclass diagnose vs nsys stats vs nsys-ai on the same big exports.

    python bench/bench.py [--sizes 100M,1G] [--curve 100M,1G,4G] [--timeout 900]

Builds the scaled exports (bench/scale_fixture.py) when missing, then runs, each as its own
process on the same file, measuring wall time and peak RSS (of the whole process tree,
sampled with psutil every 50 ms; /usr/bin/time -v gives the same for a single process):

- ``profclass diagnose FILE --format json``
- ``nsys stats -r cuda_gpu_kern_sum FILE`` (NVIDIA's own summary; one report only)
- ``nsys-ai diagnose FILE --format json`` (its offline skill pack; no AI backend needed)

nsys-ai adds indexes to the SQLite file it is given (it writes into its input), so it runs
on a private copy of the export, made before its clock starts, and removed after.
Then the profclass curve over --curve sizes, and the loader's rows/s (bench/loaders.py).
Prints a Markdown table; --out writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")
BIN = os.path.dirname(sys.executable)
NSYS_CANDIDATES = [os.environ.get("NSYS", ""), shutil.which("nsys") or "",
                   "/opt/nsys/usr/lib/nsight-systems/bin/nsys"]


def measure(cmd: list[str], timeout: float, env=None, cwd=None) -> dict:
    """Wall time and peak RSS (sum over the process tree) of one command."""
    # output goes to files, not pipes: a chatty tool would block on a full pipe while we poll
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env, cwd=cwd)
    ps = psutil.Process(proc.pid)
    peak = 0
    timed_out = False
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        if time.perf_counter() - t0 > timeout:
            timed_out = True
            for c in ps.children(recursive=True):
                c.kill()
            proc.kill()
            break
        time.sleep(0.05)
    proc.wait()
    wall = time.perf_counter() - t0
    out_f.seek(0)
    err_f.seek(0)
    out, err = out_f.read(), err_f.read()
    return dict(wall_s=round(wall, 2), peak_rss_mib=round(peak / 2**20), rc=proc.returncode,
                timed_out=timed_out, stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"))


def nsys_binary() -> str | None:
    return next((p for p in NSYS_CANDIDATES if p and os.path.exists(p)), None)


def run_tools(path: str, timeout: float) -> list[dict]:
    rows = []
    r = measure([os.path.join(BIN, "profclass"), "diagnose", path, "--format", "json", "-q"], timeout)
    verdict = json.loads(r["stdout"])["verdict"]["wall"] if r["rc"] == 0 else f"rc {r['rc']}"
    rows.append(dict(tool="profclass diagnose", note=f"verdict: {verdict}", **_keep(r)))
    nsys = nsys_binary()
    if nsys:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure([nsys, "stats", "-r", "cuda_gpu_kern_sum", "-f", "csv", "-o",
                         os.path.join(tmp, "k"), path], timeout)
        rows.append(dict(tool="nsys stats -r cuda_gpu_kern_sum", note="one summary table", **_keep(r)))
    else:
        rows.append(dict(tool="nsys stats -r cuda_gpu_kern_sum", note="nsys not found", wall_s=None,
                         peak_rss_mib=None, rc=None, timed_out=False))
    nsys_ai = os.path.join(BIN, "nsys-ai")
    if os.path.exists(nsys_ai):
        with tempfile.TemporaryDirectory(dir=OUT) as tmp:
            copy = os.path.join(tmp, os.path.basename(path))
            shutil.copyfile(path, copy)  # it writes indexes into its input
            env = dict(os.environ, HOME=tmp)  # its caches go into the scratch directory too
            r = measure([nsys_ai, "diagnose", copy, "--format", "json", "-o", os.path.join(tmp, "f.json")],
                        timeout, env=env, cwd=tmp)  # it keeps session state in its working directory
            grown = os.path.getsize(copy) - os.path.getsize(path)
        note = f"offline skill pack; grew its input by {grown / 2**20:.0f} MiB (indexes)"
        if r["timed_out"]:
            note = f"did not finish in {timeout:.0f} s"
        rows.append(dict(tool="nsys-ai diagnose", note=note, **_keep(r)))
    else:
        rows.append(dict(tool="nsys-ai diagnose", note="not installed (pip install 'profclass[bench]')",
                         wall_s=None, peak_rss_mib=None, rc=None, timed_out=False))
    return rows


def _keep(r: dict) -> dict:
    out = {k: r[k] for k in ("wall_s", "peak_rss_mib", "rc", "timed_out")}
    if r["rc"] not in (0, None) and not r["timed_out"]:
        out["error"] = (r["stderr"].strip().splitlines() or [""])[-1][:160]
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total / 2**30
    load = os.getloadavg()[0]
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; load average at start {load:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100M,1G", help="files for the side-by-side table")
    ap.add_argument("--curve", default="100M,1G,4G", help="files for profclass's size curve")
    ap.add_argument("--timeout", type=float, default=900, help="per command, seconds")
    ap.add_argument("--no-loaders", action="store_true")
    ap.add_argument("--out", default=None, help="also write the Markdown here")
    args = ap.parse_args(argv)
    sizes = args.sizes.split(",") if args.sizes else []
    curve = args.curve.split(",") if args.curve else []
    need = sorted(set(sizes) | set(curve), key=lambda s: (s[-1], float(s[:-1])))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scale_fixture.py"), "--sizes", ",".join(need)],
                   check=True)
    files = {s: os.path.join(OUT, f"dpoverlap_4gpu_{s}.sqlite") for s in need}
    lines = [f"Machine: {machine()}", ""]
    lines += ["| file | tool | wall s | peak RSS MiB | vs profclass (wall) | note |",
              "|---|---|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    results = {}
    for s in sizes:
        mib = os.path.getsize(files[s]) / 2**20
        rows = run_tools(files[s], args.timeout)
        results[s] = rows
        base = rows[0]["wall_s"]
        for r in rows:
            ratio = f"{r['wall_s'] / base:.1f}x" if r.get("wall_s") and base and not r["timed_out"] else "-"
            note = r["note"] + (f"; error: {r['error']}" if r.get("error") else "")
            line = (f"| {s} ({mib:.0f} MiB) | {r['tool']} | {r['wall_s'] if r['wall_s'] is not None else '-'} | "
                    f"{r['peak_rss_mib'] if r['peak_rss_mib'] is not None else '-'} | {ratio} | {note} |")
            lines.append(line)
            print(line, flush=True)
    lines += ["", "profclass diagnose against file size:", "",
              "| file | MiB | wall s | peak RSS MiB | s per GiB |", "|---|---:|---:|---:|---:|"]
    print("\n".join(lines[-5:]), flush=True)
    for s in curve:
        mib = os.path.getsize(files[s]) / 2**20
        r = measure([os.path.join(BIN, "profclass"), "diagnose", files[s], "--format", "json", "-q"], args.timeout)
        line = f"| {s} | {mib:.0f} | {r['wall_s']} | {r['peak_rss_mib']} | {r['wall_s'] / (mib / 1024):.1f} |"
        lines.append(line)
        print(line, flush=True)
    if not args.no_loaders and "1G" in files:
        lines += ["", "Loader transports, kernels + all CUDA API calls of the 1G file (bench/loaders.py):", "",
                  "| transport | rows | wall s | rows/s | peak RSS MiB | read-only |", "|---|---:|---:|---:|---:|---|"]
        print("\n".join(lines[-5:]), flush=True)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "loaders.py"), files["1G"]],
                           capture_output=True, text=True)
        for raw in p.stdout.splitlines():
            r = json.loads(raw)
            line = (f"| {r['candidate']} | {r.get('rows', '-')} | {r.get('wall_s', '-')} | {r.get('rows_per_s', '-')} | "
                    f"{r.get('peak_rss_mib', '-')} | {r.get('read_only', r.get('error', ''))} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
