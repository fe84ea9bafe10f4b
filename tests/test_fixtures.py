"""Every fixture script carries its verdicts inline (`# expect: DD201` on the line that must be
reported); every rule, default-off ones included, must produce exactly those findings."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdoctor.lint.engine import lint_source
from distdoctor.lint.expectations import expected_findings
from distdoctor.lint.rule import all_rules

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "lint").glob("*.py"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_fixture_findings_match_its_markers(path: Path):
    source = path.read_text(encoding="utf-8")
    found = {(f.line, f.code) for f in lint_source(source, path.name, all_rules()).findings}
    expected = expected_findings(source)
    missing = sorted(expected - found)
    unexpected = sorted(found - expected)
    assert not missing and not unexpected, f"missing: {missing}  unexpected: {unexpected}"


def test_there_are_good_and_bad_fixtures_for_every_rule():
    marked = {code for path in FIXTURES for _, code in expected_findings(path.read_text(encoding="utf-8"))}
    clean = [path for path in FIXTURES if not expected_findings(path.read_text(encoding="utf-8"))]
    assert clean, "at least one fixture must be a correct script with no finding"
    missing = [rule.code for rule in all_rules() if rule.code != "DD000" and rule.code not in marked]
    assert not missing, f"rules without a fixture that triggers them: {missing}"
