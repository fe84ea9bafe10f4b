"""`[tool.distdoctor]` in pyproject.toml, merged with the command line, and rule selection."""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from distdoctor.lint.catalog import RuleInfo, catalog
from distdoctor.lint.project import ProjectFacts, TorchTarget, parse_version, project_facts

if TYPE_CHECKING:
    from distdoctor.lint.rule import Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KNOWN_KEYS = frozenset(
    {"select", "ignore", "extend-select", "exclude", "extend-exclude", "per-file-ignores", "cache", "target-torch"}
)


class ConfigError(Exception):
    """A configuration or selection the user must correct (exit status 2)."""


@dataclass(frozen=True)
class Config:
    """What to lint and how. `None` for select means the rules that are on by default."""

    select: tuple[str, ...] | None = None
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    extend_exclude: tuple[str, ...] = ()
    per_file_ignores: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    root: Path = field(default_factory=Path.cwd)  # folder of the pyproject.toml, or the cwd
    source: Path | None = None  # the pyproject.toml it came from
    cache: bool = True
    target_torch: TorchTarget | None = None  # `target-torch`; else read from the project's pins

    def project_for(self, path: str | os.PathLike[str], source: str | None = None) -> ProjectFacts:
        """What `path`'s project says outside the file (`source`, its text, names the project
        modules it imports); the PyTorch release is `target-torch` when that is set, else the
        project's pin."""
        return project_facts(path, self.target_torch, source)

    def merged(self, **cli: object) -> Config:
        """The command line beats the file: given options replace the file's."""
        changes = {key: value for key, value in cli.items() if value is not None}
        return replace(self, **changes)

    # --- selection -----------------------------------------------------------------------------
    def selected_codes(self) -> tuple[str, ...]:
        """The codes of the selected rules, in code order; resolved on the catalog, so that nothing
        imports the rules (nor libcst) before a file needs them. Raises `ConfigError` for a selector
        that names no rule."""
        rules = catalog()
        for code in (*(self.select or ()), *self.extend_select, *self.ignore, *self._per_file_codes()):
            _check_selector(code, rules)
        if self.select is None:
            chosen = {rule.code for rule in rules if rule.default_on}
        else:
            chosen = {rule.code for rule in rules if _selects(self.select, rule)}
        chosen |= {rule.code for rule in rules if _selects(self.extend_select, rule)}
        chosen -= {rule.code for rule in rules if _matches(self.ignore, rule.code)}
        return tuple(rule.code for rule in rules if rule.code in chosen)

    def selected_rules(self) -> tuple[Rule, ...]:
        """The selected rules themselves (imports them)."""
        from distdoctor.lint.rule import rules_with_codes

        return tuple(rules_with_codes(self.selected_codes()))

    def _per_file_codes(self) -> Iterable[str]:
        for codes in self.per_file_ignores.values():
            yield from codes

    def ignored_for(self, path: str) -> tuple[str, ...]:
        """Codes that `per-file-ignores` switches off for `path`."""
        if not self.per_file_ignores:
            return ()  # no path to resolve (a system call per folder of the path)
        rel = _relative(path, self.root)
        codes: list[str] = []
        for pattern, ignored in self.per_file_ignores.items():
            if _glob_match(rel, pattern):
                codes.extend(ignored)
        return tuple(codes)

    def is_excluded(self, path: Path) -> bool:
        if not (self.exclude or self.extend_exclude):
            return False
        rel = _relative(str(path), self.root)
        return any(_glob_match(rel, pattern) for pattern in (*self.exclude, *self.extend_exclude))


def _relative(path: str, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def _glob_match(rel: str, pattern: str) -> bool:
    pattern = pattern.rstrip("/")
    pure = PurePosixPath(rel)
    if fnmatch.fnmatch(rel, pattern) or pure.match(pattern):
        return True
    # a pattern naming a folder excludes what is inside it; a bare name matches at any depth
    parts = pure.parts
    return any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))) or (
        "/" not in pattern and any(fnmatch.fnmatch(part, pattern) for part in parts)
    )


def _matches(selectors: Sequence[str], code: str) -> bool:
    return any(sel == "ALL" or code.startswith(sel) for sel in selectors)


def _selects(selectors: Sequence[str], rule: RuleInfo) -> bool:
    """Default-off rules run only when named by their full code (or `ALL`): selecting the
    family `DD4` must not switch on a house-style rule such as DD405."""
    if rule.default_on:
        return _matches(selectors, rule.code)
    return any(sel in ("ALL", rule.code) for sel in selectors)


def _check_selector(selector: str, rules: Sequence[RuleInfo]) -> None:
    if selector == "ALL":
        return
    if not selector.startswith("DD") or not any(rule.code.startswith(selector) for rule in rules):
        raise ConfigError(
            f"unknown rule code or prefix {selector!r} (see `distdoctor rules` for the codes)"
        )


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml with a [tool.distdoctor] table, upward from `start`."""
    start = start.resolve()
    folder = start if start.is_dir() else start.parent
    for candidate in (folder, *folder.parents):
        path = candidate / "pyproject.toml"
        if path.is_file():
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: cannot read: {exc}") from exc
            if "distdoctor" in data.get("tool", {}):
                return path
    return None


def load_config(start: Path, explicit: Path | None = None) -> Config:
    """The configuration for files under `start` (or from `explicit`), defaults when none."""
    path = explicit or find_pyproject(start)
    if path is None:
        return Config()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    table = data.get("tool", {}).get("distdoctor", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.distdoctor] must be a table")
    unknown = sorted(set(table) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) in [tool.distdoctor]: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(KNOWN_KEYS))})"
        )

    def codes(key: str) -> tuple[str, ...] | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: `{key}` must be a list of strings")
        return tuple(value)

    per_file = table.get("per-file-ignores", {})
    if not isinstance(per_file, dict) or not all(
        isinstance(v, list) and all(isinstance(c, str) for c in v) for v in per_file.values()
    ):
        raise ConfigError(f"{path}: `per-file-ignores` must map glob patterns to lists of codes")
    cache = table.get("cache", True)
    if not isinstance(cache, bool):
        raise ConfigError(f"{path}: `cache` must be true or false")
    target = table.get("target-torch")
    target_torch = None
    if target is not None:
        target_torch = parse_version(target, "[tool.distdoctor] target-torch") if isinstance(target, str) else None
        if target_torch is None:
            raise ConfigError(f'{path}: `target-torch` must be a version such as "1.13" or "2.4"')
    return Config(
        select=codes("select"),
        extend_select=codes("extend-select") or (),
        ignore=codes("ignore") or (),
        exclude=codes("exclude") or (),
        extend_exclude=codes("extend-exclude") or (),
        per_file_ignores={k: tuple(v) for k, v in per_file.items()},
        root=path.parent,
        source=path,
        cache=cache,
        target_torch=target_torch,
    )
