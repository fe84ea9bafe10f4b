"""One interface for every runtime check, built-in or script, torch or Horovod.

A check is one module of the catalog (`probes/builtin/`, `probes/horovod/`, `probes/script/`,
installed as `distdoctor.probes.*`) that ends with `CHECK = Check(...)`: its id, a one-line title,
the probe it belongs to and the frameworks it judges, what it needs from the ranks, a pure
`verdict` over what the ranks recorded, and the planted fault(s) that prove it can fail. Adding a
check is adding one such module (plus its fixture); nothing else lists the checks.

What a verdict receives:
- built-in probe: an `Evidence` (each rank's evidence for this check, the world size, the
  framework). The rank side is `Check.run(ctx)` under torchrun; under horovodrun one training in
  `distdoctor.probe.builtin.horovod_worker` records the evidence of every Horovod check;
- script probe: the `RunTrace` of the ranks' records (`distdoctor.probe.script.records`), which
  carries the framework and the launcher's facts too.

No torch here: the launcher side and the CLI import this module.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from distdoctor.probe.report import CheckResult

PROBES = ("builtin", "script")
FRAMEWORKS = ("torch", "horovod")
CATALOG = "distdoctor.probes"
_ID = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


class CatalogError(ValueError):
    """An unknown check id or planted fault (a usage error: exit status 2 in the CLI)."""


@dataclass(frozen=True)
class Evidence:
    """What the ranks of a built-in probe recorded for one check: rank -> that check's evidence."""

    ranks: Mapping[int, Mapping[str, Any]]
    world_size: int
    framework: str = "torch"


@dataclass(frozen=True)
class Check:
    """One runtime check, as the catalog declares it.

    `needs`: for a built-in check, the keys every rank's evidence must hold (checked before the
    verdict runs, so a rank that recorded less gets an `error`, not a crash); for a script check,
    the record kinds it reads (`distdoctor.probe.script.protocol`).
    `faults`: planted fault names for a built-in check (`--inject`), fixture paths (from the
    repository root) for a script check; each must make the check fail.
    `order`: position in the report; built-in checks that can kill or stall a rank come last.
    `run`: the rank side under torchrun (built-in torch checks only), `run(ctx) -> evidence`.
    """

    id: str
    title: str
    probe: str
    frameworks: tuple[str, ...]
    needs: tuple[str, ...]
    verdict: Callable[[Any], CheckResult]
    faults: tuple[str, ...]
    order: int
    run: Callable[[Any], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        problems = []
        if not _ID.match(self.id):
            problems.append(f"malformed id {self.id!r}")
        if not self.title or "\n" in self.title:
            problems.append("the title must be one line")
        if self.probe not in PROBES:
            problems.append(f"probe {self.probe!r} is not one of {', '.join(PROBES)}")
        if not self.frameworks or set(self.frameworks) - set(FRAMEWORKS):
            problems.append(f"frameworks {self.frameworks!r} are not among {', '.join(FRAMEWORKS)}")
        if not self.faults:
            problems.append("no planted fault shows that it can fail")
        if self.probe == "builtin" and "torch" in self.frameworks and self.run is None:
            problems.append("a built-in torch check needs its rank side, run(ctx)")
        if problems:
            raise TypeError(f"check {self.id}: {'; '.join(problems)}")

    def judge(self, records: Any) -> CheckResult:
        """The verdict on `records` (an `Evidence` or a `RunTrace`); never raises.

        Evidence in an unexpected shape (a rank from another distdoctor version, a rank that
        recorded less) and a bug in the verdict become an `error` result: one check must not hide
        the others' verdicts.
        """
        if isinstance(records, Evidence):
            lacking = {rank: [key for key in self.needs if key not in (ev or {})] for rank, ev in records.ranks.items()}
            lacking = {rank: keys for rank, keys in lacking.items() if keys}
            if lacking:
                rank = min(lacking)
                return CheckResult(self.id, "error", f"rank {rank} recorded no {', '.join(lacking[rank])}",
                                   {str(r): dict(ev or {}) for r, ev in records.ranks.items()}, {})
        try:
            return self.verdict(records)
        except Exception as exc:  # noqa: BLE001 - reported as the check's own error
            return CheckResult(self.id, "error", f"could not judge the evidence: {type(exc).__name__}: {exc}")


@cache
def all_checks() -> tuple[Check, ...]:
    """Every check of the catalog, by probe then report order. (probe, framework, id) is unique."""
    package = importlib.import_module(CATALOG)
    found: list[Check] = []
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{CATALOG}."):
        if info.ispkg:
            continue
        check = getattr(importlib.import_module(info.name), "CHECK", None)
        if not isinstance(check, Check):
            raise RuntimeError(f"{info.name} declares no CHECK = Check(...)")
        found.append(check)
    seen: dict[tuple[str, str, str], str] = {}
    for check in found:
        for framework in check.frameworks:
            key = (check.probe, framework, check.id)
            if key in seen:
                raise RuntimeError(f"two {check.probe} checks {check.id} for {framework}")
            seen[key] = check.id
    return tuple(sorted(found, key=lambda c: (PROBES.index(c.probe), c.order, c.id)))


def checks_of(probe: str, framework: str) -> tuple[Check, ...]:
    """The checks a probe runs under a framework, in report order."""
    if probe not in PROBES or framework not in FRAMEWORKS:
        raise CatalogError(f"no {probe} probe for {framework}: probes {', '.join(PROBES)}, "
                           f"frameworks {', '.join(FRAMEWORKS)}")
    return tuple(c for c in all_checks() if c.probe == probe and framework in c.frameworks)


def describe(probe: str, framework: str) -> str:
    """'the built-in probe', 'the Horovod script probe', for messages."""
    return f"the {'Horovod ' if framework == 'horovod' else ''}{'built-in' if probe == 'builtin' else 'script'} probe"


def select_checks(probe: str, framework: str, names: Iterable[str] | None = None) -> tuple[Check, ...]:
    """The checks `names` asks for (all when empty), in report order.

    The one validation of check ids (`--checks`, and the Python API): an unknown id raises
    `CatalogError` naming the ids this probe knows.
    """
    available = checks_of(probe, framework)
    wanted = [name for name in (names or ()) if name]
    if not wanted:
        return available
    known = {c.id for c in available}
    unknown = [name for name in dict.fromkeys(wanted) if name not in known]
    if unknown:
        elsewhere = sorted({f"{c.id} ({describe(c.probe, f)})" for c in all_checks() for f in c.frameworks
                            if c.id in unknown})
        hint = f"; other probes have {', '.join(elsewhere)}" if elsewhere else ""
        raise CatalogError(f"unknown check(s) {', '.join(unknown)} for {describe(probe, framework)}; its checks: "
                           f"{', '.join(c.id for c in available)}{hint}")
    return tuple(c for c in available if c.id in wanted)


def select_faults(known: Mapping[str, str], names: Sequence[str], probe: str, framework: str) -> tuple[str, ...]:
    """`names` when each is a fault the probe can plant (`known`: name -> what it does), else `CatalogError`."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise CatalogError(f"unknown fault(s) {', '.join(unknown)} for {describe(probe, framework)}; "
                           f"known: {', '.join(known)}")
    return tuple(names)
