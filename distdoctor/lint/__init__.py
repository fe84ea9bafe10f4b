"""The lint half of distdoctor: engine, configuration, rule base, findings and output formats.

The package is also the public Python API: `distdoctor.lint(paths, config=None)` lints files and
folders and returns the findings, `list[distdoctor.Finding]`, sorted by path and position. A
module cannot be called, so this one's class is swapped for a callable subclass; importing it
stays cheap (the engine and libcst load on the first call).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from os import PathLike
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distdoctor.lint.config import Config
    from distdoctor.lint.finding import Finding


def lint_paths(paths: str | PathLike[str] | Sequence[str | PathLike[str]], config: Config | None = None) -> list[Finding]:
    """Findings of every file under `paths` (a file, a folder, or a list of them), with `config`
    (default: every rule that is on by default, no cache). A path that does not exist is a
    FileNotFoundError; a bad argument a TypeError."""
    from distdoctor.lint.config import Config
    from distdoctor.lint.engine import lint

    if isinstance(paths, (str, PathLike)):
        paths = [paths]
    if isinstance(paths, (bytes, bytearray)) or not isinstance(paths, Sequence) or not all(
        isinstance(path, (str, PathLike)) for path in paths
    ):
        raise TypeError("distdoctor.lint() takes a path or a list of paths (str or os.PathLike)")
    if config is None:
        config = Config(cache=False)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a distdoctor.lint.config.Config, not {type(config).__name__}")
    result = lint([str(path) for path in paths], config)
    if result.errors:
        raise FileNotFoundError("; ".join(result.errors))
    return list(result.findings)


class _CallableModule(types.ModuleType):
    def __call__(self, paths, config=None):
        return lint_paths(paths, config)


sys.modules[__name__].__class__ = _CallableModule
