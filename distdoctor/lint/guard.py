"""What the syntax-tree parser must never be handed, found by a cheap scan of the text first.

libcst's native parser overflows its stack and kills the whole process (a segmentation fault, no
message) on deeply nested input, and its time grows faster than linearly with the depth of an
expression. Measured with libcst 1.x on CPython 3.11 (8 MiB stack): 1,500 nested brackets or
30,000 unary minus signs crash it; 3,000 chained `+` take 7 s, 1,000 chained subscripts 4 s.
CPython's own parser refuses more than 200 nested brackets ("too many nested parentheses"), so a
file over that limit cannot run anyway.

`too_deep_or_large(source)` returns the reason a text must not be parsed, or None. It reads the
text once with one regular expression (strings and comments skipped) and estimates the depth of
the syntax tree: brackets open inside one another, plus, at each bracket level, the operators,
dots, keywords and strings chained since the last comma. The estimate is never below the true
depth of an expression, so a file it accepts stays far from what crashes the parser.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

# CPython's tokenizer limit (MAXLEVEL): more nested brackets is a SyntaxError in Python itself.
MAX_BRACKETS = 200
# Estimated depth of one expression. libcst parses depth 500 in 0.6 s at worst (a chain of
# subscripts) and, on an 8 MiB stack, crashes near 1,500 nested brackets; parsing runs on a
# 256 MiB stack (below), so the margin is far larger than that ratio. The deepest expression in
# all of torch's own sources is estimated at 53.
MAX_DEPTH = 500
# Bytes of source handed to libcst. Its tree and the analysis cost about 0.9 GB and 20 s of CPU
# per MB of source (a generated file of training functions, measured here): over 1 MiB a file is
# DD000 "too large" rather than a risk to the machine. The largest file of torch's own sources
# that mentions a distributed API is 0.53 MB.
MAX_BYTES = 1024 * 1024
# Bytes of source given to CPython's compiler to check the syntax of a file no rule reads
# (about 0.1 GB and 0.3 s per MB); a larger such file is not checked.
MAX_CHECK_BYTES = 8 * 1024 * 1024

_TOKEN = re.compile(
    r"""
    (?P<string>(?P<prefix>[rRbBuUfF]{0,2})
        (?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|'(?:\\.|[^\\'\n])*'|"(?:\\.|[^\\"\n])*"))
    | \#[^\n]*
    | \\\r?\n
    | (?P<open>[(\[{])
    | (?P<close>[)\]}])
    | (?P<end>[\n;])
    | (?P<comma>,)
    | (?P<op>\*\*|//|<<|>>|->|:=|[-+*/%@&|^~<>.]|\b(?:not|and|or|if|lambda|await|in|is)\b)
    """,
    re.VERBOSE | re.DOTALL,
)


def too_deep_or_large(source: str) -> tuple[str, int] | None:
    """Why `source` must not reach the parser (too large, too deeply nested) and the line where
    that shows, or None."""
    large = too_large(source)
    return (large, 1) if large is not None else too_deep(source)


def too_large(source: str) -> str | None:
    """Why `source` is too large to parse, or None."""
    size = len(source.encode("utf-8", "surrogatepass")) if len(source) * 4 > MAX_BYTES else len(source)
    if size > MAX_BYTES:
        return f"file too large to analyse ({size / 1048576:.1f} MiB; the limit is {MAX_BYTES // 1048576} MiB)"
    return None


def too_deep(source: str) -> tuple[str, int] | None:
    """Why `source` is nested too deeply to parse and the line where it first goes too deep, or
    None."""
    brackets, depth = nesting(source)
    if brackets <= MAX_BRACKETS and depth <= MAX_DEPTH:
        return None
    where = first_too_deep(source)
    line = source.count("\n", 0, where) + 1
    if brackets > MAX_BRACKETS:
        return f"too many nested brackets ({brackets} levels; Python itself allows {MAX_BRACKETS}), not analysed", line
    return f"expression nested too deeply to analyse (about {depth} levels; the limit is {MAX_DEPTH})", line


def first_too_deep(source: str) -> int:
    """The offset in `source` where the nesting first goes over a limit (0 if it never does)."""
    return _scan(source, stop=True)[2]


def nesting(source: str) -> tuple[int, int]:
    """The deepest bracket nesting and the estimated depth of the deepest expression."""
    brackets, depth, _ = _scan(source, stop=False)
    return brackets, depth


def _scan(source: str, stop: bool) -> tuple[int, int, int]:
    """The deepest bracket nesting and the estimated deepest expression, in one pass.

    An f-string is not skipped like other strings: the expressions in its braces are code, so its
    brackets count (its text may add spurious ones, which only makes the estimate larger)."""
    stack: list[int] = []  # the chained count of each enclosing bracket level
    chained = 0  # operators and operands chained at the current level since its last comma
    total = 0  # sum of `chained` over the enclosing levels
    max_brackets = max_depth = 0
    for match in _TOKEN.finditer(source):
        kind = match.lastgroup
        if kind is None:
            continue
        if kind == "string" and "f" in match.group("prefix").lower():
            # The braces of an f-string hold code: count every bracket in it as nested.
            inner = _bracket_depth(match.group())
            if len(stack) + inner > max_brackets:
                max_brackets = len(stack) + inner
            if total + len(stack) + inner > max_depth:
                max_depth = total + len(stack) + inner
        if kind == "op" or kind == "string":
            chained += 1
            total += 1
            if total + len(stack) > max_depth:
                max_depth = total + len(stack)
        elif kind == "open":
            # `a[0][0]` chains at this level; what is inside starts a level of its own.
            chained += 1
            total += 1
            stack.append(chained)
            chained = 0
            if len(stack) > max_brackets:
                max_brackets = len(stack)
            if total + len(stack) > max_depth:
                max_depth = total + len(stack)
        elif kind == "close":
            total -= chained
            chained = stack.pop() if stack else 0
        elif kind == "comma":
            total -= chained
            chained = 0
        elif not stack:  # end of a logical line
            total = chained = 0
        if stop and (max_brackets > MAX_BRACKETS or max_depth > MAX_DEPTH):
            return max_brackets, max_depth, match.start()
    return max_brackets, max_depth, 0


def _bracket_depth(text: str) -> int:
    """The deepest nesting of brackets in `text`, counted without regard to strings."""
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif char in ")]}" and depth:
            depth -= 1
    return deepest


# The parser and the analysis recurse once or a few times per level of the syntax tree: they run
# on a thread with a stack large enough for the deepest input `too_deep` accepts, with a recursion
# limit to match, so a deep but valid file is analysed instead of failing.
STACK_BYTES = 256 * 1024 * 1024
RECURSION_LIMIT = 20_000


def run_with_deep_stack(function: Callable[..., T], *args: object) -> T:
    """`function(*args)` on a thread with a large stack; its exception is raised here."""
    outcome: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            outcome.append((True, function(*args)))
        except BaseException as exc:  # handed to the caller, which decides
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="distdoctor-lint", daemon=True)
    with _stack_lock:
        try:
            previous_size = threading.stack_size(STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that will not give the stack
            return function(*args)
        previous_limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(previous_limit, RECURSION_LIMIT))
        try:
            thread.start()
        except RuntimeError:  # no thread (address space limits): the normal stack and limit
            sys.setrecursionlimit(previous_limit)
            return function(*args)
        finally:
            threading.stack_size(previous_size)
    try:
        thread.join()
    finally:
        sys.setrecursionlimit(previous_limit)
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


_stack_lock = threading.Lock()


# The cyclic collector's thresholds during a run. libcst builds hundreds of thousands of live
# nodes per file, and at Python's default (700, 10, 10) the collector kept rescanning them in its
# first two generations. Measured on torch.distributed's sources, serial: 25.4 s of CPU at the
# default, 17.4 s here (with the collector off: 17.9 s), for 44 MB more peak memory. Set for a whole
# run (restoring it after each file made the next allocation pay for that file's young objects),
# and for good in the worker processes, which are ours.
GC_THRESHOLD = (10_000, 100, 100)


@contextmanager
def fewer_collections() -> Iterator[None]:
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
