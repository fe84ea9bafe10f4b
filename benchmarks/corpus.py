"""The real-world corpus: which public training files it holds, how each finding was judged.

The corpus is data only. `benchmarks/corpus/*.manifest.jsonl` pins every file by repository,
commit and path; `*.judgments.jsonl` holds one verdict per default-on finding (TP or FP with a
one-line reason); `*.misses.jsonl` lists bugs seen in those files that no rule reports; `*.context.jsonl` pins the
project files the linter reads beside a linted file (dependency lists and READMEs in its folder and
the folders above, where a torch pin is read: see distdoctor/lint/project.py), fetched with the
manifest files and never linted. The code
itself is never committed: `fetch()` materialises it into a local cache laid out as

    <cache>/<owner>+<name>/<commit>/<path>

(the file's text exactly as in git). The cache root is `--cache DIR`, else the environment
variable DISTDOCTOR_CORPUS, else ~/.cache/distdoctor/corpus.

`score(findings, judgments)` compares what the linter says now with what was judged: per rule the
judged true and false positives, the precision, the findings nobody judged yet (new) and the
judgments whose finding is no longer produced (gone). A rule change therefore shows up as new and
gone findings to re-judge, never as an assumed improvement.

Standard library only (no distdoctor import), so this module does not depend on the package layout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, TextIO

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
ENV_CACHE = "DISTDOCTOR_CORPUS"
DEFAULT_CACHE = Path("~/.cache/distdoctor/corpus")
GITHUB = "https://github.com"
RAW = "https://raw.githubusercontent.com"

AREAS = frozenset(
    "vision detection segmentation nlp llm speech diffusion gan rl ssl recsys multimodal video 3d other".split()
)
STACKS = frozenset("ddp horovod fsdp fsdp2 spawn slurm deepspeed accelerate lightning mixed".split())
VERDICTS = frozenset({"TP", "FP"})


class CorpusError(Exception):
    """Corpus data that cannot be used as written (bad JSON, a missing field, a bad value)."""


# A file of the corpus: (repo, commit, path).
FileKey = tuple[str, str, str]
# A finding or a judgment: (repo, commit, path, line, code).
FindingKey = tuple[str, str, str, int, str]


@dataclass(frozen=True)
class Entry:
    """One manifest line: a pinned file of a public repository."""

    repo: str
    commit: str
    path: str
    area: str
    stack: str
    source: str = ""  # manifest file and line it came from, for messages

    @property
    def key(self) -> FileKey:
        return (self.repo, self.commit, self.path)


@dataclass(frozen=True)
class Judgment:
    """One judged finding."""

    repo: str
    commit: str
    path: str
    line: int
    code: str
    verdict: str
    reason: str
    source: str = ""

    @property
    def key(self) -> FindingKey:
        return (self.repo, self.commit, self.path, self.line, self.code)

    @property
    def file(self) -> FileKey:
        return (self.repo, self.commit, self.path)


@dataclass(frozen=True)
class Miss:
    """A bug seen in a corpus file that no rule reports."""

    repo: str
    commit: str
    path: str
    line: int
    what: str
    source: str = ""


@dataclass
class RuleScore:
    findings: int = 0
    tp: int = 0
    fp: int = 0
    new: list[FindingKey] = field(default_factory=list)  # produced now, never judged
    gone: list[Judgment] = field(default_factory=list)  # judged, no longer produced

    @property
    def unjudged(self) -> int:
        return len(self.new)

    @property
    def precision(self) -> float | None:
        judged = self.tp + self.fp
        return self.tp / judged if judged else None


# --------------------------------------------------------------------------------------------
# Loading


def _records(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read: {exc}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def _text(record: Mapping[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value:
        raise CorpusError(f"{where}: field {name!r} must be a non-empty string")
    return value


def _int(record: Mapping[str, Any], name: str, where: str) -> int:
    value = record.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CorpusError(f"{where}: field {name!r} must be a positive integer")
    return value


def _file_fields(record: Mapping[str, Any], where: str) -> tuple[str, str, str]:
    repo = _text(record, "repo", where)
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise CorpusError(f"{where}: repo {repo!r} is not 'owner/name'")
    commit = _text(record, "commit", where)
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise CorpusError(f"{where}: commit {commit!r} is not 40 lowercase hex digits")
    path = _text(record, "path", where)
    if path.startswith("/") or ".." in Path(path).parts:
        raise CorpusError(f"{where}: path {path!r} must be relative to the repository root")
    return repo, commit, path


def _files(directory: Path, suffix: str) -> list[Path]:
    if not directory.is_dir():
        raise CorpusError(f"{directory}: no such corpus folder")
    return sorted(directory.glob(f"*{suffix}"))


def load_manifest(directory: Path = CORPUS_DIR) -> list[Entry]:
    """Every entry of every `*.manifest.jsonl` in `directory`, each pinned file once.

    A file listed twice in one manifest is an error; the same pinned file in two shards' manifests
    is one file of the corpus (shards are written independently and may overlap).
    """
    entries: list[Entry] = []
    seen: dict[FileKey, str] = {}
    for file in _files(directory, ".manifest.jsonl"):
        for where, record in _records(file):
            repo, commit, path = _file_fields(record, where)
            area = _text(record, "area", where)
            if area not in AREAS:
                raise CorpusError(f"{where}: area {area!r} is not one of {', '.join(sorted(AREAS))}")
            stack = _text(record, "stack", where)
            if stack not in STACKS:
                raise CorpusError(f"{where}: stack {stack!r} is not one of {', '.join(sorted(STACKS))}")
            entry = Entry(repo, commit, path, area, stack, where)
            if entry.key in seen:
                if seen[entry.key].split(":")[0] == file.name:
                    raise CorpusError(f"{where}: {repo}@{commit[:10]}:{path} is already listed at {seen[entry.key]}")
                continue  # the same pinned file in two shards: one file of the corpus
            seen[entry.key] = where
            entries.append(entry)
    return entries


def load_context(directory: Path = CORPUS_DIR) -> list[Entry]:
    """Every project file of every `*.context.jsonl`: fetched into the cache, never linted."""
    entries: dict[FileKey, Entry] = {}
    for file in _files(directory, ".context.jsonl"):
        for where, record in _records(file):
            repo, commit, path = _file_fields(record, where)
            entries.setdefault((repo, commit, path), Entry(repo, commit, path, "other", "mixed", where))
    return list(entries.values())


def load_judgments(directory: Path = CORPUS_DIR) -> list[Judgment]:
    """Every judgment of every `*.judgments.jsonl`; the same finding judged twice differently is an error."""
    judgments: dict[FindingKey, Judgment] = {}
    for file in _files(directory, ".judgments.jsonl"):
        for where, record in _records(file):
            repo, commit, path = _file_fields(record, where)
            line = _int(record, "line", where)
            code = _text(record, "code", where)
            verdict = _text(record, "verdict", where)
            if verdict not in VERDICTS:
                raise CorpusError(f"{where}: verdict {verdict!r} must be TP or FP")
            reason = _text(record, "reason", where)
            judgment = Judgment(repo, commit, path, line, code, verdict, reason, where)
            earlier = judgments.get(judgment.key)
            if earlier is not None:
                if earlier.verdict != verdict:
                    raise CorpusError(
                        f"{where}: {code} at {path}:{line} is judged {verdict} here but {earlier.verdict} at {earlier.source}"
                    )
                continue
            judgments[judgment.key] = judgment
    return list(judgments.values())


def load_misses(directory: Path = CORPUS_DIR) -> list[Miss]:
    """Every recorded miss of every `*.misses.jsonl`."""
    misses: list[Miss] = []
    for file in _files(directory, ".misses.jsonl"):
        for where, record in _records(file):
            repo, commit, path = _file_fields(record, where)
            misses.append(Miss(repo, commit, path, _int(record, "line", where), _text(record, "what", where), where))
    return misses


# --------------------------------------------------------------------------------------------
# The cache


def cache_root(option: str | os.PathLike[str] | None = None) -> Path:
    """`option`, else $DISTDOCTOR_CORPUS, else ~/.cache/distdoctor/corpus."""
    chosen = option or os.environ.get(ENV_CACHE) or DEFAULT_CACHE
    return Path(chosen).expanduser()


def cache_path(cache: Path, repo: str, commit: str, path: str) -> Path:
    return cache / repo.replace("/", "+", 1) / commit / path


def locate(cache: Path, file: str | os.PathLike[str]) -> FileKey | None:
    """(repo, commit, path) of a file inside the cache, or None when it lies elsewhere."""
    try:
        parts = Path(os.path.abspath(file)).relative_to(Path(os.path.abspath(cache))).parts
    except ValueError:
        return None
    if len(parts) < 3 or "+" not in parts[0]:
        return None
    return (parts[0].replace("+", "/", 1), parts[1], "/".join(parts[2:]))


def missing(cache: Path, entries: Iterable[Entry]) -> list[Entry]:
    return [e for e in entries if not cache_path(cache, e.repo, e.commit, e.path).is_file()]


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def _raw_url(repo: str, commit: str, path: str) -> str:
    return f"{RAW}/{repo}/{commit}/{urllib.request.quote(path)}"


def _download(repo: str, commit: str, path: str, timeout: float) -> bytes:
    with urllib.request.urlopen(_raw_url(repo, commit, path), timeout=timeout) as response:
        return response.read()


def _fetch_with_git(repo: str, commit: str, paths: list[str], timeout: float) -> dict[str, bytes]:
    """Files of one commit through a blobless clone; raises on the first failure of git itself."""
    got: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="distdoctor-corpus-") as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(
            ["git", "clone", "-q", "--filter=blob:none", "--no-checkout", f"{GITHUB}/{repo}", str(clone)],
            check=True, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
        for path in paths:
            shown = subprocess.run(
                ["git", "-C", str(clone), "show", f"{commit}:{path}"],
                capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
            )
            if shown.returncode == 0:
                got[path] = shown.stdout
    return got


def fetch(
    cache: Path,
    entries: Iterable[Entry],
    *,
    out: TextIO = sys.stderr,
    timeout: float = 120.0,
    use_git: bool | None = None,
) -> tuple[int, int]:
    """Materialise the entries missing from `cache`; returns (files fetched, files still missing).

    Per repository: a blobless `git clone` (when git is installed) and `git show COMMIT:PATH`,
    else (or for what git could not give) the raw file from raw.githubusercontent.com. A
    repository that cannot be reached is reported on `out` and skipped; the others go on.
    """
    todo: dict[tuple[str, str], list[str]] = defaultdict(list)
    for entry in missing(cache, entries):
        todo[(entry.repo, entry.commit)].append(entry.path)
    if use_git is None:
        use_git = shutil.which("git") is not None
    fetched = failed = 0
    for (repo, commit), paths in sorted(todo.items()):
        got: dict[str, bytes] = {}
        problem = ""
        if use_git:
            try:
                got = _fetch_with_git(repo, commit, paths, timeout)
            except subprocess.CalledProcessError as exc:
                said = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
                problem = f"git clone failed: {said[-1] if said else exc}"
            except (subprocess.TimeoutExpired, OSError) as exc:
                problem = f"git clone failed: {exc}"
        for path in paths:
            if path in got:
                continue
            try:
                got[path] = _download(repo, commit, path, timeout)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                problem = f"{problem}; " if problem else ""
                problem += f"download of {path} failed: {getattr(exc, 'reason', exc)}"
                if not isinstance(exc, urllib.error.HTTPError):
                    break  # the network itself is down: do not try every file of the repo
        for path, data in got.items():
            _write(cache_path(cache, repo, commit, path), data)
        fetched += len(got)
        lost = len(paths) - len(got)
        failed += lost
        if lost:
            print(f"corpus: {repo}@{commit[:10]}: {lost} of {len(paths)} files not fetched ({problem})", file=out)
    return fetched, failed


# --------------------------------------------------------------------------------------------
# Scoring


def finding_key(finding: Mapping[str, Any] | tuple) -> FindingKey:
    if isinstance(finding, Mapping):
        return (finding["repo"], finding["commit"], finding["path"], int(finding["line"]), finding["code"])
    repo, commit, path, line, code = finding
    return (repo, commit, path, int(line), code)


def score(
    findings: Iterable[Mapping[str, Any] | tuple],
    judgments: Iterable[Judgment],
    files: Iterable[FileKey] | None = None,
) -> dict[str, RuleScore]:
    """Per rule code: findings now, judged TP/FP among them, new (unjudged) findings, gone judgments.

    A finding is matched to a judgment by (repo, commit, path, line, code); several findings of
    one rule on one line count once. `files` limits the judgments considered to the files that
    were linted (a file absent from the cache is neither new nor gone); None considers them all.
    The key "ALL" holds the totals.
    """
    linted = None if files is None else set(files)
    judged = {j.key: j for j in judgments if linted is None or j.file in linted}
    scores: dict[str, RuleScore] = defaultdict(RuleScore)
    produced: set[FindingKey] = set()
    for finding in findings:
        key = finding_key(finding)
        if key in produced:
            continue
        produced.add(key)
        rule = scores[key[4]]
        rule.findings += 1
        judgment = judged.get(key)
        if judgment is None:
            rule.new.append(key)
        elif judgment.verdict == "TP":
            rule.tp += 1
        else:
            rule.fp += 1
    for key, judgment in judged.items():
        if key not in produced:
            scores[judgment.code].gone.append(judgment)
    total = RuleScore()
    for rule in scores.values():
        total.findings += rule.findings
        total.tp += rule.tp
        total.fp += rule.fp
        total.new.extend(rule.new)
        total.gone.extend(rule.gone)
    result = {code: scores[code] for code in sorted(scores)}
    for rule in result.values():
        rule.new.sort()
        rule.gone.sort(key=lambda j: j.key)
    total.new.sort()
    total.gone.sort(key=lambda j: j.key)
    result["ALL"] = total
    return result
