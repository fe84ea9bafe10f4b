"""`distdoctor probe` options, dispatch, text output and exit status, without launching ranks
(the real launches are in test_probe_builtin.py), plus the launcher-side verdicts on recorded evidence."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from distdoctor.probe import cli as cli_probe
from distdoctor.cli import main
from distdoctor.probe.render import render_text
from distdoctor.probe.report import CheckResult, Report
from distdoctor.probe.checks import Evidence
from distdoctor.probes.builtin import bandwidth, env, sampler

PASSING = CheckResult("grad-sync", "pass", "equal across 2 ranks", {"0": {"max_abs_diff_vs_reference": 1e-8}, "1": {}})
FAILING = CheckResult("param-sync", "fail", "parameters differ across ranks after step 1: rank 1 differs",
                      {"0": {"step0": [1.0, 2.0]}, "1": {"traceback": "Traceback (most recent call last):\n  ...\nRuntimeError: x"}})


def report(*checks: CheckResult) -> Report:
    return Report("builtin", "gloo", 2, 1.5, tuple(checks))


@pytest.fixture()
def no_gpus(monkeypatch):
    monkeypatch.setattr(cli_probe, "count_visible_gpus", lambda allow_torch: 0)


@pytest.fixture()
def dispatched(monkeypatch, no_gpus):
    """Replace the probe run with a canned report; record what the CLI asked for."""
    calls = []

    def fake(script, script_args, spec, **kwargs):
        calls.append({"script": script, "script_args": list(script_args), "spec": spec, **kwargs})
        return fake.report

    fake.report = report(PASSING)
    monkeypatch.setattr(cli_probe, "dispatch", fake)
    fake.calls = calls
    return fake


def invoke(*args: str):
    return CliRunner().invoke(main, ["probe", *args])


def test_the_cli_and_launcher_modules_do_not_import_torch(tmp_path):
    # A torch that raises on import proves it whether or not torch is installed here.
    stub = tmp_path / "torch"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('distdoctor imported torch')\n")
    code = ("import sys, distdoctor.cli, distdoctor.probe.cli, distdoctor.probe.builtin.launcher, "
            "distdoctor.probe.builtin.horovod, distdoctor.probe.script.launcher, distdoctor.probe.plots\n"
            "from distdoctor.probe.checks import all_checks\n"
            "assert len(all_checks()) > 10\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    broken = subprocess.run([sys.executable, "-c", "import distdoctor.probe.builtin.rank"], capture_output=True,
                            text=True, env=env)
    assert "distdoctor imported torch" in broken.stderr  # the stub is the torch that gets imported


def test_default_without_gpu_is_two_gloo_ranks(dispatched):
    result = invoke()
    assert result.exit_code == 0, result.output
    spec = dispatched.calls[0]["spec"]
    assert (spec.nproc, spec.backend, spec.nnodes, spec.rdzv_endpoint) == (2, "gloo", 1, None)
    assert dispatched.calls[0]["script"] is None


def test_multi_node_options_reach_the_launch_spec(dispatched):
    invoke("--nproc", "3", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "host:29400", "--timeout", "30")
    spec = dispatched.calls[0]["spec"]
    assert (spec.nproc, spec.nnodes, spec.node_rank, spec.rdzv_endpoint, spec.timeout_s) == (3, 2, 1, "host:29400", 30.0)


def test_script_and_its_arguments_after_the_double_dash(dispatched):
    invoke("train.py", "--nproc", "2", "--steps", "5", "--", "--lr", "0.1")
    call = dispatched.calls[0]
    assert call["script"] == "train.py" and call["script_args"] == ["--lr", "0.1"] and call["steps"] == 5


def test_gpus_asked_but_none_visible_exits_2_saying_what_to_run(no_gpus):
    result = invoke("--gpus", "2")
    assert result.exit_code == 2
    assert "0 visible" in result.output and "--nproc 2" in result.output


def test_fewer_gpus_than_asked_suggests_the_count_seen(monkeypatch):
    monkeypatch.setattr(cli_probe, "count_visible_gpus", lambda allow_torch: 1)
    result = invoke("--gpus", "4")
    assert result.exit_code == 2 and "--gpus 1" in result.output and "1 visible" in result.output


def test_gpus_seen_by_default_mean_nccl_on_all_of_them(monkeypatch, dispatched):
    monkeypatch.setattr(cli_probe, "count_visible_gpus", lambda allow_torch: 4)
    invoke()
    invoke("--gpus", "2")
    invoke("--nproc", "2")
    specs = [call["spec"] for call in dispatched.calls]
    assert [(s.nproc, s.backend) for s in specs] == [(4, "nccl"), (2, "nccl"), (2, "gloo")]


def test_gpus_and_nproc_together_are_a_usage_error(dispatched):
    assert invoke("--gpus", "1", "--nproc", "2").exit_code == 2


def test_unknown_check_is_a_usage_error(dispatched):
    result = invoke("--checks", "env,bogus")
    assert result.exit_code == 2 and "bogus" in result.output and not dispatched.calls
    assert "env, collectives, bandwidth" in result.output  # the ids it knows


def test_unknown_script_check_is_a_usage_error_before_anything_runs(dispatched, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    result = invoke(str(script), "--checks", "grad-sync,bogus")
    assert result.exit_code == 2 and not dispatched.calls
    assert "unknown check(s) bogus for the script probe" in result.output and "epoch-shuffle" in result.output
    assert invoke(str(script), "--checks", "syncbn").exit_code == 2  # a built-in check, not a script one
    assert invoke(str(script), "--checks", "grad-sync,desync").exit_code == 0
    assert dispatched.calls[-1]["checks"] == ["grad-sync", "desync"]


def test_horovod_checks_and_faults_are_validated_like_the_others(dispatched):
    result = invoke("--framework", "horovod", "--checks", "syncbn")
    assert result.exit_code == 2 and "Horovod built-in probe" in result.output and not dispatched.calls
    result = invoke("--framework", "horovod", "--inject", "no-set-epoch")
    assert result.exit_code == 2 and "unknown fault(s) no-set-epoch" in result.output
    assert invoke("--framework", "horovod", "--inject", "unscaled-lr").exit_code == 0
    assert invoke("--inject", "unscaled-lr").exit_code == 2  # a Horovod fault, not a torchrun one
    assert invoke("train.py", "--inject", "rank-init").exit_code == 2  # nothing to plant in a script


def test_exit_status_follows_the_checks(dispatched):
    assert invoke().exit_code == 0
    dispatched.report = report(PASSING, FAILING)
    assert invoke().exit_code == 1
    dispatched.report = report(CheckResult("launch", "error", "torchrun could not start", {}, {}))
    assert invoke().exit_code == 2
    dispatched.report = report(CheckResult("convergence", "error", "interrupted", {}, {"launch": {"interrupted": True}}))
    assert invoke().exit_code == 130


def test_json_output_is_the_report(dispatched):
    dispatched.report = report(PASSING, FAILING)
    data = json.loads(invoke("--format", "json").output)
    assert data["ok"] is False and [c["id"] for c in data["checks"]] == ["grad-sync", "param-sync"]


def test_text_table_has_one_row_per_check_then_evidence_per_rank():
    text = render_text(report(PASSING, FAILING))
    lines = text.splitlines()
    assert "PROBLEMS FOUND" in lines[0]
    assert any(line.startswith("grad-sync") and "PASS" in line and "equal across 2 ranks" in line for line in lines)
    assert any(line.startswith("param-sync") and "FAIL" in line for line in lines)
    assert "    rank 1: traceback=RuntimeError: x  [3 lines]" in lines  # a traceback shows its last line


def test_horovod_missing_exits_2_pointing_to_the_readme(no_gpus, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "horovod" else real_find_spec(name, *a))
    result = invoke("--framework", "horovod")
    assert result.exit_code == 2 and "Horovod is not installed" in result.output and "Traceback" not in result.output


def test_missing_probe_module_exits_2_not_a_traceback(no_gpus, monkeypatch):
    real_import = cli_probe.importlib.import_module

    def without_script_probe(name, *args):
        if name == "distdoctor.probe.script.launcher":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(cli_probe.importlib, "import_module", without_script_probe)
    result = invoke("train.py")
    assert result.exit_code == 2 and "not available" in result.output


# --- verdicts on recorded evidence (what a GPU run would produce, checked on CPU) ------------------

def _env_rank(host: str, device: str, uuid: str | None, **extra) -> dict:
    return {"host": host, "torch": "2.13.0", "cuda": "12.4", "nccl": "2.21.5", "device": device, "gpu_uuid": uuid,
            "nccl_env": {}, **extra}


def test_env_fails_when_two_ranks_share_one_gpu():
    shared = env.verdict(Evidence({0: _env_rank("a", "cuda:0", "GPU-1"), 1: _env_rank("a", "cuda:0", "GPU-1")}, 2))
    assert shared.status == "fail" and "ranks 0, 1 share one GPU" in shared.summary
    apart = env.verdict(Evidence({0: _env_rank("a", "cuda:0", "GPU-1"), 1: _env_rank("b", "cuda:0", "GPU-2")}, 2))
    assert apart.status == "pass"


def test_env_fails_on_mixed_builds_and_warns_on_disabled_transports():
    mixed = env.verdict(Evidence({0: _env_rank("a", "cuda:0", "1"), 1: _env_rank("a", "cuda:1", "2", torch="2.4.0")}, 2))
    assert mixed.status == "fail" and "different torch versions" in mixed.summary
    slow = env.verdict(Evidence({0: _env_rank("a", "cuda:0", "1", nccl_env={"NCCL_P2P_DISABLE": "1"}),
                                 1: _env_rank("a", "cuda:1", "2")}, 2))
    assert slow.status == "warn" and "NCCL_P2P_DISABLE=1" in slow.summary


def test_bandwidth_uses_the_nccl_tests_bus_factor_and_warns_when_absurd():
    assert bandwidth.bus_factor(2) == 1.0 and bandwidth.bus_factor(8) == pytest.approx(1.75)
    rows = lambda us: {"sizes": [{"bytes": 1 << 20, "time_us": us}]}  # noqa: E731
    fast = bandwidth.verdict(Evidence({r: rows(100.0) for r in range(8)}, 8))
    assert fast.status == "pass"
    assert fast.details["sizes"][0]["busbw_GBps"] == pytest.approx((1 << 20) / 100e-6 / 1e9 * 1.75, rel=1e-3)
    slow = bandwidth.verdict(Evidence({0: rows(100.0), 1: rows(1e6)}, 2))  # the slowest rank sets the time
    assert slow.status == "warn"


def test_sampler_verdict_catches_overlapping_shards():
    size = sampler.dataset_size(2)
    overlap = {r: {"epochs": [list(range(size // 2 + 1)), list(range(size // 2 + 1))[::-1]]} for r in (0, 1)}
    result = sampler.verdict(Evidence(overlap, 2))
    assert result.status == "fail" and "on no rank" in result.summary and "several ranks" in result.summary


@pytest.fixture()
def no_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(cli_probe.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))


def test_without_torch_the_probe_says_so_instead_of_failing_to_launch(no_torch, no_gpus):
    for args in (["--nproc", "2"], ["train.py"]):
        result = CliRunner().invoke(main, ["probe", *args])
        assert result.exit_code == 2
        assert "torch is not installed" in result.output and "distdoctor[probe]" in result.output


def test_usage_errors_come_before_torch_missing(no_torch, no_gpus, monkeypatch):
    result = invoke("--checks", "bogus")
    assert result.exit_code == 2 and "bogus" in result.output and "torch is not installed" not in result.output
    result = invoke("--gpus", "1", "--nproc", "2")
    assert result.exit_code == 2 and "not both" in result.output
    monkeypatch.setattr("distdoctor.probe.launch.horovodrun.horovod_missing_reason", lambda: "Horovod is not installed")
    result = invoke("--framework", "horovod")
    assert result.exit_code == 2 and "Horovod is not installed" in result.output and "torch is not" not in result.output
    result = invoke("--framework", "horovod", "--inject", "no-broadcast,unscaled-lr")
    assert result.exit_code == 2 and "one fault at a time" in result.output
