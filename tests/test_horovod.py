"""Horovod end to end: the built-in probe and the script probe under `horovodrun -np 2 --gloo`.

Without Horovod, only the tests of what the user is told run (Horovod's absence is simulated);
every real run is skipped with the reason and the command that installs it.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from _probe_helpers import new_marker, wait_for_no_processes
from distdoctor.cli import main as cli
from distdoctor.probe.builtin import horovod as horovod_probe
from distdoctor.probe.checks import CatalogError
from distdoctor.probe.launch import horovodrun
from distdoctor.probe.launch.torchrun import LaunchSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
HVD_FIXTURES = sorted(FIXTURES.glob("hvd_*.py"))
INSTALL_REASON = "Horovod is not installed: run scripts/install-horovod.sh"


@pytest.fixture
def horovod():
    """Skip, with the install command, where horovod.torch cannot be imported."""
    return pytest.importorskip("horovod.torch", reason=INSTALL_REASON)


def by_id(report):
    return {check.id: check for check in report.checks}


def expected_statuses(path: Path) -> dict[str, str]:
    """The `# probe-expect: check=status ...` header of a probe fixture."""
    header = re.search(r"^# probe-expect:(.*)$", path.read_text(), re.MULTILINE)
    assert header, f"{path.name} has no '# probe-expect:' line"
    return dict(item.split("=", 1) for item in header.group(1).split())


# --- Horovod absent (simulated): clear message, exit 2 -----------------------------------------


@pytest.fixture
def no_horovod(monkeypatch):
    monkeypatch.setattr(horovodrun, "horovod_missing_reason", lambda: "Horovod is not installed")


@pytest.mark.parametrize(
    "args",
    [["--framework", "horovod"], [str(FIXTURES / "hvd_healthy.py"), "--framework", "horovod"]],
    ids=["builtin", "script"],
)
def test_without_horovod_the_cli_names_the_install_script(no_horovod, args):
    result = CliRunner().invoke(cli, ["probe", *args])
    assert result.exit_code == 2, result.output
    assert "Horovod is not installed" in result.output
    assert "scripts/install-horovod.sh" in result.output


def test_a_script_that_imports_horovod_is_probed_with_horovod(no_horovod):
    result = CliRunner().invoke(cli, ["probe", str(FIXTURES / "hvd_no_broadcast.py")])
    assert result.exit_code == 2, result.output
    assert "scripts/install-horovod.sh" in result.output


def test_the_framework_follows_the_script_imports(tmp_path):
    from distdoctor.probe.script.framework import script_framework

    for path in HVD_FIXTURES:
        assert script_framework(str(path)) == "horovod", path.name
    plain = tmp_path / "ddp.py"
    plain.write_text("import torch.distributed as dist\nhorovod = 'not an import'\n")
    assert script_framework(str(plain)) == "torch"


def test_without_horovod_the_python_api_raises_a_launch_error(no_horovod):
    with pytest.raises(horovodrun.HorovodUnavailable, match="scripts/install-horovod.sh"):
        horovod_probe.run_builtin_horovod()


def test_the_missing_reason_looks_at_files_only(monkeypatch):
    monkeypatch.setattr(horovodrun.importlib.util, "find_spec", lambda name: None)
    assert horovodrun.horovod_missing_reason() == "Horovod is not installed"


def test_unknown_fault_and_check_are_usage_errors():
    with pytest.raises(CatalogError, match="unknown fault.* no-such-fault for the Horovod built-in probe"):
        horovod_probe.run_builtin_horovod(fault="no-such-fault")
    with pytest.raises(CatalogError, match="unknown check.* syncbn for the Horovod built-in probe"):
        horovod_probe.run_builtin_horovod(checks=["syncbn"])


def test_the_horovodrun_command_is_one_a_user_can_run(monkeypatch):
    monkeypatch.setattr(horovodrun, "horovodrun_path", lambda: "/usr/bin/horovodrun")
    cmd = horovodrun.horovodrun_command(2, ["train.py", "--lr", "0.1"])
    assert cmd[:6] == ["/usr/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
    assert cmd[-4:] == [sys.executable, "train.py", "--lr", "0.1"]


def test_a_horovodrun_launch_names_horovodrun_when_it_fails():
    # The result type is torchrun's; its messages name the launcher that ran (and give no torchrun hint).
    from distdoctor.probe.launch.torchrun import LaunchResult

    base = {"returncode": 1, "timed_out": False, "interrupted": False, "duration_s": 15.04, "rank_exitcodes": {},
            "rank_errors": {}, "output": "Address already in use", "launcher": "horovodrun"}
    assert LaunchResult(**base).failure_message() == "horovodrun exited with status 1"
    assert LaunchResult(**{**base, "rank_exitcodes": {0: 0, 1: -9}}).failure_message() == (
        "horovodrun failed: rank 1 exited with signal 9 (SIGKILL)")
    assert LaunchResult(**{**base, "timed_out": True}).failure_message() == (
        "horovodrun ran past its wall-clock limit after 15.0 s: every rank was stopped")


# --- the Horovod worker's evidence fits the checks, without Horovod -----------------------------

# A stand-in for horovod.torch: each rank trains alone (no collective), enough to run the worker.
STUB_HOROVOD = textwrap.dedent("""
    import contextlib, os
    def init(): pass
    def rank(): return int(os.environ["STUB_RANK"])
    def size(): return int(os.environ["STUB_SIZE"])
    def local_rank(): return rank()
    def DistributedOptimizer(optimizer, named_parameters=None, **kwargs):
        optimizer.synchronize = lambda: None
        optimizer.skip_synchronize = contextlib.nullcontext
        return optimizer
    def broadcast_parameters(state, root_rank=0): pass
    def broadcast_optimizer_state(optimizer, root_rank=0): pass
""")


@pytest.mark.slow
def test_the_worker_records_what_every_horovod_check_needs(tmp_path):
    pytest.importorskip("torch")
    import os
    import subprocess

    from distdoctor.probe.builtin.horovod import WORKER_MODULE, _read_evidence, judge_builtin
    from distdoctor.probe.launch.torchrun import LaunchResult

    (tmp_path / "stub" / "horovod" / "torch").mkdir(parents=True)
    (tmp_path / "stub" / "horovod" / "__init__.py").write_text("__version__ = 'stub'\n")
    (tmp_path / "stub" / "horovod" / "torch" / "__init__.py").write_text(STUB_HOROVOD)
    out = tmp_path / "out"
    out.mkdir()
    for rank in (0, 1):
        env = {**os.environ, "STUB_RANK": str(rank), "STUB_SIZE": "2",
               "PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", WORKER_MODULE, "--out", str(out), "--steps", "4", "--fault",
                        "unscaled-lr"], env=env, check=True, capture_output=True, timeout=120)
    evidence = _read_evidence(out, 2)
    results = judge_builtin(evidence, 2, LaunchResult(0, False, False, 1.0, {0: 0, 1: 0}, {}, ""))
    assert [c.id for c in results] == ["env", "grad-sync", "param-sync", "convergence"]
    assert all(c.status in ("pass", "fail") for c in results), {c.id: c.summary for c in results}
    checks = {check.id: check for check in results}
    # Alone, each rank keeps its own gradient and its own rank-dependent start: the checks say so.
    assert checks["param-sync"].status == "fail" and "hvd.broadcast_parameters" in checks["param-sync"].summary
    assert checks["env"].status == "pass" and len(checks["convergence"].details["loss_per_rank"]["0"]) == 4
    assert evidence[0]["convergence"]["lr"] == 0.02 and evidence[0]["convergence"]["scaled_lr"] == 0.04


# --- built-in probe, for real ------------------------------------------------------------------

# Each planted fault and the verdicts it must produce (checks not named may go either way).
BUILTIN_FAULTS = {
    "none": {"env": "pass", "grad-sync": "pass", "param-sync": "pass", "convergence": "pass"},
    "no-broadcast": {"param-sync": "fail"},
    "unscaled-lr": {"grad-sync": "pass", "param-sync": "pass", "convergence": "fail"},
    "clip-before-sync": {"grad-sync": "fail"},
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(BUILTIN_FAULTS))
def test_builtin_probe_finds_each_planted_fault(horovod, fault, monkeypatch):
    marker = new_marker()
    monkeypatch.setenv("DISTDOCTOR_TEST_MARKER", marker)
    report = horovod_probe.run_builtin_horovod(nproc=2, steps=20, timeout_s=120, fault=fault)
    assert wait_for_no_processes(marker) == [], "a rank outlived the probe"
    checks = by_id(report)
    got = {check_id: checks[check_id].status for check_id in BUILTIN_FAULTS[fault]}
    assert got == BUILTIN_FAULTS[fault], {c.id: c.summary for c in report.checks}
    assert report.ok == (fault == "none")
    assert report.to_dict()["framework"] == "horovod"


@pytest.mark.slow
def test_unscaled_lr_is_named_in_the_convergence_finding(horovod):
    report = horovod_probe.run_builtin_horovod(nproc=2, steps=20, timeout_s=120, fault="unscaled-lr",
                                               checks=["convergence"])
    (convergence,) = report.checks
    assert "not the scaled lr" in convergence.summary
    assert set(convergence.details["loss_per_rank"]) == {"0", "1"}


@pytest.mark.slow
def test_cli_builtin_horovod_json(horovod):
    result = CliRunner().invoke(cli, ["probe", "--framework", "horovod", "--format", "json", "--inject", "no-broadcast"])
    assert result.exit_code == 1, result.output
    assert '"param-sync"' in result.output and '"fail"' in result.output


# --- script probe, for real --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", HVD_FIXTURES, ids=[p.name for p in HVD_FIXTURES])
def test_script_probe_verdicts_match_the_fixture(horovod, path, tmp_path):
    from distdoctor.probe.script.launcher import run_script_probe

    marker = new_marker()
    spec = LaunchSpec(nproc=2, backend="gloo", timeout_s=120, env={"DISTDOCTOR_TEST_MARKER": marker})
    report = run_script_probe(str(path), [], spec, steps=10, framework="horovod", log_file=str(tmp_path / "log"))
    assert wait_for_no_processes(marker) == [], "a rank outlived the probe"
    checks = by_id(report)
    expected = expected_statuses(path)
    got = {check_id: checks[check_id].status for check_id in expected}
    assert got == expected, {c.id: c.summary for c in report.checks}


@pytest.mark.slow
def test_clipping_before_synchronize_names_the_line(horovod):
    from distdoctor.probe.script.launcher import run_script_probe

    path = FIXTURES / "hvd_clip_before_sync.py"
    report = run_script_probe(str(path), [], LaunchSpec(2, "gloo", timeout_s=120), steps=5, framework="horovod",
                              log_file="/dev/null")
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "# expect: grad-sync" in text)
    assert f"hvd_clip_before_sync.py:{line}" in by_id(report)["grad-sync"].summary


# --- bounded launch ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stalled_rank_is_stopped_with_everything_horovodrun_started(horovod, tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch
        import horovod.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            time.sleep(600)  # rank 0 waits in the all-reduce below
        hvd.allreduce(torch.ones(3))
    """))
    marker = new_marker()
    result = horovodrun.launch_horovod(2, [str(script)], timeout_s=15,
                                          env={"DISTDOCTOR_TEST_MARKER": marker,
                                               "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"})
    assert result.timed_out
    assert "wall-clock limit" in result.failure_message()
    assert wait_for_no_processes(marker) == [], "a rank outlived the launch"
