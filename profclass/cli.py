"""The ``profclass`` command line."""
from __future__ import annotations

import os
import sys

import click

from .version import __version__
from .errors import ProfileError

EXIT_BAD_INPUT = 2
EXIT_FAIL_ON = 3


def _fail(exc: Exception) -> None:
    click.echo(f"profclass: error: {exc}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _one_line(text) -> str:
    return " ".join(str(text).split())


class _Guarded(click.Group):
    """Last resort: profclass runs unattended (job hooks, CI), so whatever goes wrong ends in
    one line and exit 2, never a traceback (PROFCLASS_DEBUG=1 re-raises, for bug reports)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except ProfileError as exc:
            _fail(_one_line(exc))
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            if os.environ.get("PROFCLASS_DEBUG"):
                raise
            _fail(_one_line(f"internal error ({type(exc).__name__}: {exc}); please report it with "
                            f"the profile (PROFCLASS_DEBUG=1 shows the traceback)"))


def check_output(path: str | None) -> None:
    """Refuse an output path that cannot be written before spending time on the analysis
    (one line, exit 2, like any bad input; click's own check prints a usage block)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        _fail(ProfileError(path, "cannot write output (is a directory)"))
    if not os.path.isdir(parent):
        _fail(ProfileError(path, "cannot write output (no such directory)"))
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        _fail(ProfileError(path, "cannot write output (permission denied)"))


def _check_inputs(profiles) -> None:
    """Refuse a missing, empty or non-SQLite input before importing the pipeline (pandas and
    the rest take most of a second): the same one line and exit 2 the pipeline would give."""
    from .inputs import check
    try:
        check(list(profiles))
    except ProfileError as exc:
        _fail(exc)


def one_heap() -> None:
    """This process allocates from one glibc malloc arena (``M_ARENA_MAX`` = 1), unless the
    user set ``MALLOC_ARENA_MAX``. The loader reads in threads; with an arena per thread, what
    a reader thread frees stays reserved for it while the main thread's analysis grows its own
    heap beside it: 4 GB export, ~450 MiB more peak RSS (bench/RESULTS.md). No-op off glibc."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


def _walls(ctx, param, value):
    from .classify import WALLS
    if not value:
        return []
    walls = [w.strip() for w in value.split(",") if w.strip()]
    bad = [w for w in walls if w not in WALLS]
    if bad:
        raise click.BadParameter(f"unknown wall(s) {', '.join(bad)}; choose from {', '.join(WALLS)}")
    return walls


def _positive_ms(ctx, param, value):
    if value is not None and not (value > 0 and value != float("inf")):
        raise click.BadParameter(f"{value}: not a positive number of ms")
    return value


def _log_regex(ctx, param, value):
    if value is None:
        return None
    from .train_log import user_format
    try:
        user_format(value)
    except ProfileError as exc:
        raise click.BadParameter(exc.problem) from None
    return value


def _skip_ranges(ctx, param, value):
    if not value:
        return ()
    from .train_log import skip_range
    try:
        return tuple(skip_range(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def train_log_options(command):
    """``--train-log FILE`` and how to read it, on ``diagnose`` and ``hook``: the job's own step
    without the profiler from its training log, instead of ``--untraced-step-ms``."""
    for option in reversed((
            click.option("--train-log", "train_log", default=None, metavar="FILE",
                         help="The job's training log: its median iteration time outside warm-up and the profiled "
                              "iterations is the step without the profiler the replay calibrates its host to "
                              "(Megatron-LM's 'elapsed time per iteration', NeMo's 'train_step_timing in s', "
                              "STEP_MS lines). Instead of --untraced-step-ms. Best a run without nsys attached: "
                              "the capture run's own steps outside its profiled range ran up to 10% off the "
                              "untraced runs, either way (docs/replay.md, call MH)."),
            click.option("--train-log-regex", "train_log_regex", default=None, callback=_log_regex, metavar="REGEX",
                         help="The log's iteration time for another format: a regex with one named group ms "
                              "(or s) and optionally it (the iteration)."),
            click.option("--train-log-skip", "train_log_skip", multiple=True, callback=_skip_ranges, metavar="A..B",
                         help="Logged iterations to leave out besides warm-up and the profiled range (repeatable)."))):
        command = option(command)
    return command


def check_train_log(train_log, regex, skip, untraced_step_ms) -> None:
    """Usage errors of the training-log options (exit 2, before any work)."""
    if train_log is None and (regex or skip):
        raise click.UsageError("--train-log-regex and --train-log-skip read the log given by --train-log FILE")
    if train_log is not None and untraced_step_ms is not None:
        raise click.UsageError("give the job's step without the profiler as --untraced-step-ms or --train-log, "
                               "not both")


def _what_if(ctx, param, value):
    """``--what-if`` requests: fix ids with a replay transform, joined by "+" to apply together,
    each with an optional ``:key=value,...`` change (``host_bigger_launches:microbatch_factor=4``)."""
    from .fixes import load_table, request_parts
    known = sorted(f["id"] for f in load_table() if f.get("transform"))
    for ask in value:
        bad = [fid for fid, _ in request_parts(ask) if fid not in known]
        if bad:
            raise click.BadParameter(f"{ask}: no replay transform for {', '.join(bad)}; fixes with one: {', '.join(known)}")
    return tuple(value)


@click.group(cls=_Guarded, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="profclass")
def main():
    """Diagnose Nsight Systems profiles of (MoE) training jobs: which wall holds the step back."""


@main.command()
@click.argument("profiles", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown", "html"]), default="text",
              show_default=True, help="Output format (html: one self-contained file with the timeline).")
@click.option("--iteration-range", "iteration_regex", default=None, metavar="REGEX",
              help="Regex for NVTX ranges that mark one iteration (default: iteration/step/ProfilerStep#N).")
@click.option("--fail-on", callback=_walls, default="", metavar="WALL[,WALL]",
              help="Exit 3 when the verdict is one of these walls (for job hooks).")
@click.option("-o", "--output", "--out", "output", default=None, metavar="FILE",
              help="Write the report to this file instead of stdout.")
@click.option("--detail", is_flag=True,
              help="Text: the full tables (per rank, collectives, evidence, every fix and pitfall) "
                   "instead of the one-screen answer.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr (it shows only on a terminal).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Read and analyse the per-rank files in N processes (with --scheduler local: N Dask "
                   "workers). markdown/html keep the timelines and run in one process.")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Run the per-file work on a Dask distributed cluster (tcp://host:8786, or 'local'); "
                   "only per-rank summaries come back. Needs 'pip install profclass[dask]'; the files "
                   "must be readable at the same paths on the workers.")
@click.option("--what-if", "what_if", multiple=True, callback=_what_if, metavar="FIX[+FIX...]",
              help="Also price these fixes by the replay, whether or not profclass chose them; FIX+FIX "
                   "prices fixes applied together (the plan's arithmetic). Repeatable. Fix ids: profclass explain.")
@click.option("--untraced-step-ms", "untraced_step_ms", type=float, default=None, callback=_positive_ms, metavar="MS",
              help="The job's own step time without the profiler (its training log's iteration time, e.g. Megatron's "
                   "'elapsed time per iteration', outside the captured range): the replay calibrates the host's "
                   "speed to it before pricing the fixes and the plan.")
@train_log_options
def diagnose(profiles, fmt, iteration_regex, fail_on, output, detail, quiet, jobs, scheduler, what_if,
             untraced_step_ms, train_log, train_log_regex, train_log_skip):
    """Diagnose PROFILES: one nsys export holding every rank, one export per rank, or a
    directory of them (.sqlite, .sqlite.zst, .sqlite.xz, .nsys-rep)."""
    one_heap()
    check_train_log(train_log, train_log_regex, train_log_skip, untraced_step_ms)
    check_output(output)
    _check_inputs(profiles)
    log = _read_train_log(train_log, train_log_regex, train_log_skip)
    from .pipeline import diagnose as run
    from .progress import reporter
    with reporter(quiet) as progress:
        try:
            # markdown and html show the top kernels and the timeline: keep the timelines
            d = run(list(profiles), iteration_regex=iteration_regex, progress=progress,
                    keep_timelines=fmt in ("markdown", "html"), jobs=jobs, scheduler=scheduler,
                    price_fixes=what_if, untraced_step_ms=untraced_step_ms, train_log=log)
        except ProfileError as exc:
            progress.__exit__()
            _fail(exc)
        if fmt == "html":
            from .html import render_html
            text = render_html(d, progress=progress)
        elif fmt == "json":
            text = d.to_json() + "\n"
        elif fmt == "text" and not detail:
            from .screen import render_screen
            text = render_screen(d)
        else:  # rich tables: imported only for the formats that draw them
            from . import report
            text = report.render_markdown(d) if fmt == "markdown" else report.render_text(d)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as fh:  # the reports hold µ, … and box drawing
                fh.write(text)
        except OSError as exc:
            _fail(ProfileError(output, f"cannot write output ({exc.strerror})"))
    else:
        click.echo(text, nl=False)
    if d.verdict["wall"] in fail_on:
        sys.exit(EXIT_FAIL_ON)


def _read_train_log(path, regex, skip):
    """The training log given by --train-log, read before the profile: one that cannot be read or
    holds no iteration time is bad input (one line, exit 2)."""
    if path is None:
        return None
    from .train_log import read
    try:
        return read(path, regex=regex, skip=skip)
    except ProfileError as exc:
        _fail(exc)


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def explain(fmt):
    """Print the reference: the four walls, the fixes table and the configuration rules."""
    import json

    from .explain import reference, render_reference
    if fmt == "json":
        click.echo(json.dumps(reference(), indent=2))
    else:
        click.echo(render_reference(), nl=False)


@main.command("recipe-path")
def recipe_path_cmd():
    """Print the folder that makes 'nsys recipe profclass' work:
    export NSYS_RECIPE_PATH=$(profclass recipe-path) (docs/recipe.md)."""
    from .recipe import recipe_path
    click.echo(recipe_path())


@main.command()
@click.argument("kind", type=click.Choice(["diagnose", "diff"]))
def schema(kind):
    """Print the JSON Schema (draft 2020-12) of the JSON output of KIND (diagnose or diff)."""
    from .contract import schema_text
    click.echo(schema_text(kind), nl=False)


@main.command()
@click.argument("profiles", nargs=-1, required=True)
@click.option("-o", "--out", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="The picture to write: .png, .svg or .pdf.")
@click.option("--iteration-range", "iteration_regex", default=None, metavar="REGEX",
              help="Regex for NVTX ranges that mark one iteration (default: iteration/step/ProfilerStep#N).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr (it shows only on a terminal).")
def timeline(profiles, output, iteration_regex, quiet):
    """Draw one representative steady-state iteration per GPU of PROFILES (compute, each
    collective type, copies, idle, NVTX) to a PNG, SVG or PDF picture."""
    one_heap()
    if not output.lower().endswith((".png", ".svg", ".pdf")):
        raise click.BadParameter("the picture's name must end in .png, .svg or .pdf", param_hint="--out")
    _check_inputs(profiles)
    from .pipeline import diagnose as run
    from .progress import reporter
    from .timeline_view import save_figure, timeline_figure
    with reporter(quiet) as progress:
        try:
            d = run(list(profiles), iteration_regex=iteration_regex, progress=progress, keep_timelines=True)
        except ProfileError as exc:
            progress.__exit__()
            _fail(exc)
        progress(f"drawing {output}")
        try:
            save_figure(timeline_figure(d), output)
        except OSError as exc:
            progress.__exit__()
            _fail(ProfileError(output, f"cannot write output ({exc.strerror})"))
    if not quiet:
        click.echo(f"{output}: {d.verdict['wall']} wall; one steady iteration of {len(d.devices)} GPU(s)", err=True)


EXIT_FAIL_ABOVE = 4


def _side_paths(value: str) -> list[str]:
    """One side of a diff: a file, a directory, or rank files joined by commas."""
    return [p for p in value.split(",") if p]


@main.command("diff")
@click.argument("sides", nargs=-1, metavar="BASE CANDIDATE")
@click.option("--base", "base_opt", multiple=True, metavar="PATH",
              help="A base profile (repeat for rank files); instead of the positional BASE.")
@click.option("--candidate", "cand_opt", multiple=True, metavar="PATH",
              help="A candidate profile (repeat for rank files); instead of the positional CANDIDATE.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True, help="Output format (markdown: a pull-request comment).")
@click.option("--fail-above", type=float, default=None, metavar="PCT",
              help="Exit 4 when the candidate is slower by more than PCT percent and the change is significant.")
@click.option("--min-effect", type=float, default=2.0, show_default=True, metavar="PCT",
              help="Smallest step-time change (percent) that can count as significant.")
@click.option("--alpha", type=float, default=0.05, show_default=True,
              help="Significance level of the step-time test (Welch's t-test on per-iteration step times).")
@click.option("--iteration-range", "iteration_regex", default=None, metavar="REGEX",
              help="Regex for NVTX ranges that mark one iteration.")
@click.option("--base-log", default=None, metavar="FILE",
              help="The base run's training log (Megatron-LM's 'elapsed time per iteration', NeMo's "
                   "'train_step_timing in s', STEP_MS lines). With --candidate-log: the change is decided on the "
                   "logs' iterations outside warm-up and the profiled range, not on the captured windows.")
@click.option("--candidate-log", default=None, metavar="FILE", help="The candidate run's training log.")
@click.option("--train-log-regex", "train_log_regex", default=None, callback=_log_regex, metavar="REGEX",
              help="Both logs' iteration time for another format: a regex with one named group ms (or s) and "
                   "optionally it (the iteration).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report to this file instead of stdout.")
def diff_cmd(sides, base_opt, cand_opt, fmt, fail_above, min_effect, alpha, iteration_regex, base_log,
             candidate_log, train_log_regex, output):
    """Compare a known-good run (BASE) with a new one (CANDIDATE): step time and its significance,
    the change per wall, the kernels that moved, communication and configuration changes.

    Each side is a profile file, a directory of rank files, rank files joined by commas, or a
    stored diagnosis JSON (from 'diagnose --format json' or 'hook')."""
    one_heap()
    from .diff import diff, render_markdown, render_text
    if base_opt or cand_opt:
        if sides or not (base_opt and cand_opt):
            raise click.UsageError("give BASE CANDIDATE, or both --base and --candidate (not a mix)")
        base, cand = list(base_opt), list(cand_opt)
    elif len(sides) == 2:
        base, cand = _side_paths(sides[0]), _side_paths(sides[1])
    else:
        raise click.UsageError(f"expected BASE CANDIDATE, got {len(sides)} argument(s)")
    if (base_log is None) != (candidate_log is None) or (train_log_regex and base_log is None):
        raise click.UsageError("give both --base-log and --candidate-log (--train-log-regex reads them), or neither")
    logs = [_read_train_log(p, train_log_regex, ()) for p in (base_log, candidate_log)]
    try:
        r = diff(base, cand, iteration_regex=iteration_regex, alpha=alpha, min_effect=min_effect / 100,
                 base_log=logs[0], candidate_log=logs[1])
    except ProfileError as exc:
        _fail(exc)
    text = {"json": lambda: r.to_json() + "\n", "markdown": lambda: render_markdown(r),
            "text": lambda: render_text(r)}[fmt]()
    if output:
        try:
            with open(output, "w") as fh:
                fh.write(text)
        except OSError as exc:
            _fail(ProfileError(output, f"cannot write output ({exc.strerror})"))
    else:
        click.echo(text, nl=False)
    if fail_above is not None and r.regression and r.judged_step["delta_pct"] > fail_above:
        sys.exit(EXIT_FAIL_ABOVE)


@main.command()
@click.argument("profiles", nargs=-1, required=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Write the reports here (default: beside the profile; the current directory if that "
                   "is not writable).")
@click.option("--baseline", multiple=True, metavar="PATH",
              help="Baseline profile (repeat for rank files) or stored .profclass.json to diff against.")
@click.option("--fail-on", callback=_walls, default="", metavar="WALL[,WALL]",
              help="Exit 3 when the verdict is one of these walls.")
@click.option("--fail-above", type=float, default=None, metavar="PCT",
              help="Exit 4 when slower than the baseline by more than PCT percent, significantly.")
@click.option("--min-effect", type=float, default=2.0, show_default=True, metavar="PCT",
              help="Smallest step-time change (percent) that can count as significant.")
@click.option("--iteration-range", "iteration_regex", default=None, metavar="REGEX",
              help="Regex for NVTX ranges that mark one iteration.")
@click.option("--strict", is_flag=True, help="Exit 2 on unreadable input instead of 0.")
@click.option("--untraced-step-ms", "untraced_step_ms", type=float, default=None, callback=_positive_ms, metavar="MS",
              help="The job's own step time without the profiler (its timer over iterations outside the "
                   "capture): the replay calibrates the host's speed to it before pricing the fixes.")
@train_log_options
@click.option("--baseline-log", default=None, metavar="FILE",
              help="The baseline run's training log: with --train-log, the diff against --baseline is decided on "
                   "both runs' iteration times outside the profiler (docs/diff.md).")
def hook(profiles, out_dir, baseline, fail_on, fail_above, min_effect, iteration_regex, strict, untraced_step_ms,
         train_log, train_log_regex, train_log_skip, baseline_log):
    """Post-job hook: diagnose PROFILES (one job), write <profile>.profclass.json and .md beside
    it, print one line for the training log. Exits 0 unless --fail-on / --fail-above (or
    --strict) asks otherwise: it never fails the job on its own."""
    one_heap()
    check_train_log(train_log, train_log_regex, train_log_skip, untraced_step_ms)
    if baseline_log is not None and not (baseline and train_log):
        raise click.UsageError("--baseline-log is compared with the job's --train-log in the diff against --baseline")
    from .hook import run_hook
    res = run_hook(list(profiles), out=out_dir, baseline=list(baseline), fail_on=fail_on,
                   fail_above=fail_above, iteration_regex=iteration_regex, strict=strict,
                   min_effect=min_effect / 100, untraced_step_ms=untraced_step_ms, train_log=train_log,
                   train_log_regex=train_log_regex, train_log_skip=train_log_skip, baseline_log=baseline_log)
    for m in res.messages:
        click.echo(m, err=True)
    if res.diagnosis is not None:
        click.echo(res.summary)
    sys.exit(res.exit_code)
