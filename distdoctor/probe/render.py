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


def _overhead_line(overhead: Any) -> str:
    """'probe overhead: 0.42 ms per step (1.3% of training time) at most, over 2 ranks'."""
    if not isinstance(overhead, dict) or not overhead.get("ranks"):
        return ""
    ranks = overhead["ranks"].values()
    per_step = max(float(v.get("hook_ms_per_step", 0.0)) for v in ranks)
    share = overhead.get("max_share_of_train_time")
    text = f"probe overhead: {per_step:.3g} ms per step at most"
    if isinstance(share, (int, float)):
        text += f" ({100 * share:.2g}% of the training time)"
    return text + f", over {len(overhead['ranks'])} rank(s)"


def render_text(report: Report, *, evidence: bool = True) -> str:
    """The report as a table (check, status, finding) followed by evidence per rank."""
    if "relayed_to" in report.extra:
        return render_relayed(report)
    width = max([len(c.id) for c in report.checks] + [5])
    verdict = "OK" if report.ok else "PROBLEMS FOUND"
    if report.checks and not report.verified:
        verdict = f"NOTHING VERIFIED ({report.extra.get('nothing_verified') or 'every check was skipped'})"
    head = (f"distdoctor probe ({report.mode}): {report.world_size} ranks, {report.backend}, "
            f"{report.duration_s:.1f} s: {verdict}")
    rows = [head]
    hosts = report.extra.get("hosts")
    if hosts:
        rows.append("ranks per host: " + "; ".join(f"{host}: {','.join(map(str, ranks))}" for host, ranks in hosts.items()))
    rows += [f"lost: {lost}" for lost in report.extra.get("nodes_lost", ())]
    rows += ["", f"{'check':<{width}}  {'status':<6} finding"]
    rows += [f"{c.id:<{width}}  {c.status.upper():<6} {c.summary}" for c in report.checks]
    cost = _overhead_line(report.extra.get("overhead"))
    if cost:
        rows += ["", cost]
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
