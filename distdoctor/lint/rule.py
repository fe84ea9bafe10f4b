"""What a rule is, and how rules are found.

A rule is one class in one module under `rules/` (installed as `distdoctor.rules`): its code,
name, severity, whether it runs by default, its documentation (the class docstring, in the order
of ruff's rule pages) and its examples. The examples are the rule's tests (see
`tests/test_rule_examples.py`) and feed `distdoctor explain`; a rule whose invalid examples carry a
`fixed` text is autofixable.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, ClassVar

import libcst as cst

from distdoctor.lint.finding import Fix, Severity

if TYPE_CHECKING:
    from distdoctor.lint.analysis.context import LintContext

CODE_PATTERN = re.compile(r"^DD\d{3}$")


@dataclass(frozen=True)
class Example:
    """A snippet for a rule. In an invalid example, `# expect: DDxxx` marks each line where the
    rule must report; `fixed` is the text after `--fix`, when the rule can fix it."""

    code: str
    fixed: str | None = None

    @property
    def source(self) -> str:
        return textwrap.dedent(self.code).lstrip("\n")

    @property
    def fixed_source(self) -> str | None:
        return None if self.fixed is None else textwrap.dedent(self.fixed).lstrip("\n")


@dataclass(frozen=True)
class Report:
    """What a rule's check yields: the node to point at, the message, an optional fix."""

    node: cst.CSTNode
    message: str
    fix: Fix | None = None


class Rule:
    """Base class of every rule. Subclasses set the class attributes and implement `check`."""

    code: ClassVar[str]
    name: ClassVar[str]
    severity: ClassVar[Severity]
    default_on: ClassVar[bool] = True
    summary: ClassVar[str]
    invalid: ClassVar[tuple[Example, ...]] = ()
    valid: ClassVar[tuple[Example, ...]] = ()
    # The rule's gate: groups of words (see `engine.code_words`), each of which must have a member
    # in the file for the rule to report anything there (`requires = (DDP_WORDS, {"save"})`: a
    # DistributedDataParallel and a save). The engine runs only the rules whose gate a file passes,
    # and parses no tree when none does: most files that merely import torch.distributed. A gate
    # must be a necessary condition, derived from what `check` resolves (a call resolved to
    # `torch.save` has the word `save` in the code); `tests/test_rule_examples.py` runs every example
    # through it and the corpus re-run checks that no finding is lost.
    requires: ClassVar[tuple[frozenset[str], ...]] = ()

    @property
    def fixable(self) -> bool:
        return any(example.fixed is not None for example in self.invalid)

    @classmethod
    def documentation(cls) -> str:
        return textwrap.dedent(cls.__doc__ or "").strip()

    def applies(self, words: frozenset[str]) -> bool:
        """Whether the file's words pass this rule's gate (`requires`)."""
        return all(not group.isdisjoint(words) for group in self.requires)

    def check(self, ctx: LintContext) -> Iterable[Report]:  # pragma: no cover - abstract
        raise NotImplementedError


@cache
def all_rules() -> tuple[Rule, ...]:
    """Every rule in `distdoctor.rules`, sorted by code. Codes must be unique and well-formed."""
    import distdoctor.rules as package

    found: dict[str, Rule] = {}
    # Rules are grouped by family in subpackages (rules/dd1_ddp/DD101_...py); walk them all.
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        if info.ispkg:
            continue
        module = importlib.import_module(info.name)
        for rule_cls in _rule_classes(module):
            rule = rule_cls()
            if not CODE_PATTERN.match(rule.code):
                raise RuntimeError(f"{rule_cls.__qualname__}: malformed rule code {rule.code!r}")
            if rule.code in found:
                raise RuntimeError(f"duplicate rule code {rule.code}")
            found[rule.code] = rule
    return tuple(found[code] for code in sorted(found))


def _rule_classes(module: object) -> Iterator[type[Rule]]:
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, Rule)
            and value is not Rule
            and value.__module__ == getattr(module, "__name__", None)
            and "code" in vars(value)
        ):
            yield value


def rules_with_codes(codes: Iterable[str]) -> list[Rule]:
    """The rules of `codes`, in code order."""
    wanted = set(codes)
    return [rule for rule in all_rules() if rule.code in wanted]


def rule_by_code(code: str) -> Rule | None:
    return next((rule for rule in all_rules() if rule.code == code), None)
