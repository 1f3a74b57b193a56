"""Refuse a set of per-rank exports that come from more than one job.

A directory of ``rank*.sqlite`` files is easy to fill with leftovers from an earlier run;
mixing them gives a diagnosis of a job that never ran (clock alignment and collective
matching across unrelated captures). Files are of one job unless one of these says otherwise
(each is something every rank of one job shares, whatever the launcher):

1. a job identifier in the captured environment differs: ``SLURM_JOB_ID``,
   ``TORCHELASTIC_RUN_ID``, ``PBS_JOBID``, ``LSB_JOBID``, ``MASTER_ADDR``/``MASTER_PORT``
   (the rendezvous) or ``WORLD_SIZE`` (compared only where both files captured it);
2. the captured command lines differ, after dropping per-rank arguments
   (``--local-rank N``, ``--local_rank=N``, ``--rank N``, ``--node-rank N``);
3. two files carry the same ``RANK`` (two captures of one rank: a rerun, or the same
   file twice);
4. the capture sessions started more than ``MAX_START_SPREAD_S`` apart: ranks of one job
   start within seconds to minutes of each other (launch, imports), separate jobs are
   usually hours apart.

Not used: the GPU set or model each file saw. Per-rank captures on different nodes, or with
``CUDA_VISIBLE_DEVICES`` per rank, legitimately see different GPUs.
"""
from __future__ import annotations

import os
import re

from .errors import ProfileError

JOB_ID_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID", "MASTER_ADDR",
               "MASTER_PORT", "WORLD_SIZE")
MAX_START_SPREAD_S = 3600
_RANK_ARG = re.compile(r"^--?(local[-_]rank|rank|node[-_]rank)(=.*)?$")


def job_command(command: list[str]) -> list[str]:
    """The command line without its per-rank arguments."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        m = _RANK_ARG.match(arg)
        if m:
            skip = m.group(2) is None  # "--rank 3": the value is the next argument
            continue
        out.append(arg)
    return out


def _around_difference(a: list[str], b: list[str]) -> tuple[str, str]:
    """The two commands, cut to a few arguments around where they first differ."""
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    lo = max(0, i - 2)

    def cut(c):
        return ("... " if lo else "") + " ".join(c[lo:i + 3]) + (" ..." if len(c) > i + 3 else "")
    return cut(a), cut(b)


def check_one_job(profiles, label: str) -> None:
    """Raise ProfileError(label, ...) when ``profiles`` (RawProfiles, one per file) mix jobs."""
    if len(profiles) < 2:
        return
    name = {id(p): os.path.basename(p.path) or p.path for p in profiles}
    for var in JOB_ID_VARS:
        seen = [(p, p.env[var]) for p in profiles if p.env.get(var)]
        for p, v in seen[1:]:
            if v != seen[0][1]:
                raise ProfileError(label, f"files of different jobs: {name[id(seen[0][0])]} has {var}="
                                          f"{seen[0][1]} but {name[id(p)]} has {var}={v}; pass the files "
                                          f"of one job")
    cmds = [(p, job_command(p.command)) for p in profiles if p.command]
    for p, c in cmds[1:]:
        if c != cmds[0][1]:
            ca, cb = _around_difference(cmds[0][1], c)
            raise ProfileError(label, f"files of different jobs: {name[id(cmds[0][0])]} ran '{ca}' but "
                                      f"{name[id(p)]} ran '{cb}'; pass the files of one job")
    ranks: dict[str, object] = {}
    for p in profiles:
        r = p.env.get("RANK")
        if r is None or not str(r).strip().isdigit():
            continue
        if r in ranks:
            raise ProfileError(label, f"{name[id(ranks[r])]} and {name[id(p)]} are both rank {r} "
                                      f"(two captures of one rank, or files of different runs)")
        ranks[r] = p
    starts = [(p.session_start_ns, p) for p in profiles if p.session_start_ns]
    if len(starts) >= 2:
        (t0, a), (t1, b) = min(starts, key=lambda x: x[0]), max(starts, key=lambda x: x[0])
        if (t1 - t0) / 1e9 > MAX_START_SPREAD_S:
            raise ProfileError(label, f"files of different jobs: {name[id(b)]} was captured "
                                      f"{(t1 - t0) / 3.6e12:.1f} h after {name[id(a)]} (ranks of one job "
                                      f"start within {MAX_START_SPREAD_S // 60} min); pass the files of one job")
