"""DD000 syntax-error: the file cannot be parsed."""

from __future__ import annotations

from collections.abc import Iterable

from distdoctor.lint.rule import Report, Rule


class SyntaxErrorRule(Rule):
    """
    ## What it does
    Reports a file that distdoctor cannot parse as Python, at the place and with the message
    Python's own parser gives. The same code reports a file it will not hand to its parser (nested
    deeper than the parser can take, or too large, with the reason), a file that is not UTF-8 text
    or not a notebook, and, named `internal-error`, a file on which a rule failed: that one is a
    bug in distdoctor, please report it (`DISTDOCTOR_DEBUG=1` shows the traceback).

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
    requires = (frozenset(),)  # the engine reports DD000 itself; the rule has nothing to check

    def check(self, ctx) -> Iterable[Report]:
        # The engine reports DD000 itself when parsing fails; a parsed file has none.
        return ()
