"""Each rule's precision measured on the real-world corpus: shown by `rules` and `explain`, and the
bar a default-on rule must meet (issue 12): precision >= 0.9 over >= 10 judged findings, or no
false finding at all. The figures come from benchmarks/corpus/*.judgments.jsonl through
`python benchmarks/realworld.py --corpus --write-precision`."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from distdoctor.cli import main
from distdoctor.lint.output import measured_precision
from distdoctor.lint.rule import all_rules

ROOT = Path(__file__).resolve().parents[1]
MEASURED = measured_precision()


def test_the_measured_precision_is_installed_and_names_known_rules():
    assert MEASURED["corpus"]["files"] >= 400 and MEASURED["corpus"]["repositories"] >= 80
    codes = {rule.code for rule in all_rules()}
    assert set(MEASURED["rules"]) <= codes


def test_every_default_on_rule_earns_its_default():
    below = []
    for rule in all_rules():
        row = MEASURED["rules"].get(rule.code)
        if not rule.default_on or not row or not row["false"]:
            continue
        if row["findings"] < 10 or row["true"] / row["findings"] < 0.9:
            below.append(f"{rule.code}: {row['true']}/{row['findings']}")
    assert below == [], "default-on rules below the bar: " + ", ".join(below)


def test_default_on_precision_overall_is_at_least_0_95():
    on = {rule.code for rule in all_rules() if rule.default_on}
    rows = [row for code, row in MEASURED["rules"].items() if code in on]
    true, findings = sum(r["true"] for r in rows), sum(r["findings"] for r in rows)
    assert findings and true / findings >= 0.95


def test_rules_and_explain_print_the_measured_precision():
    rule = max(all_rules(), key=lambda r: MEASURED["rules"].get(r.code, {}).get("findings", 0))
    row = MEASURED["rules"][rule.code]
    table = CliRunner().invoke(main, ["rules"]).output
    line = next(line for line in table.splitlines() if line.startswith(rule.code))
    assert f"{row['true'] / row['findings']:.2f} ({row['findings']})" in line
    page = CliRunner().invoke(main, ["explain", rule.code]).output
    assert f"Measured precision: {row['true']} of {row['findings']} findings true" in page
    listed = json.loads(CliRunner().invoke(main, ["rules", "--format", "json"]).output)
    assert next(r for r in listed if r["code"] == rule.code)["measured"] == row
