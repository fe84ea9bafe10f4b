"""Which framework a user's script trains with, read from its imports (no torch, nothing run)."""

from __future__ import annotations

import ast
from pathlib import Path


def script_framework(path: str) -> str:
    """"horovod" when the script imports Horovod (`import horovod.torch as hvd`, `from horovod...`),
    else "torch": what `distdoctor probe SCRIPT` uses when `--framework` is not given."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return "torch"
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(name == "horovod" or name.startswith("horovod.") for name in names):
            return "horovod"
    return "torch"
