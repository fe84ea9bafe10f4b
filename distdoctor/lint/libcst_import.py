"""Import libcst with its dataclass methods compiled once per interpreter, not at every start.

libcst's nodes are about 200 frozen dataclasses. At import, `dataclasses` writes the source text
of each class's `__init__`, `__eq__`, `__hash__`, ... and compiles it with `exec`: about 1,000
compilations, 60 ms of the 140 ms the import takes, paid again by every `distdoctor lint` (every
pre-commit run). The code compiled from a text depends on nothing but that text and the
interpreter, so it is kept in the lint cache folder, keyed by the text, and handed to `exec` in
place of the text while libcst is imported. The classes are still built by `dataclasses` itself,
from the same texts: only the compilation is skipped.

How: `dataclasses` calls `exec` by its global name, so a module global `exec` in `dataclasses`
shadows the builtin for exactly as long as libcst's import runs. A thread defining a dataclass in
that window goes through the same lookup, with the same result. A missing, stale or damaged file
only costs the compilations; a folder that cannot be written is not an error.
"""

from __future__ import annotations

import marshal
import os
import sys
import tempfile
import types
from importlib.util import MAGIC_NUMBER
from pathlib import Path

# Code objects are only valid for the interpreter (and bytecode revision) that compiled them.
CODE_FILE = f"dataclass-code-{sys.implementation.cache_tag}-{MAGIC_NUMBER.hex()}.marshal"


def import_libcst(cache_folder: Path | None) -> None:
    """Import libcst, through the compiled-code cache in `cache_folder` when there is one."""
    if "libcst" in sys.modules or cache_folder is None:
        import libcst
        return
    import dataclasses

    if "exec" in vars(dataclasses):  # not the module this shortcut was written for
        import libcst
        return
    path = cache_folder / CODE_FILE
    known = _read(path)
    used: dict[str, types.CodeType] = {}

    def exec_compiled(source, globals=None, locals=None, /):
        if isinstance(source, str):
            code = known.get(source)
            if code is None:
                code = compile(source, "<string>", "exec", dont_inherit=True)
            used[source] = code
            return exec(code, globals, locals)
        return exec(source, globals, locals)

    dataclasses.exec = exec_compiled  # type: ignore[attr-defined]
    try:
        import libcst
    finally:
        del dataclasses.exec  # type: ignore[attr-defined]
    if used.keys() != known.keys():  # new texts (a new libcst), or texts no longer used
        _write(path, used)


def _read(path: Path) -> dict[str, types.CodeType]:
    try:
        with open(path, "rb") as handle:
            data = marshal.load(handle)
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {text: code for text, code in data.items() if isinstance(text, str) and isinstance(code, types.CodeType)}


def _write(path: Path, codes: dict[str, types.CodeType]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                marshal.dump(codes, handle)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a read-only tree still lints; the next start compiles again
