"""Text rendering of a probe Report: one row per check, then the evidence per rank.

Used by both the built-in and the script probe; JSON output is `Report.to_json()`.
"""

from __future__ import annotations

import json
from typing import Any

from distdoctor.probe.report import CheckResult, Report

_MAX_VALUE_CHARS = 160


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    lines = text.strip().splitlines()
    if len(lines) > 1:  # a traceback: its last line says what happened, JSON has the rest
        text = f"{lines[-1].strip()}  [{len(lines)} lines]"
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def _evidence_lines(check: CheckResult) -> list[str]:
    lines = []
    for rank, evidence in sorted(check.ranks.items(), key=lambda item: int(item[0]) if item[0].isdigit() else -1):
        if isinstance(evidence, dict):
            body = ", ".join(f"{key}={_short(value)}" for key, value in evidence.items())
        else:
            body = _short(evidence)
        lines.append(f"    rank {rank}: {body}")
    return lines


def render_text(report: Report, *, evidence: bool = True) -> str:
    """The report as a table (check, status, finding) followed by evidence per rank."""
    if "relayed_to" in report.extra:
        return render_relayed(report)
    width = max([len(c.id) for c in report.checks] + [5])
    head = (f"distdoctor probe ({report.mode}): {report.world_size} ranks, {report.backend}, "
            f"{report.duration_s:.1f} s: {'OK' if report.ok else 'PROBLEMS FOUND'}")
    rows = [head]
    hosts = report.extra.get("hosts")
    if hosts:
        rows.append("ranks per host: " + "; ".join(f"{host}: {','.join(map(str, ranks))}" for host, ranks in hosts.items()))
    rows += [f"lost: {lost}" for lost in report.extra.get("nodes_lost", ())]
    rows += ["", f"{'check':<{width}}  {'status':<6} finding"]
    rows += [f"{c.id:<{width}}  {c.status.upper():<6} {c.summary}" for c in report.checks]
    if evidence:
        rows += ["", "evidence per rank:"]
        for check in report.checks:
            if check.ranks:
                rows.append(f"  {check.id}:")
                rows += _evidence_lines(check)
    return "\n".join(rows) + "\n"


def render_relayed(report: Report) -> str:
    """What a node other than node 0 says: where its ranks' records went, and how its launch ended."""
    extra = report.extra
    lines = [f"distdoctor probe (script): node {extra['node_rank']}: its ranks' records went to node 0 "
             f"({extra['relayed_to']}); the report is printed there."]
    if extra.get("relay_error"):
        lines.append(f"warning: {extra['relay_error']}: node 0 may judge this node on partial records")
    if not extra.get("launch_ok", True):
        lines.append(f"this node's launch: {extra.get('launch_failure')}")
    return "\n".join(lines) + "\n"
