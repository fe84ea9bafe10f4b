"""libcst imported through the compiled-code cache: the same classes, fewer compilations.

Each case runs in a fresh interpreter: libcst can be imported only once per process."""

from __future__ import annotations

import json
import marshal
import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from distdoctor.cli import main
from distdoctor.lint.libcst_import import CODE_FILE

# Prints, as JSON: the code of every libcst node class's generated methods (the parent compares
# them with `==`, which compares code objects by what they do); how many dataclass texts were
# compiled by a `compile` call (a plain import compiles them inside `exec`, uncounted); whether
# the shadowing `exec` is gone afterwards; a parse round trip and a validation.
CHILD = textwrap.dedent(
    """
    import builtins, dataclasses, json, marshal, sys
    from pathlib import Path

    compiled = []
    real_compile = builtins.compile

    def counting_compile(source, filename, *args, **kwargs):
        if isinstance(source, str) and source.startswith("def __create_fn__"):  # a dataclass's methods
            compiled.append(source)
        return real_compile(source, filename, *args, **kwargs)

    builtins.compile = counting_compile
    folder = sys.argv[1]
    if folder == "-":
        import libcst as cst
    else:
        from distdoctor.lint.libcst_import import import_libcst
        import_libcst(Path(folder))
        import libcst as cst
    builtins.compile = real_compile

    def validated():
        try:
            cst.Name("")
        except cst.CSTValidationError:
            return True
        return False

    methods = []
    for name in sorted(dir(cst)):
        cls = getattr(cst, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            for method in ("__init__", "__eq__", "__hash__", "__repr__", "__setattr__"):
                code = getattr(getattr(cls, method, None), "__code__", None)
                if code is not None:
                    methods.append((name, method, code))
    source = "import torch.distributed as dist\\nif dist.get_rank() == 0:\\n    dist.barrier()\\n"
    tree = cst.parse_module(source)
    print(json.dumps({
        "compiled": len(compiled),
        "shadow_left": "exec" in vars(dataclasses),
        "methods": marshal.dumps(methods).hex(),
        "round_trip": tree.code == source,
        "equal_nodes": cst.Name("x").deep_equals(cst.Name("x")) and not cst.Name("x").deep_equals(cst.Name("y")),
        "validated": validated(),
    }))
    """
)


def _child(folder: Path | str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    run["methods"] = marshal.loads(bytes.fromhex(run["methods"]))
    return run


def test_second_import_compiles_nothing_and_builds_the_same_classes(tmp_path):
    plain = _child("-")
    first = _child(tmp_path)
    second = _child(tmp_path)
    assert first["compiled"] > 100  # one text per dataclass, compiled once and kept
    assert (tmp_path / CODE_FILE).is_file()
    assert second["compiled"] == 0
    for run in (first, second):
        assert run["methods"] == plain["methods"]
        assert run["round_trip"] and run["equal_nodes"] and run["validated"]
        assert not run["shadow_left"]


def test_a_damaged_cache_file_is_replaced_not_trusted(tmp_path):
    plain = _child("-")
    for damage in (b"not marshal data", marshal.dumps({"def f(): pass": 42, 7: "x"}), marshal.dumps([1, 2])):
        (tmp_path / CODE_FILE).write_bytes(damage)
        run = _child(tmp_path)
        assert run["methods"] == plain["methods"] and run["round_trip"]
        assert _child(tmp_path)["compiled"] == 0  # rewritten whole by the run before


def test_a_cache_that_cannot_be_written_only_costs_the_compilations(tmp_path):
    (tmp_path / CODE_FILE).mkdir()  # neither readable nor replaceable as a file
    run = _child(tmp_path)
    assert run["round_trip"] and run["compiled"] > 100
    assert (tmp_path / CODE_FILE).is_dir()


def test_lint_keeps_the_compiled_code_in_its_cache_folder_and_not_without_one(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    monkeypatch.chdir(tmp_path)
    # CliRunner runs in this process, where libcst is already imported: run the real command.
    command = [sys.executable, "-m", "distdoctor", "lint", "--exit-zero"]
    assert subprocess.run([*command, "--no-cache", "train.py"], capture_output=True, timeout=60).returncode == 0
    assert not (tmp_path / ".distdoctor_cache").exists()
    assert subprocess.run([*command, "train.py"], capture_output=True, timeout=60).returncode == 0
    assert list((tmp_path / ".distdoctor_cache").glob(f"*/{CODE_FILE}"))
    # The findings do not depend on where the classes' methods were compiled.
    first = CliRunner().invoke(main, ["lint", "--no-cache", "--format", "json", "--exit-zero", "train.py"])
    (tmp_path / "train.py").write_text((tmp_path / "train.py").read_text() + "# changed\n")
    second = subprocess.run([*command, "--format", "json", "train.py"], capture_output=True, text=True, timeout=60)
    assert [f["code"] for f in json.loads(second.stdout)] == [f["code"] for f in json.loads(first.output)]
