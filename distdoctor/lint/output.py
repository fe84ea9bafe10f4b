"""Output formats for lint findings: text, json, sarif, github, and the statistics table."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from distdoctor import __version__
from distdoctor.lint.finding import Finding

if TYPE_CHECKING:
    from distdoctor.lint.rule import Rule

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
HELP_URI = "https://github.com/distdoctor/distdoctor#rules"
SRCROOT = "%SRCROOT%"


def format_text(
    findings: Sequence[Finding],
    *,
    show_source: bool = False,
    sources: dict[str, list[str]] | None = None,
) -> str:
    lines = []
    for f in findings:
        lines.append(f"{f.path}:{f.line}:{f.column}: {f.code} [{f.severity}] {f.message}")
        if show_source and sources is not None and f.path in sources:
            text = sources[f.path]
            if 0 < f.line <= len(text):
                source_line = text[f.line - 1].rstrip("\n")
                width = max(1, (f.end_column - f.column) if f.end_line == f.line else len(source_line) - f.column + 1)
                lines.append(f"    {f.line} | {source_line}")
                lines.append(f"    {' ' * len(str(f.line))} | {' ' * (f.column - 1)}{'^' * width}")
    return "\n".join(lines)


def summary_line(findings: Sequence[Finding], files: int) -> str:
    if not findings:
        return f"All checks passed ({files} file{'s' if files != 1 else ''} checked)."
    counts = Counter(f.severity for f in findings)
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 and s != 'info' else ''}" for s in ("error", "warning", "info") if counts[s]]
    fixable = sum(1 for f in findings if f.fix is not None and f.fix.applicable == "safe")
    text = f"Found {len(findings)} finding{'s' if len(findings) != 1 else ''} ({', '.join(parts)}) in {files} file{'s' if files != 1 else ''}."
    if fixable:
        text += f" {fixable} fixable with `distdoctor lint --fix`."
    return text


def format_json(findings: Sequence[Finding]) -> str:
    return json.dumps([f.to_dict() for f in findings], indent=2)


def format_github(findings: Sequence[Finding]) -> str:
    level = {"error": "error", "warning": "warning", "info": "notice"}
    out = []
    for f in findings:
        message = f.message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        path = f.path.replace("%", "%25").replace(",", "%2C").replace(":", "%3A")
        out.append(
            f"::{level[f.severity]} file={path},line={f.line},col={f.column},"
            f"endLine={f.end_line},endColumn={f.end_column},title={f.code}::{f.code} {message}"
        )
    return "\n".join(out)


def counts_by_code(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    """Findings counted per code, most frequent first: code, name, count, fixable."""
    counts = Counter(f.code for f in findings)
    names = {f.code: f.name for f in findings}
    fixable_codes = {f.code for f in findings if f.fix is not None}
    return [
        {"code": code, "name": names[code], "count": count, "fixable": code in fixable_codes}
        for code, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ]


def format_statistics(findings: Sequence[Finding]) -> str:
    return "\n".join(
        f"{row['count']:>5}\t{row['code']}\t{'[*] ' if row['fixable'] else ''}{row['name']}"
        for row in counts_by_code(findings)
    )


def format_statistics_json(findings: Sequence[Finding]) -> str:
    return json.dumps(counts_by_code(findings), indent=2)


def format_statistics_github(findings: Sequence[Finding]) -> str:
    return "\n".join(
        f"::notice title=distdoctor statistics::{row['count']} {row['code']} {row['name']}"
        for row in counts_by_code(findings)
    )


def _rule_descriptor(rule: Rule) -> dict[str, Any]:
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.documentation().split("## Why is this bad?")[0].replace("## What it does", "").strip()},
        "help": {"text": rule.documentation(), "markdown": rule.documentation()},
        "helpUri": f"{HELP_URI}-{rule.code.lower()}",
        "defaultConfiguration": {"level": SARIF_LEVEL[rule.severity], "enabled": rule.default_on},
        "properties": {"tags": ["distributed-training"], "fixable": rule.fixable},
    }


def _artifact_location(path: str) -> dict[str, Any]:
    """A SARIF artifactLocation: `uri` is a URI reference, not a file path, so it is percent-encoded.

    A relative path stays relative, against `%SRCROOT%` (the directory distdoctor ran in), which is
    what GitHub code scanning resolves against the repository root; an absolute path becomes a
    `file://` URI.
    """
    p = Path(path)
    if p.is_absolute():
        return {"uri": p.as_uri()}
    return {"uri": quote(p.as_posix(), safe="/"), "uriBaseId": SRCROOT}


def format_sarif(findings: Sequence[Finding], *, statistics: bool = False) -> str:
    """SARIF 2.1.0; with `statistics`, the counts per code also go in the run's properties."""
    from distdoctor.lint.rule import all_rules  # the full pages: SARIF carries each rule's help

    rules = all_rules()
    index = {rule.code: i for i, rule in enumerate(rules)}
    results = []
    relative = False
    for f in findings:
        relative = relative or not Path(f.path).is_absolute()
        result: dict[str, Any] = {
            "ruleId": f.code,
            "level": SARIF_LEVEL[f.severity],
            "message": {"text": f.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": _artifact_location(f.path),
                        "region": {
                            "startLine": f.line,
                            "startColumn": f.column,
                            "endLine": f.end_line,
                            "endColumn": f.end_column,
                        },
                    }
                }
            ],
        }
        if f.code in index:  # DD000 and DD900 come from the engine, not from a listed rule
            result["ruleIndex"] = index[f.code]
        if f.fix is not None:
            result["fixes"] = [
                {
                    "description": {"text": f.fix.message or "distdoctor fix"},
                    "artifactChanges": [
                        {
                            "artifactLocation": _artifact_location(f.path),
                            "replacements": [
                                {
                                    "deletedRegion": {
                                        "startLine": e.line,
                                        "startColumn": e.column,
                                        "endLine": e.end_line,
                                        "endColumn": e.end_column,
                                    },
                                    "insertedContent": {"text": e.content},
                                }
                                for e in f.fix.edits
                            ],
                        }
                    ],
                }
            ]
        results.append(result)
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "distdoctor",
                "version": __version__,
                "informationUri": "https://github.com/distdoctor/distdoctor",
                "rules": [_rule_descriptor(rule) for rule in rules],
            }
        },
        "results": results,
    }
    if statistics:
        run["properties"] = {"statistics": counts_by_code(findings)}
    if relative:
        # Where %SRCROOT% is; the trailing slash makes the relative URIs resolve inside it.
        try:
            root = Path.cwd().as_uri()
        except OSError:  # the working directory is gone: the base stays unnamed, as SARIF allows
            root = ""
        if root:
            run["originalUriBaseIds"] = {SRCROOT: {"uri": root if root.endswith("/") else root + "/"}}
    document = {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
    return json.dumps(document, indent=2)


def measured_precision() -> dict[str, Any]:
    """Each rule's precision measured on the real-world corpus (`benchmarks/realworld.py --corpus
    --write-precision` writes it from the judged findings); {} when the file is not installed."""
    try:
        return json.loads((Path(__file__).resolve().parents[1] / "data" / "precision.json").read_text())
    except (OSError, ValueError):
        return {}


def _precision_cell(code: str, measured: dict[str, Any]) -> str:
    row = measured.get("rules", {}).get(code)
    if not row or not row["findings"]:
        return "-"
    return f"{row['true'] / row['findings']:.2f} ({row['findings']})"


def format_rules_table(rules: Sequence[Rule]) -> str:
    measured = measured_precision()
    width = max([34, *(len(rule.name) for rule in rules)])  # DD505's name is longer than the rest
    rows = [f"{'code':<6}  {'name':<{width}}  {'severity':<8}  {'default':<7}  fix  {'precision':<11}  summary"]
    for rule in rules:
        rows.append(
            f"{rule.code:<6}  {rule.name:<{width}}  {rule.severity:<8}  {'on' if rule.default_on else 'off':<7}  "
            f"{'yes' if rule.fixable else '-':<3}  {_precision_cell(rule.code, measured):<11}  {rule.summary}"
        )
    corpus = measured.get("corpus")
    if corpus:
        rows.append("")
        rows.append(f"precision: true findings / findings (count) on {corpus['files']} real training files from "
                    f"{corpus['repositories']} public repositories, each finding judged by reading the code; "
                    "- : no finding there.")
    return "\n".join(rows)


def _precision_sentence(code: str, measured: dict[str, Any]) -> str:
    corpus = measured.get("corpus")
    if not corpus:
        return ""
    where = f"{corpus['files']} real training files from {corpus['repositories']} public repositories"
    row = measured.get("rules", {}).get(code)
    if not row or not row["findings"]:
        return f"Measured precision: no finding on {where}."
    return (f"Measured precision: {row['true']} of {row['findings']} findings true "
            f"({row['true'] / row['findings']:.2f}) on {where}, each judged by reading the code.")


def format_explain(rule: Rule) -> str:
    header = [
        f"# {rule.code} {rule.name}",
        "",
        f"Severity: {rule.severity}. {'On by default' if rule.default_on else 'Off by default: select it with --extend-select ' + rule.code}."
        f" {'Autofix: yes.' if rule.fixable else 'Autofix: no.'}",
    ]
    sentence = _precision_sentence(rule.code, measured_precision())
    if sentence:
        header.append(sentence)
    header += ["", ""]  # a blank line before the page
    return "\n".join(header) + rule.documentation() + "\n"
