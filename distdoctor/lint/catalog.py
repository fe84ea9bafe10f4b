"""Every rule's code, name, severity and default, known without importing the rules.

Importing the rules imports libcst, which alone costs more than linting a file that no rule can
read (most files of a repository, under pre-commit). So the selection (`--select`, `--ignore`,
`per-file-ignores`) is resolved against this catalog, `distdoctor/data/rules.json`, and the rules
themselves are imported only when a file needs them. The catalog is generated from the rule
classes (`python -m distdoctor.lint.catalog`), and a test fails when it differs from them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

CATALOG = Path(__file__).resolve().parent.parent / "data" / "rules.json"


@dataclass(frozen=True)
class RuleInfo:
    """What selection and reports need to know of a rule."""

    code: str
    name: str
    severity: str
    default_on: bool


@cache
def catalog() -> tuple[RuleInfo, ...]:
    """The rules, sorted by code, as the catalog lists them."""
    return tuple(RuleInfo(**entry) for entry in json.loads(CATALOG.read_text(encoding="utf-8")))


def from_rules() -> tuple[RuleInfo, ...]:
    """The catalog the rule classes give (imports every rule)."""
    from distdoctor.lint.rule import all_rules

    return tuple(RuleInfo(rule.code, rule.name, str(rule.severity), rule.default_on) for rule in all_rules())


def render(infos: tuple[RuleInfo, ...]) -> str:
    return json.dumps([asdict(info) for info in infos], indent=1) + "\n"


if __name__ == "__main__":
    CATALOG.write_text(render(from_rules()), encoding="utf-8")
    print(f"wrote {CATALOG}")
