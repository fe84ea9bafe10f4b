"""`distdoctor lint`, `distdoctor rules` and `distdoctor explain`: parse the options, call the lint
API (`distdoctor.lint.engine`), print, set the exit status."""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

import click

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
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
@click.option("--report-unused-noqa", is_flag=True, help="Report suppression comments that matched nothing.")
def lint(paths, select, extend_select, ignore, output_format, fix, diff, exit_zero, statistics, show_source, quiet, stdin_filename, config_path, no_cache, report_unused_noqa):
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
        rules = config.selected_rules()
    except ConfigError as exc:
        raise Abort(str(exc)) from None

    try:
        if use_stdin:
            status = _lint_stdin(stdin_filename or "-", rules, config, output_format, fix, diff, quiet, statistics, show_source)
        else:
            status = _lint_paths(paths or (".",), config, output_format, fix, diff, quiet, statistics, show_source, report_unused_noqa)
    except (KeyboardInterrupt, BrokenPipeError):
        raise SystemExit(EXIT_ERROR) from None
    except Exception as exc:  # never a traceback for the user; DISTDOCTOR_DEBUG=1 shows it
        if os.environ.get("DISTDOCTOR_DEBUG"):
            raise
        raise Abort(f"internal error: {type(exc).__name__}: {exc} (set DISTDOCTOR_DEBUG=1 for the traceback, and please report it)") from None
    if status == EXIT_FINDINGS and exit_zero:
        status = EXIT_CLEAN
    sys.exit(status)


def _emit(findings, files, output_format, quiet, statistics, show_source, sources=None) -> None:
    from distdoctor.lint import output as report

    if statistics:
        if findings:
            click.echo(report.format_statistics(findings))
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
            click.echo(report.format_text(findings, show_source=show_source, sources=sources))
        if not quiet:
            click.echo(report.summary_line(findings, files))


def _lint_stdin(name, rules, config, output_format, fix, diff, quiet, statistics, show_source) -> int:
    from distdoctor.lint.engine import fix_source, lint_source

    source = sys.stdin.read()
    if fix or diff:
        fixed, _ = fix_source(source, name, rules)
        if diff:
            click.echo(_unified(source, fixed, name), nl=False)
            return EXIT_FINDINGS if fixed != source else EXIT_CLEAN
        sys.stdout.write(fixed)  # like ruff: the fixed text goes to stdout
        return EXIT_CLEAN
    result = lint_source(source, name, rules)
    ignored = config.ignored_for(name)
    findings = [f for f in result.findings if not any(f.code.startswith(c) for c in ignored)]
    _emit(findings, 1, output_format, quiet, statistics, show_source, {name: source.splitlines(keepends=True)})
    return EXIT_FINDINGS if findings else EXIT_CLEAN


def _lint_paths(paths, config, output_format, fix, diff, quiet, statistics, show_source, report_unused_noqa) -> int:
    from distdoctor.lint.engine import fix_source, lint, read_source, write_atomically

    result = lint(list(paths), config)
    errors = list(result.errors)
    if fix or diff:
        rules = config.selected_rules()
        fixable = sorted({f.path for f in result.findings if f.fix is not None and f.fix.applicable == "safe"})
        changed = 0
        for shown in fixable:
            path = Path(shown)
            if path.suffix == ".ipynb":
                continue  # notebooks are reported, never rewritten
            original = read_source(path)
            fixed, applied = fix_source(original, shown, rules)
            if fixed == original:
                continue
            changed += 1
            if diff:
                click.echo(_unified(original, fixed, shown), nl=False)
            else:
                write_atomically(path, fixed)
                click.echo(f"distdoctor: fixed {applied} finding{'s' if applied != 1 else ''} in {shown}", err=True)
        if diff:
            for error in errors:
                click.echo(f"distdoctor: error: {error}", err=True)
            return EXIT_ERROR if errors else (EXIT_FINDINGS if changed else EXIT_CLEAN)
        if changed:
            result = lint(list(paths), config)
    sources = None
    if show_source:
        sources = {}
        for f in result.findings:
            if f.path not in sources:
                try:
                    sources[f.path] = read_source(Path(f.path)).splitlines(keepends=True)
                except (OSError, ValueError):
                    sources[f.path] = []
    for error in errors:
        click.echo(f"distdoctor: error: {error}", err=True)
    quiet = quiet or (bool(errors) and result.files == 0)
    _emit(list(result.findings), result.files, output_format, quiet, statistics, show_source, sources)
    if report_unused_noqa:
        for unused in result.unused_noqa:
            what = ", ".join(unused.codes) if unused.codes else "everything (bare noqa)"
            click.echo(f"{unused.path}:{unused.line}: unused suppression of {what}", err=True)
    if errors:
        return EXIT_ERROR
    return EXIT_FINDINGS if result.findings or (report_unused_noqa and result.unused_noqa) else EXIT_CLEAN


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
