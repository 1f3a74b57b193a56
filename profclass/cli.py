"""The ``profclass`` command line."""
from __future__ import annotations

import sys

import click

from .classify import WALLS
from .errors import ProfileError

EXIT_BAD_INPUT = 2
EXIT_FAIL_ON = 3


def _fail(exc: Exception) -> None:
    click.echo(f"profclass: error: {exc}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _walls(ctx, param, value):
    if not value:
        return []
    walls = [w.strip() for w in value.split(",") if w.strip()]
    bad = [w for w in walls if w not in WALLS]
    if bad:
        raise click.BadParameter(f"unknown wall(s) {', '.join(bad)}; choose from {', '.join(WALLS)}")
    return walls


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="profclass")
def main():
    """Diagnose Nsight Systems profiles of (MoE) training jobs: which wall holds the step back."""


@main.command()
@click.argument("profiles", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True, help="Output format.")
@click.option("--iteration-range", "iteration_regex", default=None, metavar="REGEX",
              help="Regex for NVTX ranges that mark one iteration (default: iteration/step/ProfilerStep#N).")
@click.option("--fail-on", callback=_walls, default="", metavar="WALL[,WALL]",
              help="Exit 3 when the verdict is one of these walls (for job hooks).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report to this file instead of stdout.")
def diagnose(profiles, fmt, iteration_regex, fail_on, output):
    """Diagnose PROFILES: one nsys export holding every rank, one export per rank, or a
    directory of them (.sqlite, .sqlite.zst, .nsys-rep)."""
    from . import report
    from .pipeline import diagnose as run
    try:
        d = run(list(profiles), iteration_regex=iteration_regex)
    except ProfileError as exc:
        _fail(exc)
    text = {"json": lambda: d.to_json() + "\n", "markdown": lambda: report.render_markdown(d),
            "text": lambda: report.render_text(d)}[fmt]()
    if output:
        try:
            with open(output, "w") as fh:
                fh.write(text)
        except OSError as exc:
            _fail(ProfileError(output, f"cannot write output ({exc.strerror})"))
    else:
        click.echo(text, nl=False)
    if d.verdict["wall"] in fail_on:
        sys.exit(EXIT_FAIL_ON)


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
