"""The lint engine: find files, parse each once, run the selected rules, suppress, fix.

Public API: `lint(paths, config) -> LintResult`, `lint_source(source, path, rules)`, and
`fix_source(source, path, rules)`. The CLI is a thin layer over these.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import libcst as cst

from distdoctor import __version__
from distdoctor.lint.analysis import syntax
from distdoctor.lint.config import Config
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.finding import Finding
from distdoctor.lint.rule import Rule, all_rules

# A file that says none of these words cannot trigger any rule: answer it without parsing.
PREFILTER = re.compile(
    r"distributed|Distributed|DDP|horovod|hvd|init_process_group|SyncBatchNorm|RANK|get_rank|local_rank"
)
SKIPPED_DIRS = frozenset(
    {
        ".git", ".hg", ".svn", ".venv", "venv", ".env", "__pycache__", "build", "dist",
        "node_modules", ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache",
        "site-packages", ".eggs", ".distdoctor_cache", ".ipynb_checkpoints",
    }
)
NOQA = re.compile(
    r"#\s*(?:noqa(?P<noqa>\s*:\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?"
    r"|distdoctor\s*:\s*ignore\[(?P<dd>[^\]]*)\])",
    re.IGNORECASE,
)
SYNTAX_ERROR = ("DD000", "syntax-error")
PARALLEL_THRESHOLD = 16
MAX_FIX_PASSES = 5


@dataclass(frozen=True)
class UnusedNoqa:
    path: str
    line: int
    codes: tuple[str, ...]  # empty for a bare `# noqa`


@dataclass(frozen=True)
class FileResult:
    path: str
    findings: tuple[Finding, ...]
    unused_noqa: tuple[UnusedNoqa, ...] = ()


@dataclass(frozen=True)
class LintResult:
    """All findings of a run, sorted, with how many files were looked at."""

    findings: tuple[Finding, ...]
    files: int
    unused_noqa: tuple[UnusedNoqa, ...] = ()
    errors: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------------
# One source text


def lint_source(source: str, path: str, rules: Sequence[Rule]) -> FileResult:
    """Findings of `rules` in `source`, after `# noqa` suppression."""
    if not PREFILTER.search(source):
        return FileResult(path, ())
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        return FileResult(path, (_syntax_finding(path, exc),))
    except (RecursionError, ValueError) as exc:  # pathological input
        return FileResult(path, (_syntax_finding(path, exc),))
    try:
        return _lint_module(path, source, module, rules)
    finally:
        syntax.forget_calls()


def _lint_module(path: str, source: str, module: cst.Module, rules: Sequence[Rule]) -> FileResult:
    ctx = LintContext(path, source, module)
    raw: list[Finding] = []
    seen: set[tuple[str, int, int]] = set()
    for rule in rules:
        for report in rule.check(ctx):
            pos = ctx.position(report.node)
            key = (rule.code, pos.start.line, pos.start.column)
            if key in seen:
                continue
            seen.add(key)
            raw.append(
                Finding(
                    code=rule.code,
                    name=rule.name,
                    severity=rule.severity,
                    message=report.message,
                    path=path,
                    line=pos.start.line,
                    column=pos.start.column + 1,
                    end_line=pos.end.line,
                    end_column=pos.end.column + 1,
                    fix=report.fix,
                )
            )
    kept, unused = _suppress(raw, source, path)
    return FileResult(path, tuple(sorted(kept, key=lambda f: f.sort_key)), unused)


def _syntax_finding(path: str, exc: Exception) -> Finding:
    line = getattr(exc, "raw_line", None) or getattr(exc, "lineno", None) or 1
    column = (getattr(exc, "raw_column", None) or 0) + 1
    message = getattr(exc, "message", None) or str(exc).splitlines()[0]
    return _dd000(path, f"cannot parse this file: {message}", line, column)


def _unreadable_finding(path: str, exc: Exception) -> Finding:
    reason = f"not UTF-8 text ({exc.reason} at byte {exc.start})" if isinstance(exc, UnicodeDecodeError) else str(exc)
    return _dd000(path, f"cannot read this file: {reason}", 1, 1)


def _dd000(path: str, message: str, line: int, column: int) -> Finding:
    code, name = SYNTAX_ERROR
    return Finding(code, name, "error", message, path, line, column, line, column)


def _noqa_by_line(source: str) -> dict[int, tuple[str, ...] | None]:
    """Suppression comments per line: None for a bare `# noqa` (everything)."""
    found: dict[int, tuple[str, ...] | None] = {}
    if "noqa" not in source and "distdoctor" not in source:
        return found
    for number, line in enumerate(source.splitlines(), start=1):
        if "#" not in line:
            continue
        for match in NOQA.finditer(line):
            if match.group("dd") is not None:
                codes = tuple(c.strip().upper() for c in match.group("dd").split(",") if c.strip())
            elif match.group("codes"):
                codes = tuple(c.upper() for c in re.split(r"[\s,]+", match.group("codes")) if c)
            else:
                found[number] = None
                continue
            previous = found.get(number, ())
            if previous is not None:
                found[number] = previous + codes
    return found


def _suppress(findings: list[Finding], source: str, path: str) -> tuple[list[Finding], tuple[UnusedNoqa, ...]]:
    comments = _noqa_by_line(source)
    if not comments:
        return findings, ()
    used: dict[int, set[str]] = {}
    kept = []
    for finding in findings:
        suppressed = False
        for line in {finding.line, finding.end_line}:
            if line in comments:
                codes = comments[line]
                if codes is None or finding.code in codes:
                    used.setdefault(line, set()).add(finding.code if codes is not None else "*")
                    suppressed = True
        if not suppressed:
            kept.append(finding)
    unused = []
    for line, codes in comments.items():
        if codes is None:
            if line not in used:
                unused.append(UnusedNoqa(path, line, ()))
        else:
            dd_codes = tuple(c for c in codes if c.startswith("DD"))
            missing = tuple(c for c in dd_codes if c not in used.get(line, set()))
            if missing:
                unused.append(UnusedNoqa(path, line, missing))
    return kept, tuple(unused)


# --------------------------------------------------------------------------------------------
# Fixes


def apply_edits(source: str, findings: Iterable[Finding]) -> tuple[str, int]:
    """Apply the safe fixes that do not overlap one another; the number applied."""
    starts = _line_starts(source)

    def offset(line: int, column: int) -> int:
        if line - 1 >= len(starts):
            return len(source)
        return starts[line - 1] + column - 1

    chosen: list[tuple[int, int, list[tuple[int, int, str]]]] = []
    for finding in findings:
        if finding.fix is None or finding.fix.applicable != "safe":
            continue
        spans = sorted(
            (offset(e.line, e.column), offset(e.end_line, e.end_column), e.content) for e in finding.fix.edits
        )
        low, high = spans[0][0], max(end for _, end, _ in spans)
        if any(not (high <= c_low or low >= c_high) for c_low, c_high, _ in chosen):
            continue
        chosen.append((low, high, spans))
    edits = sorted((span for _, _, spans in chosen for span in spans), reverse=True)
    out = source
    for start, end, content in edits:
        out = out[:start] + content + out[end:]
    return out, len(chosen)


def _line_starts(source: str) -> list[int]:
    starts = [0]
    for index, char in enumerate(source):
        if char == "\n":
            starts.append(index + 1)
    return starts


def fix_source(source: str, path: str, rules: Sequence[Rule]) -> tuple[str, int]:
    """Apply safe fixes until none is left (bounded); never returns text that does not parse."""
    total = 0
    current = source
    for _ in range(MAX_FIX_PASSES):
        result = lint_source(current, path, rules)
        candidate, applied = apply_edits(current, result.findings)
        if applied == 0 or candidate == current:
            break
        try:
            cst.parse_module(candidate)
        except Exception:  # a fix that breaks the file is dropped, the file kept as it was
            break
        current, total = candidate, total + applied
    return current, total


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename, keeping its permissions."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".distdoctor", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# Files


def read_source(path: Path) -> str:
    """The Python text of a file; for a notebook, its code cells joined (magics commented out)."""
    raw = path.read_bytes()
    text = raw.decode("utf-8-sig")
    if path.suffix == ".ipynb":
        return notebook_source(text)
    return text


def notebook_source(text: str) -> str:
    data = json.loads(text)
    lines: list[str] = []
    for cell in data.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        body = cell.get("source", [])
        body = "".join(body) if isinstance(body, list) else str(body)
        for line in body.splitlines():
            lines.append("# " + line if line.lstrip().startswith(("%", "!")) else line)
        lines.append("")
    return "\n".join(lines) + "\n"


def discover(paths: Sequence[str], config: Config) -> tuple[list[Path], list[str]]:
    """The files to lint, in a stable order, and the errors for paths that do not exist."""
    files: list[Path] = []
    errors: list[str] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            errors.append(f"{given}: no such file or directory")
        elif path.is_file():
            files.append(path)  # named explicitly: always linted
        else:
            files.extend(_walk(path, config))
    unique = list(dict.fromkeys(files))
    return unique, errors


def _walk(folder: Path, config: Config) -> Iterator[Path]:
    ignored = _git_ignored(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and not config.is_excluded(here / d)
            and (here / d).resolve() not in ignored
        )
        for name in sorted(filenames):
            if not name.endswith((".py", ".ipynb")):
                continue
            path = here / name
            if config.is_excluded(path) or path.resolve() in ignored:
                continue
            yield path


def _git_ignored(folder: Path) -> set[Path]:
    """Paths under `folder` that .gitignore excludes (empty when not in a git work tree)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"],
            capture_output=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {(folder / entry.decode()).resolve() for entry in out.split(b"\0") if entry}


# --------------------------------------------------------------------------------------------
# Many files: cache and parallelism


def _cache_key(source: str, rules: Sequence[Rule]) -> str:
    digest = hashlib.sha256()
    digest.update(__version__.encode())
    digest.update(",".join(rule.code for rule in rules).encode())
    digest.update(b"\0")
    digest.update(source.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


class _Cache:
    """Findings by content hash, so an unchanged file is never parsed twice."""

    def __init__(self, root: Path | None) -> None:
        self.folder = None if root is None else root / ".distdoctor_cache" / __version__

    def get(self, key: str, path: str) -> FileResult | None:
        if self.folder is None:
            return None
        try:
            data = json.loads((self.folder / key[:2] / key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        findings = tuple(Finding.from_dict({**f, "path": path}) for f in data["findings"])
        unused = tuple(UnusedNoqa(path, u["line"], tuple(u["codes"])) for u in data["unused"])
        return FileResult(path, findings, unused)

    def put(self, key: str, result: FileResult) -> None:
        if self.folder is None:
            return
        try:
            target = self.folder / key[:2]
            target.mkdir(parents=True, exist_ok=True)
            gitignore = self.folder.parent / ".gitignore"
            if not gitignore.exists():
                gitignore.write_text("*\n", encoding="utf-8")
            payload = {
                "findings": [f.to_dict() for f in result.findings],
                "unused": [{"line": u.line, "codes": list(u.codes)} for u in result.unused_noqa],
            }
            fd, tmp = tempfile.mkstemp(dir=target)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(payload, handle)
            os.replace(tmp, target / key)
        except OSError:
            pass  # a read-only tree still lints, only slower


def _lint_job(job: tuple[str, str, tuple[str, ...]]) -> FileResult:
    path, source, codes = job
    rules = [rule for rule in all_rules() if rule.code in codes]
    return lint_source(source, path, rules)


def lint(paths: Sequence[str], config: Config | None = None, *, jobs: int | None = None) -> LintResult:
    """Lint files and folders with `config`; the Python entry point behind `distdoctor lint`."""
    config = config or Config()
    rules = config.selected_rules()
    files, errors = discover(paths, config)
    cache = _Cache(config.root if config.cache else None)
    results: list[FileResult] = []
    pending: list[tuple[str, str, str]] = []
    for file in files:
        shown = str(file)
        try:
            source = read_source(file)
        except PermissionError as exc:
            errors.append(f"{shown}: cannot read: {exc}")
            continue
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            # Not UTF-8 text, or a notebook that is not JSON: like a syntax error, a finding.
            results.append(FileResult(shown, (_unreadable_finding(shown, exc),)))
            continue
        key = _cache_key(source, rules)
        cached = cache.get(key, shown)
        if cached is not None:
            results.append(cached)
        else:
            pending.append((shown, source, key))

    codes = tuple(rule.code for rule in rules)
    workers = jobs if jobs is not None else min(os.cpu_count() or 1, 8)
    needs_parse = [job for job in pending if PREFILTER.search(job[1])]
    if workers > 1 and len(needs_parse) >= PARALLEL_THRESHOLD:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            fresh = list(pool.map(_lint_job, [(p, s, codes) for p, s, _ in pending], chunksize=8))
    else:
        fresh = [lint_source(source, shown, rules) for shown, source, _ in pending]
    for (_, _, key), result in zip(pending, fresh):
        cache.put(key, result)
        results.append(result)

    findings: list[Finding] = []
    unused: list[UnusedNoqa] = []
    # DD000 comes from the engine, not a rule: a file that cannot be read is always reported,
    # unless DD000 is ignored explicitly (selecting other rules does not hide it).
    selected = set(codes) | ({SYNTAX_ERROR[0]} if not any(SYNTAX_ERROR[0].startswith(c) for c in config.ignore if c != "ALL") else set())
    for result in results:
        ignored = config.ignored_for(result.path)
        notebook = result.path.endswith(".ipynb")
        for f in result.findings:
            if f.code not in selected or any(f.code.startswith(code) for code in ignored):
                continue
            # A notebook is never rewritten, so its findings do not advertise a fix.
            findings.append(replace(f, fix=None) if notebook and f.fix is not None else f)
        unused.extend(result.unused_noqa)
    findings.sort(key=lambda f: f.sort_key)
    return LintResult(tuple(findings), len(files), tuple(unused), tuple(errors))

