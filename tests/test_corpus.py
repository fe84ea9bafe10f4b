"""The real-world corpus tooling (benchmarks/corpus.py, realworld.py --corpus) on tiny in-test data:
loading and validating the manifest and judgments, scoring, the cache layout. No network."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


corpus = _load("corpus")

C1 = "a" * 40
C2 = "b" * 40


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def entry(path="train.py", repo="o/r", commit=C1, **extra):
    return {"repo": repo, "commit": commit, "path": path, "area": "vision", "stack": "ddp", **extra}


def judgment(line, code, verdict, path="train.py", repo="o/r", commit=C1):
    return {"repo": repo, "commit": commit, "path": path, "line": line, "code": code, "verdict": verdict, "reason": "read"}


def finding(line, code, path="train.py", repo="o/r", commit=C1):
    return {"repo": repo, "commit": commit, "path": path, "line": line, "code": code}


# --- loading --------------------------------------------------------------------------------


def test_manifests_of_every_shard_are_loaded(tmp_path):
    write_jsonl(tmp_path / "a.manifest.jsonl", [entry("x.py"), entry("y.py", repo="p/q", commit=C2)])
    write_jsonl(tmp_path / "b.manifest.jsonl", [entry("z.py")])
    (tmp_path / "notes.txt").write_text("not a manifest")
    entries = corpus.load_manifest(tmp_path)
    assert [e.key for e in entries] == [("o/r", C1, "x.py"), ("p/q", C2, "y.py"), ("o/r", C1, "z.py")]
    assert entries[1].area == "vision" and entries[1].stack == "ddp"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps(entry(commit="abc")), "40 lowercase hex"),
        (json.dumps(entry(repo="noslash")), "is not 'owner/name'"),
        (json.dumps(entry(path="/abs/train.py")), "relative to the repository root"),
        (json.dumps(entry(path="../up.py")), "relative to the repository root"),
        (json.dumps(entry(area="cooking")), "area 'cooking'"),
        (json.dumps(entry(stack="mpi")), "stack 'mpi'"),
        (json.dumps({k: v for k, v in entry().items() if k != "path"}), "field 'path'"),
    ],
)
def test_bad_manifest_lines_are_named_with_file_and_line(tmp_path, line, message):
    write_jsonl(tmp_path / "a.manifest.jsonl", [entry("ok.py"), line])
    with pytest.raises(corpus.CorpusError, match=message) as info:
        corpus.load_manifest(tmp_path)
    assert str(info.value).startswith("a.manifest.jsonl:2:")


def test_a_file_listed_twice_in_one_manifest_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.manifest.jsonl", [entry(), entry("other.py"), entry()])
    with pytest.raises(corpus.CorpusError, match="a.manifest.jsonl:3: .* already listed at a.manifest.jsonl:1"):
        corpus.load_manifest(tmp_path)


def test_the_same_file_in_two_shards_counts_once(tmp_path):
    write_jsonl(tmp_path / "a.manifest.jsonl", [entry()])
    write_jsonl(tmp_path / "b.manifest.jsonl", [entry(), entry("own.py")])
    assert [e.path for e in corpus.load_manifest(tmp_path)] == ["train.py", "own.py"]


def test_missing_corpus_folder_is_a_clear_error(tmp_path):
    with pytest.raises(corpus.CorpusError, match="no such corpus folder"):
        corpus.load_manifest(tmp_path / "nowhere")


def test_judgments_load_and_validate(tmp_path):
    write_jsonl(tmp_path / "a.judgments.jsonl", [judgment(3, "DD304", "TP"), judgment(9, "DD302", "FP")])
    got = corpus.load_judgments(tmp_path)
    assert [(j.line, j.code, j.verdict) for j in got] == [(3, "DD304", "TP"), (9, "DD302", "FP")]
    write_jsonl(tmp_path / "a.judgments.jsonl", [judgment(3, "DD304", "maybe")])
    with pytest.raises(corpus.CorpusError, match="must be TP or FP"):
        corpus.load_judgments(tmp_path)
    write_jsonl(tmp_path / "a.judgments.jsonl", [judgment(0, "DD304", "TP")])
    with pytest.raises(corpus.CorpusError, match="'line' must be a positive integer"):
        corpus.load_judgments(tmp_path)


def test_the_same_finding_judged_both_ways_is_an_error_the_same_way_is_merged(tmp_path):
    write_jsonl(tmp_path / "a.judgments.jsonl", [judgment(3, "DD304", "TP"), judgment(3, "DD304", "TP")])
    assert len(corpus.load_judgments(tmp_path)) == 1
    write_jsonl(tmp_path / "b.judgments.jsonl", [judgment(3, "DD304", "FP")])
    with pytest.raises(corpus.CorpusError, match="judged FP here but TP at a.judgments.jsonl:1"):
        corpus.load_judgments(tmp_path)


def test_misses_load(tmp_path):
    write_jsonl(tmp_path / "a.misses.jsonl", [{"repo": "o/r", "commit": C1, "path": "t.py", "line": 4, "what": "no set_epoch"}])
    (miss,) = corpus.load_misses(tmp_path)
    assert (miss.path, miss.line, miss.what) == ("t.py", 4, "no set_epoch")


# --- scoring --------------------------------------------------------------------------------


def judged(*records):
    return [corpus.Judgment(**r) for r in records]


def test_score_counts_tp_fp_new_and_gone_per_rule():
    judgments = judged(
        judgment(10, "DD304", "TP"),
        judgment(20, "DD304", "FP"),
        judgment(30, "DD302", "FP"),
        judgment(40, "DD302", "TP"),  # no longer produced: gone
    )
    findings = [finding(10, "DD304"), finding(20, "DD304"), finding(30, "DD302"), finding(50, "DD201")]
    scores = corpus.score(findings, judgments)
    assert list(scores) == ["DD201", "DD302", "DD304", "ALL"]
    dd304, dd302, dd201, total = scores["DD304"], scores["DD302"], scores["DD201"], scores["ALL"]
    assert (dd304.findings, dd304.tp, dd304.fp, dd304.unjudged, dd304.precision) == (2, 1, 1, 0, 0.5)
    assert (dd302.findings, dd302.tp, dd302.fp, dd302.precision) == (1, 0, 1, 0.0)
    assert [j.line for j in dd302.gone] == [40]
    assert dd201.precision is None and dd201.new == [("o/r", C1, "train.py", 50, "DD201")]
    assert (total.findings, total.tp, total.fp, total.unjudged, len(total.gone)) == (4, 1, 2, 1, 1)
    assert total.precision == pytest.approx(1 / 3)


def test_a_moved_finding_is_new_and_its_old_judgment_gone():
    scores = corpus.score([finding(11, "DD304")], judged(judgment(10, "DD304", "TP")))
    assert scores["DD304"].new == [("o/r", C1, "train.py", 11, "DD304")]
    assert [j.line for j in scores["DD304"].gone] == [10]
    assert scores["DD304"].tp == 0


def test_same_line_same_rule_counts_once_and_commit_matters():
    findings = [finding(5, "DD304"), finding(5, "DD304"), finding(5, "DD304", commit=C2)]
    scores = corpus.score(findings, judged(judgment(5, "DD304", "TP")))
    assert (scores["DD304"].findings, scores["DD304"].tp, scores["DD304"].unjudged) == (2, 1, 1)


def test_judgments_of_files_not_linted_are_not_gone():
    judgments = judged(judgment(5, "DD304", "TP", path="here.py"), judgment(5, "DD304", "TP", path="absent.py"))
    scores = corpus.score([], judgments, files=[("o/r", C1, "here.py")])
    assert [j.path for j in scores["ALL"].gone] == ["here.py"]
    assert [j.path for j in corpus.score([], judgments)["ALL"].gone] == ["absent.py", "here.py"]


def test_findings_may_be_tuples():
    scores = corpus.score([("o/r", C1, "train.py", "7", "DD201")], judged(judgment(7, "DD201", "FP")))
    assert scores["DD201"].fp == 1


# --- cache layout and fetch (no network) ----------------------------------------------------


def test_cache_root_option_then_environment_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.ENV_CACHE, str(tmp_path / "env"))
    assert corpus.cache_root(tmp_path / "opt") == tmp_path / "opt"
    assert corpus.cache_root() == tmp_path / "env"
    monkeypatch.delenv(corpus.ENV_CACHE)
    assert corpus.cache_root() == Path("~/.cache/distdoctor/corpus").expanduser()


def test_cache_path_and_locate_are_inverse(tmp_path):
    path = corpus.cache_path(tmp_path, "own/name", C1, "src/train/main.py")
    assert path == tmp_path / "own+name" / C1 / "src" / "train" / "main.py"
    assert corpus.locate(tmp_path, path) == ("own/name", C1, "src/train/main.py")
    assert corpus.locate(tmp_path, tmp_path.parent / "elsewhere.py") is None


def test_fetch_reports_an_unreachable_repository_and_goes_on(tmp_path, monkeypatch):
    (tmp_path / "have+it" / C1).mkdir(parents=True)
    (tmp_path / "have+it" / C1 / "t.py").write_text("x = 1\n")

    def download(repo, commit, path, timeout):
        if repo == "down/repo":
            raise corpus.urllib.error.URLError("network unreachable")
        return f"# {repo} {path}\n".encode()

    monkeypatch.setattr(corpus, "_download", download)
    entries = [
        corpus.Entry("have/it", C1, "t.py", "vision", "ddp"),  # already cached: not fetched again
        corpus.Entry("down/repo", C1, "a.py", "vision", "ddp"),
        corpus.Entry("down/repo", C1, "b.py", "vision", "ddp"),
        corpus.Entry("up/repo", C2, "dir/c.py", "vision", "ddp"),
    ]
    out = io.StringIO()
    assert corpus.fetch(tmp_path, entries, out=out, use_git=False) == (1, 2)
    assert "down/repo@aaaaaaaaaa: 2 of 2 files not fetched" in out.getvalue()
    assert "network unreachable" in out.getvalue()
    assert (tmp_path / "up+repo" / C2 / "dir" / "c.py").read_text() == "# up/repo dir/c.py\n"
    assert (tmp_path / "have+it" / C1 / "t.py").read_text() == "x = 1\n"
    assert [e.path for e in corpus.missing(tmp_path, entries)] == ["a.py", "b.py"]


def test_fetch_through_git_from_a_local_remote(tmp_path, monkeypatch):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    work = tmp_path / "remote" / "own" / "name"
    work.mkdir(parents=True)
    (work / "pkg").mkdir()
    (work / "pkg" / "train.py").write_text("print('v1')\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(work), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = git("rev-parse", "HEAD").strip()
    (work / "pkg" / "train.py").write_text("print('v2')\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    monkeypatch.setattr(corpus, "GITHUB", (tmp_path / "remote").as_uri())
    monkeypatch.setattr(corpus, "_download", lambda *a: (_ for _ in ()).throw(corpus.urllib.error.URLError("offline")))
    cache = tmp_path / "cache"
    entries = [corpus.Entry("own/name", first, "pkg/train.py", "vision", "ddp"), corpus.Entry("own/name", first, "nope.py", "vision", "ddp")]
    out = io.StringIO()
    assert corpus.fetch(cache, entries, out=out, use_git=True) == (1, 1)
    assert corpus.cache_path(cache, "own/name", first, "pkg/train.py").read_text() == "print('v1')\n"  # the pinned commit
    assert "1 of 2 files not fetched" in out.getvalue() and "nope.py" in out.getvalue()


# --- realworld.py --corpus on a two-file corpus ----------------------------------------------

SCRIPT = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("nccl")
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, sampler=sampler, shuffle=True)
    for epoch in range(10):
        for batch in loader:
            pass
    """
)


def test_realworld_corpus_table(tmp_path, capsys):
    realworld = _load("realworld")
    cache, data = tmp_path / "cache", tmp_path / "data"
    data.mkdir()
    target = corpus.cache_path(cache, "o/r", C1, "train.py")
    target.parent.mkdir(parents=True)
    target.write_text(SCRIPT)
    write_jsonl(data / "t.manifest.jsonl", [entry("train.py"), entry("absent.py")])
    write_jsonl(data / "t.judgments.jsonl", [judgment(7, "DD202", "TP"), judgment(99, "DD304", "FP")])
    code = realworld.main(["--corpus", "--cache", str(cache), "--corpus-dir", str(data), "-j", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "1 files linted, 1 manifest files not in the cache" in out
    table = out.split("\n\n")[0].splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in table if not line.startswith("  --")}
    assert rows["DD202"][1:6] == ["1", "1", "0", "0", "1.00"]
    assert rows["DD201"][1:6] == ["1", "0", "0", "1", "-"]  # set_epoch never called: not judged yet
    assert rows["all"][1:7] == ["2", "1", "0", "1", "1.00", "1"]
    assert "DD201 o/r@aaaaaaaaaa train.py:8: the DistributedSampler" in out
    assert "DD304 o/r@aaaaaaaaaa train.py:99: was FP: read" in out


def test_realworld_corpus_bad_data_is_a_message_not_a_traceback(tmp_path, capsys):
    realworld = _load("realworld")
    write_jsonl(tmp_path / "t.manifest.jsonl", ['{"repo": 1}'])
    assert realworld.main(["--corpus", "--cache", str(tmp_path), "--corpus-dir", str(tmp_path)]) == 2
    assert "field 'repo' must be a non-empty string" in capsys.readouterr().err
    write_jsonl(tmp_path / "t.manifest.jsonl", [entry()])
    assert realworld.main(["--corpus", "--cache", str(tmp_path / "empty"), "--corpus-dir", str(tmp_path)]) == 2
    assert "run with --fetch" in capsys.readouterr().err
