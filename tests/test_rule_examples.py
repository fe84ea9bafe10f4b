"""Every rule's own examples are its first tests: invalid ones report exactly on the marked lines,
valid ones stay silent, and fixes give exactly the documented text, idempotently."""

from __future__ import annotations

import pytest

from distdoctor.lint.engine import fix_source, lint_source
from distdoctor.lint.expectations import expected_findings
from distdoctor.lint.rule import all_rules

RULES = all_rules()
INVALID = [
    pytest.param(rule, example, id=f"{rule.code}-{rule.name}-invalid-{index}")
    for rule in RULES
    for index, example in enumerate(rule.invalid, start=1)
]
VALID = [
    pytest.param(rule, example, id=f"{rule.code}-{rule.name}-valid-{index}")
    for rule in RULES
    for index, example in enumerate(rule.valid, start=1)
]
FIXED = [p for p in INVALID if p.values[1].fixed is not None]


@pytest.mark.parametrize(("rule", "example"), INVALID)
def test_invalid_example_reports_on_marked_lines(rule, example):
    source = example.source
    expected = {(line, code) for line, code in expected_findings(source) if code == rule.code}
    assert expected, "an invalid example must mark at least one line with `# expect:`"
    found = {(f.line, f.code) for f in lint_source(source, "example.py", [rule]).findings}
    assert found == expected


@pytest.mark.parametrize(("rule", "example"), VALID)
def test_valid_example_is_silent(rule, example):
    findings = lint_source(example.source, "example.py", [rule]).findings
    assert [f"{f.line}: {f.message}" for f in findings] == []


@pytest.mark.parametrize(("rule", "example"), FIXED)
def test_fix_gives_documented_text_and_is_idempotent(rule, example):
    fixed, applied = fix_source(example.source, "example.py", [rule])
    assert applied >= 1
    assert fixed == example.fixed_source
    again, applied_again = fix_source(fixed, "example.py", [rule])
    assert (again, applied_again) == (fixed, 0)


def test_every_rule_documents_itself():
    for rule in RULES:
        doc = rule.documentation()
        for heading in ("## What it does", "## Why is this bad?", "## Example", "## Use instead", "## Fix safety"):
            assert heading in doc, f"{rule.code} lacks {heading}"
        if rule.code != "DD000":
            assert rule.invalid and rule.valid, f"{rule.code} needs invalid and valid examples"
