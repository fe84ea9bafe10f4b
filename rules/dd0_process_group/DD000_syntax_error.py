"""DD000 syntax-error: the file cannot be parsed."""

from __future__ import annotations

from collections.abc import Iterable

from distdoctor.lint.rule import Report, Rule


class SyntaxErrorRule(Rule):
    """
    ## What it does
    Reports a file that distdoctor cannot parse as Python, at the place the parser stopped.

    ## Why is this bad?
    No other rule can look at a file that does not parse, so its distributed bugs go unseen.
    distdoctor reports it as a finding instead of crashing, and lints the other files.

    ## Example
    ```python
    model = DDP(model,
    ```

    ## Use instead
    Fix the syntax error; `python -m py_compile FILE` shows the same place.

    ## Fix safety
    No automatic fix.
    """

    code = "DD000"
    name = "syntax-error"
    severity = "error"
    summary = "the file cannot be parsed"

    def check(self, ctx) -> Iterable[Report]:
        # The engine reports DD000 itself when parsing fails; a parsed file has none.
        return ()
