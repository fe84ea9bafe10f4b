"""`distdoctor lint`, `distdoctor rules` and `distdoctor explain`: parse the options, call the lint
API (`distdoctor.lint.engine`), print, set the exit status."""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
FORMATS = ("text", "json", "sarif", "github")


class Abort(click.ClickException):
    """A user error: printed as `distdoctor: message`, exit status 2."""

    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:  # noqa: D102 - click API
        click.echo(f"distdoctor: error: {self.message}", err=True)


def _codes(values: tuple[str, ...]) -> tuple[str, ...] | None:
    """`--select DD1,DD201 --select DD4` -> ("DD1", "DD201", "DD4")."""
    if not values:
        return None
    return tuple(code.strip().upper() for value in values for code in value.split(",") if code.strip())


@click.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--select", multiple=True, help="Codes or prefixes to run instead of the defaults (DD4 = Horovod rules; ALL).")
@click.option("--extend-select", multiple=True, help="Codes or prefixes to run in addition (e.g. a default-off rule).")
@click.option("--ignore", multiple=True, help="Codes or prefixes not to report.")
@click.option("--format", "output_format", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("--fix", is_flag=True, help="Apply safe fixes in place (atomically).")
@click.option("--diff", is_flag=True, help="Show the fixes as a diff; write nothing.")
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when there are findings.")
@click.option("--statistics", is_flag=True, help="Count findings per code.")
@click.option("--show-source", is_flag=True, help="Show the offending line under each finding.")
@click.option("-q", "--quiet", is_flag=True, help="Print findings only, no summary.")
@click.option("--stdin-filename", help="Lint standard input, reported under this name.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="Use this pyproject.toml.")
@click.option("--no-cache", is_flag=True, help="Do not read or write .distdoctor_cache/.")
@click.option("--report-unused-noqa", is_flag=True, help="Report suppression comments that matched nothing (as DD900 findings).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Processes to lint with (default: the CPUs, at most 8).")
@click.option("--force-exclude", is_flag=True, help="Apply `exclude` to files named on the command line too (for pre-commit).")
def lint(paths, select, extend_select, ignore, output_format, fix, diff, exit_zero, statistics, show_source, quiet, stdin_filename, config_path, no_cache, report_unused_noqa, jobs, force_exclude):
    """Lint training scripts: files, folders (default .), or - for standard input."""
    from distdoctor.lint.config import ConfigError, load_config

    use_stdin = paths == ("-",) or (stdin_filename is not None and not paths)
    start = Path(paths[0]) if paths and not use_stdin and Path(paths[0]).exists() else Path.cwd()
    try:
        config = load_config(start, Path(config_path) if config_path else None)
        config = config.merged(
            select=_codes(select),
            extend_select=(*config.extend_select, *(_codes(extend_select) or ())),
            ignore=(*config.ignore, *(_codes(ignore) or ())),
            cache=False if no_cache else None,
        )
        config.selected_codes()  # an unknown code is an error before any file is read
    except ConfigError as exc:
        raise Abort(str(exc)) from None

    show = _Show(output_format, quiet, statistics, show_source, report_unused_noqa)
    try:
        if use_stdin:
            if force_exclude and stdin_filename and config.is_excluded(Path(stdin_filename)):
                status = EXIT_CLEAN
            else:
                status = _lint_stdin(stdin_filename or "-", config.selected_rules(), config, fix, diff, show)
        else:
            status = _lint_paths(paths or (".",), config, fix, diff, show, jobs, force_exclude)
    except KeyboardInterrupt:
        # The workers are stopped by the engine; no traceback, the shell's status for SIGINT.
        click.echo("distdoctor: interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:  # while printing a diff: the reader is gone, nothing was lost on disk
        _discard_stdout()
        raise SystemExit(EXIT_ERROR) from None
    except Exception as exc:  # never a traceback for the user; DISTDOCTOR_DEBUG=1 shows it
        if os.environ.get("DISTDOCTOR_DEBUG"):
            raise
        raise Abort(f"internal error: {type(exc).__name__}: {exc} (set DISTDOCTOR_DEBUG=1 for the traceback, and please report it)") from None
    if status == EXIT_FINDINGS and exit_zero:
        status = EXIT_CLEAN
    sys.exit(status)


@dataclass(frozen=True)
class _Show:
    """How the findings are printed."""

    output_format: str
    quiet: bool
    statistics: bool
    show_source: bool
    report_unused_noqa: bool


def _emit(findings, files, show: _Show, sources=None) -> None:
    try:
        _print_findings(findings, files, show, sources)
    except BrokenPipeError:
        # The reader stopped early (`distdoctor lint | head`): the exit status still says what was found.
        _discard_stdout()


def _discard_stdout() -> None:
    """Point standard output at the null device, so that nothing more (nor the interpreter's
    final flush) writes to a pipe whose reader is gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _print_findings(findings, files, show: _Show, sources=None) -> None:
    from distdoctor.lint import output as report

    output_format = show.output_format
    if show.statistics:
        # Counts per code instead of the findings, in the format asked for.
        if output_format == "json":
            click.echo(report.format_statistics_json(findings))
        elif output_format == "sarif":
            click.echo(report.format_sarif(findings, statistics=True))
        elif findings:
            click.echo(report.format_statistics_github(findings) if output_format == "github" else report.format_statistics(findings))
        return
    if output_format == "json":
        click.echo(report.format_json(findings))
    elif output_format == "sarif":
        click.echo(report.format_sarif(findings))
    elif output_format == "github":
        if findings:
            click.echo(report.format_github(findings))
    else:
        if findings:
            click.echo(report.format_text(findings, show_source=show.show_source, sources=sources))
        if not show.quiet:
            click.echo(report.summary_line(findings, files))


def _with_unused_noqa(findings, unused, show: _Show) -> list:
    """The findings, plus one DD900 finding per unused suppression when they are asked for."""
    if not show.report_unused_noqa or not unused:
        return list(findings)
    from distdoctor.lint.engine import unused_noqa_finding

    return sorted([*findings, *(unused_noqa_finding(u) for u in unused)], key=lambda f: f.sort_key)


def _lint_stdin(name, rules, config, fix, diff, show: _Show) -> int:
    from distdoctor.lint.engine import fix_text, lint_source

    source = sys.stdin.read()
    if fix or diff:
        fixed, _ = fix_text(source, name, rules)
        if diff:
            click.echo(_unified(source, fixed, name), nl=False)
            return EXIT_FINDINGS if fixed != source else EXIT_CLEAN
        sys.stdout.write(fixed)  # like ruff: the fixed text goes to stdout
        return EXIT_CLEAN
    result = lint_source(source, name, rules, project=config.project_for(name, source))
    ignored = config.ignored_for(name)
    findings = [f for f in result.findings if not any(f.code.startswith(c) for c in ignored)]
    findings = _with_unused_noqa(findings, result.unused_noqa, show)
    _emit(findings, 1, show, {name: source.splitlines(keepends=True)})
    return EXIT_FINDINGS if findings else EXIT_CLEAN


def _lint_paths(paths, config, fix, diff, show: _Show, jobs, force_exclude) -> int:
    from distdoctor.lint.engine import fix_file, lint

    result = lint(list(paths), config, jobs=jobs, force_exclude=force_exclude)
    errors = list(result.errors)
    if fix or diff:
        rules = config.selected_rules()
        fixable = sorted({f.path for f in result.findings if f.fix is not None and f.fix.applicable == "safe"})
        changed = 0
        for shown in fixable:
            path = Path(shown)
            if path.suffix == ".ipynb":
                continue  # notebooks are reported, never rewritten
            outcome = fix_file(path, rules, write=not diff)
            if outcome is None:
                continue
            changed += 1
            if diff:
                click.echo(outcome.diff, nl=False)
            else:
                click.echo(f"distdoctor: fixed {outcome.applied} finding{'s' if outcome.applied != 1 else ''} in {shown}", err=True)
        if diff:
            for error in errors:
                click.echo(f"distdoctor: error: {error}", err=True)
            return EXIT_ERROR if errors else (EXIT_FINDINGS if changed else EXIT_CLEAN)
        if changed:
            result = lint(list(paths), config, jobs=jobs, force_exclude=force_exclude)
    findings = _with_unused_noqa(result.findings, result.unused_noqa, show)
    sources = None
    if show.show_source:
        from distdoctor.lint.engine import read_source

        sources = {}
        for f in findings:
            if f.path not in sources:
                try:
                    sources[f.path] = read_source(Path(f.path)).splitlines(keepends=True)
                except Exception:
                    sources[f.path] = []
    for error in errors:
        click.echo(f"distdoctor: error: {error}", err=True)
    quiet = show.quiet or (bool(errors) and result.files == 0)
    _emit(findings, result.files, replace(show, quiet=quiet), sources)
    if errors:
        return EXIT_ERROR
    return EXIT_FINDINGS if findings else EXIT_CLEAN


def _unified(before: str, after: str, name: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True), name, name))


@click.command("rules")
@click.option("--format", "output_format", type=click.Choice(("text", "json")), default="text", show_default=True)
def rules_command(output_format):
    """List every rule: code, name, severity, default on/off, fixable."""
    import json

    from distdoctor.lint import output as report
    from distdoctor.lint.rule import all_rules

    if output_format == "json":
        measured = report.measured_precision().get("rules", {})
        click.echo(json.dumps([
            {"code": r.code, "name": r.name, "severity": r.severity, "default_on": r.default_on, "fixable": r.fixable,
             "summary": r.summary, "measured": measured.get(r.code)}
            for r in all_rules()
        ], indent=2))
    else:
        click.echo(report.format_rules_table(all_rules()))


@click.command()
@click.argument("code")
def explain(code):
    """Print a rule's documentation, with its example (by code or name)."""
    from distdoctor.lint import output as report
    from distdoctor.lint.rule import all_rules

    wanted = code.strip()
    rule = next((r for r in all_rules() if wanted.upper() == r.code or wanted.lower() == r.name), None)
    if rule is None:
        raise Abort(f"unknown rule {code!r} (see `distdoctor rules` for the codes)")
    click.echo(report.format_explain(rule), nl=False)
