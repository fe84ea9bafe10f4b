"""`# expect: DD101` markers: the verdicts written next to the offending lines of examples and
fixtures (the flake8-bugbear way), read back by the tests and the real-world check."""

from __future__ import annotations

import re

EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>DD\d{3}(?:\s*,\s*DD\d{3})*)")


def expected_findings(source: str) -> set[tuple[int, str]]:
    """(line, code) for every `# expect:` marker in `source`."""
    found = set()
    for number, line in enumerate(source.splitlines(), start=1):
        match = EXPECT.search(line)
        if match:
            for code in re.split(r"\s*,\s*", match.group("codes")):
                found.add((number, code))
    return found
