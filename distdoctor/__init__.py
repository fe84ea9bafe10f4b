"""distdoctor: find the bugs that make distributed PyTorch training silently wrong, slow or stuck."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"


class _CheckoutCatalogs:
    """`rules/` and `probes/` stand at the top of the repository; installed, setuptools' package-dir
    puts them inside the package as `distdoctor.rules` and `distdoctor.probes`. In a checkout that
    is not installed (`PYTHONPATH=. pytest`), this finder, consulted last, maps them the same way."""

    CATALOGS = ("rules", "probes")

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        package, _, catalog = name.partition(".")
        if package != "distdoctor" or catalog not in self.CATALOGS:
            return None
        folder = self.root / catalog
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "rules" / "__init__.py").is_file():
    sys.meta_path.append(_CheckoutCatalogs(_checkout))


def __getattr__(name: str):
    """`distdoctor.lint` (callable: `distdoctor.lint(paths) -> list[Finding]`) and
    `distdoctor.Finding`, imported when first used so that `import distdoctor` stays cheap."""
    if name == "lint":
        import distdoctor.lint as lint

        return lint
    if name == "Finding":
        from distdoctor.lint.finding import Finding

        return Finding
    raise AttributeError(f"module 'distdoctor' has no attribute {name!r}")


__all__ = ["Finding", "__version__", "lint"]
