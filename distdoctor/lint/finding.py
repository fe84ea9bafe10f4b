"""Findings and fixes: the small frozen records every output format is made from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Edit:
    """Replace the text between two positions (1-based lines and columns, end exclusive)."""

    line: int
    column: int
    end_line: int
    end_column: int
    content: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "location": {"row": self.line, "column": self.column},
            "end_location": {"row": self.end_line, "column": self.end_column},
        }


@dataclass(frozen=True)
class Fix:
    """A set of edits applied together. `safe` fixes run under `--fix`."""

    message: str
    edits: tuple[Edit, ...]
    applicable: Literal["safe", "unsafe"] = "safe"

    def to_dict(self) -> dict[str, Any]:
        return {
            "applicable": self.applicable,
            "message": self.message,
            "edits": [edit.to_dict() for edit in self.edits],
        }


@dataclass(frozen=True)
class Finding:
    """One reported problem at one place."""

    code: str
    name: str
    severity: Severity
    message: str
    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    fix: Fix | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity,
            "message": self.message,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "fix": None if self.fix is None else self.fix.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        fix = data.get("fix")
        return cls(
            code=data["code"],
            name=data["name"],
            severity=data["severity"],
            message=data["message"],
            path=data["path"],
            line=data["line"],
            column=data["column"],
            end_line=data["end_line"],
            end_column=data["end_column"],
            fix=None
            if fix is None
            else Fix(
                message=fix.get("message", ""),
                applicable=fix["applicable"],
                edits=tuple(
                    Edit(
                        e["location"]["row"],
                        e["location"]["column"],
                        e["end_location"]["row"],
                        e["end_location"]["column"],
                        e["content"],
                    )
                    for e in fix["edits"]
                ),
            ),
        )

    @property
    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.path, self.line, self.column, self.code)
