"""`distdoctor lint`, `rules` and `explain` as a user drives them: exit codes, formats, fixes,
configuration and suppression (spec/lint.md)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from distdoctor.lint import engine
from distdoctor.cli import main

ROOT = Path(__file__).resolve().parents[1]

BAD = textwrap.dedent(
    """\
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, shuffle=True, sampler=sampler)
    model = DDP(Net())
    for epoch in range(3):
        for batch in loader:
            pass
    """
)
GOOD = textwrap.dedent(
    """\
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
    model = DDP(model)
    """
)


def run(*args: str, input: str | None = None, cwd: Path | None = None):
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(main, list(args), input=input)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(main, list(args), input=input)
    finally:
        os.chdir(old)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "good.py").write_text(GOOD)
    return tmp_path


def test_exit_status_is_zero_when_clean_and_one_with_findings(tree):
    assert run("lint", "--no-cache", str(tree / "good.py")).exit_code == 0
    result = run("lint", "--no-cache", str(tree / "bad.py"))
    assert result.exit_code == 1
    assert f"{tree / 'bad.py'}:6:25: DD202 [error]" in result.output
    assert "DD201 [warning]" in result.output
    assert "2 fixable" in result.output


def test_exit_zero_and_usage_errors(tree):
    assert run("lint", "--no-cache", "--exit-zero", str(tree / "bad.py")).exit_code == 0
    missing = run("lint", str(tree / "nope.py"))
    assert missing.exit_code == 2 and "no such file" in missing.output and "Traceback" not in missing.output
    unknown = run("lint", "--select", "DD999", str(tree))
    assert unknown.exit_code == 2 and "unknown rule code" in unknown.output
    assert run("explain", "DD999").exit_code == 2


def test_json_output_is_the_documented_contract(tree):
    result = run("lint", "--no-cache", "--format", "json", str(tree / "bad.py"))
    data = json.loads(result.output)
    assert [f["code"] for f in data] == ["DD202", "DD201"]
    first = data[0]
    assert set(first) == {"code", "name", "severity", "message", "path", "line", "column", "end_line", "end_column", "fix"}
    assert first["path"] == str(tree / "bad.py")
    assert (first["line"], first["column"]) == (6, 25)
    assert first["fix"]["applicable"] == "safe" and first["fix"]["edits"]


def test_sarif_output_has_rules_results_and_regions(tree):
    result = run("lint", "--no-cache", "--format", "sarif", str(tree / "bad.py"))
    doc = json.loads(result.output)
    assert doc["version"] == "2.1.0"
    run_ = doc["runs"][0]
    rules = run_["tool"]["driver"]["rules"]
    assert {"DD101", "DD201", "DD401"} <= {r["id"] for r in rules}
    first = run_["results"][0]
    assert rules[first["ruleIndex"]]["id"] == first["ruleId"] == "DD202"
    region = first["locations"][0]["physicalLocation"]["region"]
    assert region["startLine"] == 6 and region["startColumn"] == 25
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SARIF_SUBSET_SCHEMA)


def test_sarif_uris_are_percent_encoded_and_relative_to_srcroot(tree):
    # artifactLocation.uri is a URI reference (format uri-reference in the SARIF 2.1.0 schema):
    # a space, '#' or '%' in a file name must be escaped, or the uri is invalid or names another file.
    odd = tree / "sub dir#1"
    odd.mkdir()
    (odd / "bad 100%.py").write_text(BAD)
    doc = json.loads(run("lint", "--no-cache", "--format", "sarif", "sub dir#1", cwd=tree).output)
    run_ = doc["runs"][0]
    first = run_["results"][0]
    location = first["locations"][0]["physicalLocation"]["artifactLocation"]
    assert location == {"uri": "sub%20dir%231/bad%20100%25.py", "uriBaseId": "%SRCROOT%"}
    assert first["fixes"][0]["artifactChanges"][0]["artifactLocation"] == location
    assert run_["originalUriBaseIds"]["%SRCROOT%"]["uri"] == tree.resolve().as_uri() + "/"
    # An absolute path is an absolute file URI, with no base.
    doc = json.loads(run("lint", "--no-cache", "--format", "sarif", str(odd / "bad 100%.py")).output)
    location = doc["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert location == {"uri": (odd / "bad 100%.py").as_uri()}
    assert "originalUriBaseIds" not in doc["runs"][0]


# The parts of the SARIF 2.1.0 schema that GitHub code scanning reads, written out by hand.
SARIF_SUBSET_SCHEMA = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["tool", "results"],
                "properties": {
                    "tool": {
                        "type": "object",
                        "required": ["driver"],
                        "properties": {
                            "driver": {
                                "type": "object",
                                "required": ["name", "rules"],
                                "properties": {
                                    "rules": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id", "shortDescription", "help"],
                                            "properties": {
                                                "defaultConfiguration": {
                                                    "type": "object",
                                                    "properties": {"level": {"enum": ["none", "note", "warning", "error"]}},
                                                }
                                            },
                                        },
                                    }
                                },
                            }
                        },
                    },
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["ruleId", "message", "locations", "level"],
                            "properties": {
                                "level": {"enum": ["none", "note", "warning", "error"]},
                                "message": {"type": "object", "required": ["text"]},
                                "locations": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["physicalLocation"],
                                        "properties": {
                                            "physicalLocation": {
                                                "type": "object",
                                                "required": ["artifactLocation", "region"],
                                                "properties": {
                                                    "region": {
                                                        "type": "object",
                                                        "required": ["startLine"],
                                                        "properties": {
                                                            "startLine": {"type": "integer", "minimum": 1},
                                                            "startColumn": {"type": "integer", "minimum": 1},
                                                        },
                                                    }
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_github_annotations(tree):
    result = run("lint", "--no-cache", "--format", "github", str(tree / "bad.py"))
    first = result.output.splitlines()[0]
    assert first.startswith(f"::error file={tree / 'bad.py'},line=6,col=25,")
    assert "title=DD202::" in first


def test_fix_rewrites_atomically_keeps_mode_and_is_idempotent(tree):
    bad = tree / "bad.py"
    bad.chmod(0o750)
    result = run("lint", "--no-cache", "--fix", str(bad))
    assert result.exit_code == 0, result.output
    text = bad.read_text()
    assert "loader = DataLoader(ds, shuffle=(sampler is None), sampler=sampler)" in text
    assert "    sampler.set_epoch(epoch)\n    for batch in loader:" in text
    assert stat.S_IMODE(bad.stat().st_mode) == 0o750
    assert not [p for p in tree.iterdir() if p.name.endswith(".distdoctor")]
    assert run("lint", "--no-cache", "--fix", str(bad)).exit_code == 0
    assert bad.read_text() == text


def test_diff_shows_fixes_and_writes_nothing(tree):
    bad = tree / "bad.py"
    result = run("lint", "--no-cache", "--diff", str(bad))
    assert result.exit_code == 1
    assert "+    sampler.set_epoch(epoch)" in result.output
    assert bad.read_text() == BAD


def test_unparsable_file_is_dd000_and_others_are_still_linted(tree):
    (tree / "broken.py").write_text("import torch.distributed as dist\ndef f(:\n")
    result = run("lint", "--no-cache", "--format", "json", str(tree))
    codes = {(Path(f["path"]).name, f["code"]) for f in json.loads(result.output)}
    assert ("broken.py", "DD000") in codes and ("bad.py", "DD202") in codes
    assert result.exit_code == 1


def test_noqa_and_distdoctor_ignore_comments(tmp_path):
    source = BAD.replace(
        "loader = DataLoader(ds, shuffle=True, sampler=sampler)",
        "loader = DataLoader(ds, shuffle=True, sampler=sampler)  # noqa: DD202",
    ).replace("for epoch in range(3):", "for epoch in range(3):  # distdoctor: ignore[DD201, DD202]")
    path = tmp_path / "t.py"
    path.write_text(source)
    assert run("lint", "--no-cache", str(path)).exit_code == 0
    unused = run("lint", "--no-cache", "--report-unused-noqa", str(path))
    assert "unused suppression of DD202" in unused.output and unused.exit_code == 1
    bare = BAD.replace("sampler=sampler)\nmodel", "sampler=sampler)  # noqa\nmodel")
    path.write_text(bare)
    codes = [f["code"] for f in json.loads(run("lint", "--no-cache", "--format", "json", str(path)).output)]
    assert codes == ["DD201"]


def test_select_ignore_and_default_off_rules(tree):
    bad = str(tree / "bad.py")
    def codes(*args):
        return [f["code"] for f in json.loads(run("lint", "--no-cache", "--format", "json", *args, bad).output)]
    assert codes("--select", "DD2") == ["DD202", "DD201"]
    assert codes("--ignore", "DD202") == ["DD201"]
    assert codes("--select", "DD202,DD201", "--ignore", "DD201") == ["DD202"]
    assert codes("--select", "DD1") == []
    hvd = tree / "hvd.py"
    hvd.write_text("import horovod.torch as hvd\noptimizer = hvd.DistributedOptimizer(optimizer)\nhvd.broadcast_parameters(model.state_dict(), root_rank=0)\n")
    def hvd_codes(*args):
        return [f["code"] for f in json.loads(run("lint", "--no-cache", "--format", "json", *args, str(hvd)).output)]
    assert "DD405" not in hvd_codes()
    assert "DD405" not in hvd_codes("--select", "DD4")  # a family prefix does not enable house style
    assert "DD405" in hvd_codes("--extend-select", "DD405")


def test_pyproject_configuration_and_per_file_ignores(tree):
    (tree / "pyproject.toml").write_text(
        '[tool.distdoctor]\nignore = ["DD201"]\nper-file-ignores = {"legacy/*" = ["DD20"]}\n'
    )
    (tree / "legacy").mkdir()
    (tree / "legacy" / "old.py").write_text(BAD)
    data = json.loads(run("lint", "--no-cache", "--format", "json", str(tree)).output)
    assert sorted((Path(f["path"]).name, f["code"]) for f in data) == [("bad.py", "DD202")]
    # the command line beats the file
    data = json.loads(run("lint", "--no-cache", "--format", "json", "--select", "DD201", str(tree / "bad.py")).output)
    assert [f["code"] for f in data] == []  # ignore from the file still applies to a selected code
    (tree / "pyproject.toml").write_text('[tool.distdoctor]\nselct = ["DD1"]\n')
    typo = run("lint", str(tree))
    assert typo.exit_code == 2 and "unknown key" in typo.output and "selct" in typo.output


def test_walk_skips_virtualenvs_and_gitignored_paths(tmp_path):
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text(BAD)
    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / "g.py").write_text(BAD)
    (tmp_path / "train.py").write_text(BAD)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("generated/\n")
    data = json.loads(run("lint", "--no-cache", "--format", "json", str(tmp_path)).output)
    assert {Path(f["path"]).name for f in data} == {"train.py"}


def test_stdin(tree):
    result = run("lint", "--no-cache", "--stdin-filename", "train.py", input=BAD)
    assert result.exit_code == 1 and "train.py:6:25: DD202" in result.output
    fixed = run("lint", "--fix", "-", input=BAD)
    assert "sampler.set_epoch(epoch)" in fixed.output


def test_statistics_and_rules_and_explain(tree):
    stats = run("lint", "--no-cache", "--statistics", str(tree / "bad.py"))
    assert "DD202" in stats.output and "DD201" in stats.output
    listing = run("rules")
    assert "DD405" in listing.output and "off" in listing.output
    page = run("explain", "DD101").output
    for heading in ("## What it does", "## Why is this bad?", "## Example", "## Use instead", "## Fix safety"):
        assert heading in page
    assert run("explain", "missing-set-epoch").exit_code == 0


def test_cache_answers_an_unchanged_file_without_parsing(tree, monkeypatch):
    first = run("lint", "--format", "json", str(tree / "bad.py"))
    assert (tree / ".distdoctor_cache").exists() or Path(".distdoctor_cache").exists()

    def boom(*args, **kwargs):
        raise AssertionError("parsed again")

    monkeypatch.setattr(engine, "lint_source", boom)
    second = run("lint", "--format", "json", str(tree / "bad.py"))
    assert second.output == first.output


def test_prefilter_skips_files_without_distributed_api(monkeypatch):
    import libcst

    calls = []
    real = libcst.parse_module
    monkeypatch.setattr(libcst, "parse_module", lambda src: calls.append(src) or real(src))
    assert engine.lint_source("import numpy as np\nx = np.zeros(3)\n", "x.py", []).findings == ()
    assert calls == []


def test_lint_never_imports_torch(tree, tmp_path):
    # A stub `torch` that fails on import stands first on the path, so the test proves the point
    # whether or not the real torch is installed here.
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('distdoctor lint imported torch')\n")
    code = (
        "import sys\nfrom distdoctor.cli import main\n"
        f"try:\n    main(['lint', '--no-cache', {str(tree)!r}])\nexcept SystemExit as exit:\n    sys.exit(exit.code)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr  # findings in the tree: the lint ran to its end
    assert "DD202" in result.stdout
    assert "imported torch" not in result.stderr


def test_pre_commit_hook_entry_runs_on_a_staged_bad_file(tmp_path):
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "id: distdoctor" in hooks and "types_or: [python, jupyter]" in hooks
    entry = next(line.split(":", 1)[1].strip() for line in hooks.splitlines() if line.strip().startswith("entry:"))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "train.py").write_text(BAD)
    subprocess.run(["git", "-C", str(tmp_path), "add", "train.py"], check=True)
    staged = subprocess.run(
        ["git", "-C", str(tmp_path), "diff", "--cached", "--name-only"], capture_output=True, text=True, check=True
    ).stdout.split()
    argv = entry.split()
    assert argv[:2] == ["distdoctor", "lint"]
    result = subprocess.run(
        [sys.executable, "-m", "distdoctor", *argv[1:], "--no-cache", *staged],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and "DD202" in result.stdout


def test_unreadable_files_are_dd000_findings_whatever_the_selection(tmp_path):
    (tmp_path / "latin1.py").write_bytes(b"# caf\xe9\nimport torch.distributed as dist\n")
    (tmp_path / "broken.ipynb").write_text("{not json")
    (tmp_path / "train.py").write_text(BAD)
    data = json.loads(run("lint", "--no-cache", "--format", "json", "--select", "DD2", str(tmp_path)).output)
    found = sorted((Path(f["path"]).name, f["code"]) for f in data)
    assert found == [("broken.ipynb", "DD000"), ("latin1.py", "DD000"), ("train.py", "DD201"), ("train.py", "DD202")]
    ignored = json.loads(run("lint", "--no-cache", "--format", "json", "--ignore", "DD000", str(tmp_path)).output)
    assert "DD000" not in {f["code"] for f in ignored}


def test_notebooks_are_linted_cell_by_cell_and_never_rewritten(tmp_path):
    cells = [
        {"cell_type": "markdown", "source": ["# training"]},
        {"cell_type": "code", "source": ["%matplotlib inline\n", "import torch.nn as nn\n", "from torch.nn.parallel import DistributedDataParallel as DDP\n"]},
        {"cell_type": "code", "source": ["model = DDP(Net())\n", "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"]},
    ]
    notebook = tmp_path / "train.ipynb"
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    before = notebook.read_text()
    data = json.loads(run("lint", "--no-cache", "--format", "json", "--extend-select", "DD101", str(notebook)).output)
    assert [(f["code"], f["line"], f["fix"]) for f in data] == [("DD101", 6, None)]
    assert run("lint", "--no-cache", "--fix", "--extend-select", "DD101", str(notebook)).exit_code == 1
    assert notebook.read_text() == before


def test_a_checkout_that_is_not_installed_finds_its_rules():
    # -S: no site processing, so no installed (editable) distdoctor; libcst and click come in
    # through PYTHONPATH, which runs no .pth file.
    import site

    paths = [str(ROOT), *site.getsitepackages()]
    code = "from distdoctor.lint.rule import all_rules; import distdoctor.probes; print(len(all_rules()))"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 34


def test_a_reader_that_stops_early_changes_neither_the_status_nor_stderr(tmp_path):
    # `distdoctor lint | head`: more output than a pipe holds, and the reader closes after a line.
    bad = (ROOT / "fixtures" / "lint" / "dd0_imagenet_style_global_rank.py").read_text()
    for i in range(120):
        (tmp_path / f"train_{i}.py").write_text(bad)
    for fmt in ("text", "json"):
        process = subprocess.Popen(
            [sys.executable, "-m", "distdoctor", "lint", "--no-cache", "--select", "ALL", "--format", fmt, str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert process.stdout.read(100)
        process.stdout.close()
        _, err = process.communicate(timeout=120)
        assert (process.returncode, err.decode()) == (1, "")  # findings, and no traceback or error
