"""The real-world check: lint folders of real training scripts with every rule and show what fires.

    python benchmarks/realworld.py /tmp/corpus/pytorch+examples /tmp/corpus/horovod+horovod
    python benchmarks/realworld.py --json /tmp/corpus > findings.json

Every `*.py` under the given folders (or the given files) is linted with ALL rules, default-off
ones included (marked `off` in the table), without cache and without configuration, so the result
depends on the rules alone. The output lists the count per rule, then every finding per file
(code, path:line, message), then the number of files and files per second. Folders named like
`<owner>+<repo>` (the layout of a corpus fetched for this check) are summarised per repository.

Read the findings against the code: this script reports, it does not judge.

The judged corpus (benchmarks/corpus/, see benchmarks/corpus.py):

    python benchmarks/realworld.py --fetch            # materialise missing files, then score
    python benchmarks/realworld.py --corpus --cache DIR

lints every manifest file found in the cache with the default-on rules (as `distdoctor lint` does
without configuration) and prints per rule the findings, judged true and false positives, unjudged
findings and the precision, the overall line, then the findings nobody judged yet (new) and the
judgments whose finding is gone. The cache is `--cache`, else $DISTDOCTOR_CORPUS, else
~/.cache/distdoctor/corpus.

Standard library and distdoctor only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus as corpus_data  # noqa: E402  (benchmarks/corpus.py, standard library only)

from distdoctor.lint.config import Config
from distdoctor.lint.engine import SKIPPED_DIRS, lint, lint_source, read_source
from distdoctor.lint.finding import Finding
from distdoctor.lint.rule import all_rules

ROOT = Path(__file__).resolve().parents[1]
PRECISION_FILE = ROOT / "distdoctor" / "data" / "precision.json"


@dataclass(frozen=True)
class FileOutcome:
    path: str
    findings: tuple[Finding, ...]
    error: str | None
    seconds: float


def python_files(roots: list[str]) -> list[Path]:
    """Every `*.py` under the roots (files given directly are kept), in a stable order."""
    found: list[Path] = []
    for root in roots:
        path = Path(root)
        if path.is_file():
            found.append(path)
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            found.extend(Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py"))
    return list(dict.fromkeys(found))


def lint_file(path: str) -> FileOutcome:
    start = time.perf_counter()
    try:
        source = read_source(Path(path))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return FileOutcome(path, (), f"cannot read: {exc}", time.perf_counter() - start)
    try:
        result = lint_source(source, path, all_rules())
    except Exception as exc:  # a crash in a rule is itself a finding of this check
        return FileOutcome(path, (), f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    return FileOutcome(path, result.findings, None, time.perf_counter() - start)


def run(paths: list[Path], jobs: int) -> tuple[list[FileOutcome], float]:
    start = time.perf_counter()
    names = [str(p) for p in paths]
    if jobs > 1 and len(names) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(lint_file, names, chunksize=4))
    else:
        outcomes = [lint_file(name) for name in names]
    return outcomes, time.perf_counter() - start


def repository_of(path: str) -> str:
    """`owner+repo` for a corpus laid out as `<root>/<owner>+<repo>/...`, else the top folder."""
    for part in Path(path).parts:
        if "+" in part:
            return part.replace("+", "/", 1)
    parts = Path(path).parts
    return parts[0] if parts else path


def report_text(outcomes: list[FileOutcome], seconds: float, out) -> None:
    rules = {rule.code: rule for rule in all_rules()}
    findings = [f for o in outcomes for f in o.findings]
    per_rule = Counter(f.code for f in findings)
    files_per_rule: dict[str, set[str]] = defaultdict(set)
    for f in findings:
        files_per_rule[f.code].add(f.path)

    print("Findings per rule (all rules; `off` = default-off, runs only when selected)", file=out)
    print(f"  {'code':<6} {'name':<36} {'sev':<8} {'on':<4} {'findings':>8} {'files':>6}", file=out)
    for code, rule in rules.items():
        on = "on" if rule.default_on else "off"
        print(f"  {code:<6} {rule.name:<36} {rule.severity:<8} {on:<4} {per_rule.get(code, 0):>8} {len(files_per_rule.get(code, ())):>6}", file=out)
    print(file=out)

    by_repo: dict[str, Counter] = defaultdict(Counter)
    files_by_repo: Counter = Counter()
    for o in outcomes:
        repo = repository_of(o.path)
        files_by_repo[repo] += 1
        by_repo[repo].update(f.code for f in o.findings)
    if len(files_by_repo) > 1:
        print("Per repository", file=out)
        for repo in sorted(files_by_repo):
            counts = ", ".join(f"{code} x{n}" for code, n in sorted(by_repo[repo].items())) or "-"
            print(f"  {repo:<44} {files_by_repo[repo]:>4} files  {counts}", file=out)
        print(file=out)

    print("Findings per file", file=out)
    for o in outcomes:
        if not o.findings and o.error is None:
            continue
        print(f"  {o.path}", file=out)
        if o.error is not None:
            print(f"    ERROR  {o.error}", file=out)
        for f in o.findings:
            off = "" if rules.get(f.code) is None or rules[f.code].default_on else " (off)"
            print(f"    {f.code}{off} {f.path}:{f.line}: {f.message}", file=out)
    print(file=out)

    lines = _line_count(outcomes)
    errors = sum(1 for o in outcomes if o.error is not None)
    rate = len(outcomes) / seconds if seconds > 0 else float("inf")
    slowest = max(outcomes, key=lambda o: o.seconds, default=None)
    print(
        f"{len(outcomes)} files ({lines} lines), {len(findings)} findings, {errors} errors, "
        f"{seconds:.2f} s wall, {rate:.1f} files/s",
        file=out,
    )
    if slowest is not None:
        print(f"slowest file: {slowest.path} ({slowest.seconds:.2f} s)", file=out)


def report_json(outcomes: list[FileOutcome], seconds: float, out) -> None:
    rules = {rule.code: rule for rule in all_rules()}
    payload = {
        "files": len(outcomes),
        "lines": _line_count(outcomes),
        "seconds": round(seconds, 3),
        "files_per_second": round(len(outcomes) / seconds, 2) if seconds > 0 else None,
        "per_rule": {
            code: {
                "name": rule.name,
                "severity": rule.severity,
                "default_on": rule.default_on,
                "findings": sum(1 for o in outcomes for f in o.findings if f.code == code),
            }
            for code, rule in rules.items()
        },
        "errors": [{"path": o.path, "error": o.error} for o in outcomes if o.error is not None],
        "findings": [
            {**f.to_dict(), "default_on": rules[f.code].default_on if f.code in rules else True}
            for o in outcomes
            for f in o.findings
        ],
    }
    json.dump(payload, out, indent=1)
    out.write("\n")


def _line_count(outcomes: list[FileOutcome]) -> int:
    total = 0
    for o in outcomes:
        try:
            with open(o.path, "rb") as handle:
                total += sum(1 for _ in handle)
        except OSError:
            pass
    return total


# --------------------------------------------------------------------------------------------
# The judged corpus


def lint_corpus(
    cache: Path, entries: list[corpus_data.Entry], jobs: int, judged_codes: tuple[str, ...] = ()
) -> tuple[list[dict], list[corpus_data.Entry], list[str]]:
    """Default-on findings of every manifest file present in the cache, keyed by repo/commit/path,
    plus the findings of rules that were judged once and switched off since (`judged_codes`): a rule
    turned off for its precision is still measured, so it can earn its default back."""
    present = [e for e in entries if corpus_data.cache_path(cache, e.repo, e.commit, e.path).is_file()]
    absent = [e for e in entries if e not in present]
    by_path = {str(corpus_data.cache_path(cache, e.repo, e.commit, e.path)): e for e in present}
    if not by_path:
        return [], absent, []
    known = {rule.code for rule in all_rules()}
    config = Config(cache=False, extend_select=tuple(code for code in judged_codes if code in known))
    result = lint(list(by_path), config, jobs=jobs)
    findings = []
    for f in result.findings:
        entry = by_path.get(f.path)
        if entry is None:
            continue
        findings.append(
            {"repo": entry.repo, "commit": entry.commit, "path": entry.path, "line": f.line, "code": f.code, "message": f.message}
        )
    return findings, absent, list(result.errors)


def _precision(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


MISS_WINDOW = 3  # a finding this many lines from a recorded miss counts as finding it


def found_misses(findings: list[dict], misses: list) -> list[tuple[object, str]]:
    """The recorded misses some finding (any code linted) now reports, within a few lines: a rule
    change that finds a miss is seen, as is one that loses it again."""
    by_file: dict[tuple[str, str, str], list[dict]] = {}
    for f in findings:
        repo, commit, path, _, _ = corpus_data.finding_key(f)
        by_file.setdefault((repo, commit, path), []).append(f)
    found = []
    for miss in misses:
        near = [f for f in by_file.get((miss.repo, miss.commit, miss.path), []) if abs(f["line"] - miss.line) <= MISS_WINDOW]
        if near:
            found.append((miss, ",".join(sorted({f["code"] for f in near}))))
    return found


def report_corpus(scores: dict, findings: list[dict], present: int, absent: int, misses: list, out) -> None:
    messages = {corpus_data.finding_key(f): f["message"] for f in findings}
    print(f"Corpus: {present} files linted, {absent} manifest files not in the cache, {len(misses)} recorded misses", file=out)
    print(f"  {'code':<6} {'findings':>8} {'TP':>5} {'FP':>5} {'unjudged':>8} {'precision':>9} {'gone':>5}", file=out)
    for code, s in scores.items():
        if code == "ALL":
            print(f"  {'-' * 6} {'-' * 8} {'-' * 5} {'-' * 5} {'-' * 8} {'-' * 9} {'-' * 5}", file=out)
            code = "all"
        print(
            f"  {code:<6} {s.findings:>8} {s.tp:>5} {s.fp:>5} {s.unjudged:>8} {_precision(s.precision):>9} {len(s.gone):>5}",
            file=out,
        )
    total = scores["ALL"]
    print(file=out)
    print(f"New findings (not judged yet): {len(total.new)}", file=out)
    for key in total.new:
        repo, commit, path, line, code = key
        print(f"  {code} {repo}@{commit[:10]} {path}:{line}: {messages.get(key, '')}", file=out)
    found = found_misses(findings, misses)
    print(f"Recorded misses now found: {len(found)} of {len(misses)}", file=out)
    for miss, codes in found:
        print(f"  {codes} {miss.repo}@{miss.commit[:10]} {miss.path}:{miss.line}: {miss.what}", file=out)
    print(f"Gone (judged, no longer found): {len(total.gone)}", file=out)
    for j in total.gone:
        print(f"  {j.code} {j.repo}@{j.commit[:10]} {j.path}:{j.line}: was {j.verdict}: {j.reason}", file=out)


def corpus_json(scores: dict, findings: list[dict], present: int, absent: int, out) -> None:
    messages = {corpus_data.finding_key(f): f["message"] for f in findings}
    payload = {
        "files": present,
        "not_in_cache": absent,
        "per_rule": {
            code: {"findings": s.findings, "tp": s.tp, "fp": s.fp, "unjudged": s.unjudged, "precision": s.precision, "gone": len(s.gone)}
            for code, s in scores.items()
        },
        "new": [
            {"repo": k[0], "commit": k[1], "path": k[2], "line": k[3], "code": k[4], "message": messages.get(k, "")}
            for k in scores["ALL"].new
        ],
        "gone": [
            {"repo": j.repo, "commit": j.commit, "path": j.path, "line": j.line, "code": j.code, "verdict": j.verdict, "reason": j.reason}
            for j in scores["ALL"].gone
        ],
    }
    json.dump(payload, out, indent=1)
    out.write("\n")


def main_corpus(args) -> int:
    cache = corpus_data.cache_root(args.cache)
    directory = Path(args.corpus_dir) if args.corpus_dir else corpus_data.CORPUS_DIR
    try:
        entries = corpus_data.load_manifest(directory)
        judgments = corpus_data.load_judgments(directory)
        misses = corpus_data.load_misses(directory)
    except corpus_data.CorpusError as exc:
        print(f"corpus: {exc}", file=sys.stderr)
        return 2
    if not entries:
        print(f"corpus: no *.manifest.jsonl entries in {directory}", file=sys.stderr)
        return 2
    if args.fetch:
        fetched, failed = corpus_data.fetch(cache, [*entries, *corpus_data.load_context(directory)])
        print(f"corpus: fetched {fetched} files into {cache}, {failed} could not be fetched", file=sys.stderr)
    findings, absent, errors = lint_corpus(cache, entries, args.jobs, tuple(sorted({j.code for j in judgments})))
    present = len(entries) - len(absent)
    if present == 0:
        hint = "nothing could be fetched (see above)" if args.fetch else "run with --fetch"
        print(f"corpus: none of the {len(entries)} manifest files is in {cache} ({hint})", file=sys.stderr)
        return 2
    for error in errors:
        print(f"corpus: {error}", file=sys.stderr)
    linted = [e.key for e in entries if e not in absent]
    scores = corpus_data.score(findings, judgments, linted)
    if args.json:
        corpus_json(scores, findings, present, len(absent), sys.stdout)
    else:
        report_corpus(scores, findings, present, len(absent), misses, sys.stdout)
    if args.write_precision:
        if scores["ALL"].unjudged:
            print(f"corpus: {scores['ALL'].unjudged} findings are not judged yet: judge them before writing "
                  f"the measured precision", file=sys.stderr)
            return 1
        repositories = len({e.repo for e in entries if e not in absent})
        PRECISION_FILE.write_text(precision_json(scores, present, repositories))
        print(f"corpus: wrote {PRECISION_FILE.relative_to(ROOT)}", file=sys.stderr)
    return 1 if errors else 0


def precision_json(scores: dict, files: int, repositories: int) -> str:
    """What `distdoctor rules` and `explain` print as each rule's measured precision."""
    payload = {
        "corpus": {"files": files, "repositories": repositories},
        "rules": {
            code: {"findings": s.tp + s.fp, "true": s.tp, "false": s.fp}
            for code, s in sorted(scores.items())
            if code != "ALL"
        },
    }
    return json.dumps(payload, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="folders (walked for *.py) or files")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    parser.add_argument("--corpus", action="store_true", help="score the judged corpus (benchmarks/corpus/) from the cache")
    parser.add_argument("--fetch", action="store_true", help="materialise missing corpus files first (implies --corpus)")
    parser.add_argument("--cache", help=f"corpus cache folder (default: ${corpus_data.ENV_CACHE} or {corpus_data.DEFAULT_CACHE})")
    parser.add_argument("--corpus-dir", help="folder of the *.manifest.jsonl / *.judgments.jsonl files (default: benchmarks/corpus)")
    parser.add_argument("--write-precision", action="store_true",
                        help="with --corpus: write each rule's measured precision to distdoctor/data/precision.json "
                             "(refused while a finding is unjudged)")
    args = parser.parse_args(argv)
    if args.corpus or args.fetch:
        if args.paths:
            parser.error("--corpus/--fetch take no paths: the manifest says which files")
        return main_corpus(args)
    if not args.paths:
        parser.error("give folders or files to lint, or --corpus")
    paths = python_files(args.paths)
    if not paths:
        print("no *.py files found", file=sys.stderr)
        return 2
    outcomes, seconds = run(paths, args.jobs)
    if args.json:
        report_json(outcomes, seconds, sys.stdout)
    else:
        report_text(outcomes, seconds, sys.stdout)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
