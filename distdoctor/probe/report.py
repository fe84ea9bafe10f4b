"""The result model shared by the built-in and the script probes (see spec/probe.md, "Output").

Everything here is plain data: it is built inside the launcher process from what the ranks
reported, and it never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "warn", "skip", "error"]


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict with its evidence, per rank and overall."""

    id: str
    status: Status
    summary: str
    ranks: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "error")


@dataclass(frozen=True)
class Report:
    """The whole probe's verdict: the JSON object of spec/probe.md."""

    mode: Literal["builtin", "script"]
    backend: str
    world_size: int
    duration_s: float
    checks: tuple[CheckResult, ...]
    version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(check.failed for check in self.checks)

    @property
    def verified(self) -> bool:
        """Whether any check found something to compare: a run where every check is skipped
        verified nothing, which is not the same as OK."""
        return any(check.status != "skip" for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        from distdoctor import __version__

        out: dict[str, Any] = {
            "tool": "distdoctor",
            "version": self.version or __version__,
            "mode": self.mode,
            "backend": self.backend,
            "world_size": self.world_size,
            "duration_s": round(self.duration_s, 3),
            "ok": self.ok,
            "checks": [asdict(check) for check in self.checks],
        }
        out.update(self.extra)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)
