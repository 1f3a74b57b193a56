"""Where the per-file work runs: in this process, in ``--jobs N`` local processes, or on a Dask
distributed cluster (``--scheduler ADDRESS`` or ``local``). Only the compact summaries of
``profclass.ranks`` travel back."""
from __future__ import annotations

from .errors import ProfileError
from .ranks import FileSummary, summarise_file


def _task(args) -> FileSummary:
    return summarise_file(*args)


def summarise_files(files, iteration_regex: str | None = None, jobs: int = 1,
                    scheduler: str | None = None, keep_timelines: bool = False,
                    progress=None) -> list[FileSummary]:
    """Summaries of every resolved input file, in input order.

    ``jobs`` > 1: that many local worker processes. ``scheduler``: a Dask distributed
    scheduler address (``tcp://host:8786``) or ``local`` (a LocalCluster on this machine with
    ``jobs`` workers). Timelines are kept only in the single-process run.
    """
    tasks = [(f.given, f.sqlite, src, iteration_regex) for src, f in enumerate(files)]
    if scheduler:
        return _on_dask(tasks, scheduler, jobs, progress)
    if jobs > 1 and len(tasks) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        # spawn, not fork: the parent may hold threads (Arrow, BLAS) that fork would copy mid-lock
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                                    mp_context=mp.get_context("spawn")) as pool:
            out = []
            for i, s in enumerate(pool.map(_task, tasks)):
                if progress:
                    progress(f"summarised {files[i].given}", (i + 1) / len(files))
                out.append(s)
            return out
    out = []
    for src, f in enumerate(files):
        if progress:
            progress(f"loading {f.given}", src / len(files))
        out.append(summarise_file(f.given, f.sqlite, src, iteration_regex, keep_timelines))
    return out


def _on_dask(tasks, scheduler: str, jobs: int, progress) -> list[FileSummary]:
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ProfileError("--scheduler", "needs Dask distributed: pip install 'profclass[dask]'") from None
    cluster = None
    if scheduler == "local":
        cluster = LocalCluster(n_workers=max(jobs, 1), threads_per_worker=1, processes=True,
                               dashboard_address=None)
        client = Client(cluster)
    else:
        try:
            client = Client(scheduler, timeout="30s")
        except (OSError, TimeoutError) as exc:
            raise ProfileError("--scheduler", f"cannot reach Dask scheduler {scheduler} ({exc})") from None
    try:
        if progress:
            progress(f"running {len(tasks)} file(s) on Dask ({scheduler})")
        futures = client.map(_task, tasks, pure=False)
        return client.gather(futures)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
