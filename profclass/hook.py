"""profclass as a post-job hook: diagnose the job's profile (and diff it against a baseline),
write ``<profile>.profclass.json`` and ``<profile>.profclass.md``, and print one line for the
training log.

A hook must not take a finished training job down with it: bad input, an unwritable
directory or an internal problem is reported on stderr and the exit code stays 0, unless
the caller asked for a failure (``fail_on`` walls -> 3, ``fail_above`` a significant
regression of more than PCT -> 4) or for ``strict`` handling of bad input (-> 2).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field, replace

from .errors import ProfileError
from .inputs import PROFILE_SUFFIXES

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_FAIL_ON = 3
EXIT_FAIL_ABOVE = 4
_TRAILING_RANK = re.compile(r"[._-]*(rank)?[._-]*\d*$", re.I)


@dataclass
class HookResult:
    exit_code: int
    summary: str  # the one line for the training log
    json_path: str | None = None
    md_path: str | None = None
    diagnosis: object = None  # Diagnosis
    diff: object = None  # DiffResult, when a baseline was given
    messages: list[str] = field(default_factory=list)  # notes and errors, for stderr


def _strip_suffix(name: str) -> str:
    for suf in sorted(PROFILE_SUFFIXES, key=len, reverse=True):
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def report_stem(paths: list[str]) -> tuple[str, str]:
    """(directory, stem) the reports are named after: ``run.nsys-rep`` -> (dir, ``run``);
    a directory ``prof/`` -> (its parent, ``prof``); rank files ``job_rank0.sqlite``,
    ``job_rank1.sqlite`` -> (their directory, ``job``)."""
    first = os.path.abspath(paths[0])
    if len(paths) == 1:
        if os.path.isdir(first):
            return os.path.dirname(first.rstrip(os.sep)) or os.sep, os.path.basename(first.rstrip(os.sep))
        return os.path.dirname(first), _strip_suffix(os.path.basename(first)) or "profile"
    stems = [_strip_suffix(os.path.basename(p)) for p in paths]
    common = os.path.commonprefix(stems)
    common = _TRAILING_RANK.sub("", common) or "profile"
    return os.path.dirname(first), common


def _writable(directory: str) -> bool:
    """Really try: os.access says yes to root on read-only mounts."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".profclass-probe-"):
            return True
    except OSError:
        return False


def _targets(paths: list[str], out: str | None) -> tuple[str, str, list[str]]:
    """Where to write: --out, else beside the profile, else the current directory (said so)."""
    beside, stem = report_stem(paths)
    notes = []
    if out:
        os.makedirs(out, exist_ok=True)
        directory = out
    elif _writable(beside):
        directory = beside
    else:
        directory = os.getcwd()
        notes.append(f"profclass: note: {beside} is not writable; writing the reports to {directory}")
    return os.path.join(directory, f"{stem}.profclass.json"), os.path.join(directory, f"{stem}.profclass.md"), notes


def _as_paths(given) -> list[str]:
    """One path or several, as strings (bytes and path-likes decoded)."""
    if isinstance(given, (str, bytes)) or hasattr(given, "__fspath__"):
        given = [given]
    return [os.fsdecode(p) for p in given]


def _write_reports(json_path: str, md_path: str, record: dict, md: str, messages: list[str]) -> bool:
    """Write the JSON record and the Markdown report; a directory we cannot write to is a
    message (the job's exit code stays the hook's), not a failure."""
    try:
        with open(json_path, "w") as fh:
            json.dump(record, fh, indent=2, default=_jsonable)
            fh.write("\n")
        with open(md_path, "w") as fh:
            fh.write(md)
        return True
    except OSError as exc:
        messages.append(f"profclass: error: {os.path.dirname(json_path)}: cannot write the reports "
                        f"({exc.strerror}); pass --out DIR")
        return False


def _read_train_log(path, regex: str | None, skip) -> tuple[object, str | None]:
    """(the job's training log as read, None), or (None, the error line) where it cannot be read
    or holds no iteration time: the hook then diagnoses without it."""
    if path is None:
        return None, None
    from .train_log import read
    try:
        return read(path, regex=regex, skip=skip), None
    except ProfileError as exc:
        return None, f"profclass: error: {exc}"


def _timer_logs(baseline_log, log, regex: str | None, messages: list[str]) -> dict:
    """diff's ``base_log`` and ``candidate_log`` where the baseline's training log and the job's
    are both at hand (the decision is then theirs, docs/diff.md); none otherwise, with a message
    where the baseline's log cannot be read (the diff goes on with the captured windows)."""
    if baseline_log is None or log is None:
        return {}
    base, error = _read_train_log(baseline_log, regex, ())
    if error:
        messages.append(f"{error}; the baseline diff is decided on the captured windows")
        return {}
    return dict(base_log=base, candidate_log=log)


def _diagnosed(paths: list[str], bad_input: int, **options):
    """(the Diagnosis, None), or (None, the HookResult saying why there is none)."""
    from .pipeline import diagnose
    try:
        return diagnose(paths, **options), None
    except ProfileError as exc:
        return None, HookResult(bad_input, f"profclass: error: {exc}", messages=[f"profclass: error: {exc}"])
    except Exception as exc:  # a hook must not fail the job over a profclass bug
        msg = f"profclass: internal error on {', '.join(paths)}: {type(exc).__name__}: {exc}"
        return None, HookResult(bad_input, msg, messages=[msg])


def run_hook(profiles, out: str | None = None, baseline=None, fail_on=(), fail_above: float | None = None,
             iteration_regex: str | None = None, strict: bool = False, min_effect: float | None = None,
             alpha: float | None = None, untraced_step_ms: float | None = None, train_log=None,
             train_log_regex: str | None = None, train_log_skip=(), baseline_log=None) -> HookResult:
    """Diagnose ``profiles`` (one job: a file, rank files or a directory), optionally diff it
    against ``baseline`` (profile paths or a stored diagnosis JSON), write the JSON and Markdown
    reports and return the one-line summary and the exit code the job should use.
    ``untraced_step_ms``: the job's own step without the profiler (``diagnose``'s); or ``train_log``:
    the job's training log (a path; ``train_log_regex``, ``train_log_skip``: how to read it), which,
    unreadable, is bad input the hook goes on without; with ``baseline_log``, both logs decide the diff."""
    from . import report
    from .version import __version__
    from .contract import input_hashes, stamp
    from .diff import ALPHA, MIN_EFFECT, diff, one_line as diff_line, render_markdown as diff_md

    paths, baseline = _as_paths(profiles), _as_paths(baseline) if baseline else []
    bad_input = EXIT_BAD_INPUT if strict else EXIT_OK
    log, log_error = _read_train_log(train_log, train_log_regex, train_log_skip)
    if log_error and strict:
        return HookResult(EXIT_BAD_INPUT, log_error, messages=[log_error])
    d, failed = _diagnosed(paths, bad_input, iteration_regex=iteration_regex, untraced_step_ms=untraced_step_ms,
                           train_log=log)
    if failed:
        return failed
    messages: list[str] = [f"{log_error}; diagnosed without it"] if log_error else []
    if log_error:  # in the record too
        d = replace(d, missing=[*d.missing, f"{log_error.removeprefix('profclass: error: ')}: the host is not calibrated"])
    line = report.one_line(d)
    r = None
    if baseline:
        try:
            r = diff(baseline, d, iteration_regex=iteration_regex,
                     alpha=ALPHA if alpha is None else alpha,
                     min_effect=MIN_EFFECT if min_effect is None else min_effect,
                     **_timer_logs(baseline_log, log, train_log_regex, messages))
            line += "; " + diff_line(r)
        except ProfileError as exc:
            messages.append(f"profclass: error: baseline: {exc}")
            line += "; baseline unreadable"
            if strict:
                return HookResult(EXIT_BAD_INPUT, line, diagnosis=d, messages=messages)
    code = EXIT_OK
    if fail_above is not None and r is not None and r.regression and r.judged_step["delta_pct"] > fail_above:
        code = EXIT_FAIL_ABOVE
        line += f"; FAIL: slower by more than {fail_above:g}%"
    elif d.verdict["wall"] in set(fail_on or ()):
        code = EXIT_FAIL_ON
        line += f"; FAIL: {d.verdict['wall']} wall"
    json_path, md_path, notes = _targets(paths, out)
    messages += notes
    record = stamp(dict(profclass_hook=1, version=__version__, profiles=paths, baseline=baseline or None,
                        input_sha256=input_hashes(paths + baseline),
                        summary=line, exit_code=code, diagnosis=d.to_dict(), diff=r.to_dict() if r else None))
    md = report.render_markdown(d) + ("\n" + diff_md(r) if r else "")
    written = _write_reports(json_path, md_path, record, md, messages)
    if written:
        line += f"; report {json_path}"
    else:
        json_path = md_path = None
    return HookResult(code, line, json_path, md_path, d, r, messages)


def _jsonable(o):
    from .pipeline import _jsonable as conv
    return conv(o)
