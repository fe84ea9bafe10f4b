"""The built-in probe, for real: gloo ranks on CPU through torchrun (slow), and the launcher side's
pure diagnosis and report building on recorded evidence (fast, no torch needed).

One healthy run (through the CLI, JSON and --report) is shared by the assertions on passing checks;
each planted fault then has to make its check fail. Faults that touch different checks share a
launch. Every launch is bounded, and no process may outlive it.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest

from _probe_helpers import free_port, new_marker, run_cli, wait_for_no_processes
from distdoctor.probe.builtin.launcher import build_report, diagnose, run_builtin
from distdoctor.probe.builtin.protocol import GATHERED_FILE, progress_file
from distdoctor.probe.checks import CatalogError, checks_of
from distdoctor.probe.launch.torchrun import COLLECTIVE_TIMEOUT_ENV, LaunchResult, LaunchSpec
from distdoctor.probe.report import CheckResult

# Real launches: slow, and only where torch is installed (the ranks import it).
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

SPEC_KEYS = {"tool", "version", "mode", "backend", "world_size", "duration_s", "ok", "checks"}
CHECK_KEYS = {"id", "status", "summary", "ranks", "details"}


def by_id(report) -> dict[str, CheckResult]:
    return {check.id: check for check in report.checks}


def probe(*faults: str, timeout_s: float = 120.0, env: dict[str, str] | None = None, **kwargs):
    marker = new_marker()
    spec = LaunchSpec(nproc=2, backend="gloo", timeout_s=timeout_s, env={"DISTDOCTOR_TEST_MARKER": marker, **(env or {})})
    report = run_builtin(spec, faults=faults, **kwargs)
    assert wait_for_no_processes(marker) == [], "a rank outlived the probe"
    return report


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """One healthy run through the real CLI: (parsed JSON, report dir, exit status)."""
    report_dir = tmp_path_factory.mktemp("report")
    marker = new_marker()
    done = run_cli(["probe", "--nproc", "2", "--format", "json", "--report", str(report_dir), "--steps", "8"], marker)
    assert wait_for_no_processes(marker) == []
    return json.loads(done.stdout), report_dir, done.returncode


@pytest.mark.slow
@needs_torch
def test_healthy_run_passes_every_check_and_exits_zero(healthy):
    data, _, status = healthy
    statuses = {c["id"]: c["status"] for c in data["checks"]}
    assert list(statuses) == [check.id for check in checks_of("builtin", "torch")]
    # SyncBatchNorm has no CPU kernel: the check says so (skip) instead of claiming a pass.
    assert statuses.pop("syncbn") == ("skip" if data["backend"] == "gloo" else "pass")
    assert set(statuses.values()) == {"pass"}, statuses
    assert data["ok"] is True and status == 0


@pytest.mark.slow
@needs_torch
def test_json_has_exactly_the_spec_keys(healthy):
    data, _, _ = healthy
    assert set(data) == SPEC_KEYS
    assert data["tool"] == "distdoctor" and data["mode"] == "builtin" and data["backend"] == "gloo"
    assert data["world_size"] == 2 and data["duration_s"] > 0
    for check in data["checks"]:
        assert set(check) == CHECK_KEYS
        assert set(check["ranks"]) == {"0", "1"}, check["id"]  # evidence from every rank


@pytest.mark.slow
@needs_torch
def test_evidence_carries_the_measurements(healthy):
    data, _, _ = healthy
    checks = {c["id"]: c for c in data["checks"]}
    sizes = checks["bandwidth"]["details"]["sizes"]
    assert len(sizes) >= 3 and all(row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2, rel=1e-3) for row in sizes)
    conv = checks["convergence"]["details"]
    assert len(conv["reference_loss"]) == 8 and conv["mean_loss"][-1] < conv["mean_loss"][0]
    assert checks["param-sync"]["details"]["steps"] == 8
    assert checks["collectives"]["ranks"]["0"]["wrong_elements"] == 0
    assert "reduce_scatter" not in checks["collectives"]["details"]["skipped"]  # gloo runs it in torch 2.13
    assert checks["env"]["ranks"]["1"]["launcher"]["RANK"] == "1"
    assert "SyncBatchNorm" in checks["syncbn"]["summary"] and checks["syncbn"]["details"]["reason"]


@pytest.mark.slow
@needs_torch
def test_report_dir_holds_the_json_and_two_png_plots(healthy):
    data, report_dir, _ = healthy
    assert json.loads((report_dir / "report.json").read_text())["checks"] == data["checks"]
    for name in ("loss.png", "bandwidth.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@needs_torch
def test_independent_faults_each_fail_their_own_check():
    report = probe("sum-grads", "no-syncbn", "no-set-epoch", "corrupt-allreduce", "slow-link")
    checks = by_id(report)
    assert checks["collectives"].status == "fail" and "all_reduce" in checks["collectives"].summary
    assert checks["collectives"].ranks["0"]["failing"] and "broadcast" not in str(checks["collectives"].ranks["0"]["failing"])
    assert checks["bandwidth"].status == "warn"
    # Summed gradients stay equal across ranks: only the single-process reference catches them.
    assert checks["grad-sync"].status == "fail" and "summed" in checks["grad-sync"].summary
    assert "differ across ranks" not in checks["grad-sync"].summary
    assert checks["param-sync"].status == "pass"
    assert checks["convergence"].status == "fail" and "reference" in checks["convergence"].summary
    assert checks["syncbn"].status == "fail"
    assert checks["sampler"].status == "fail" and "set_epoch" in checks["sampler"].summary
    assert checks["env"].status == "pass" and not report.ok


@pytest.mark.slow
@needs_torch
def test_rank_dependent_init_fails_param_sync_at_step_zero():
    checks = by_id(probe("rank-init"))
    assert checks["param-sync"].status == "fail" and checks["param-sync"].details["first_divergent_step"] == 0
    assert checks["grad-sync"].status == "fail"
    assert checks["convergence"].status == "fail"


@pytest.mark.slow
@needs_torch
def test_skipped_allreduce_fails_grad_and_param_sync_after_step_one():
    checks = by_id(probe("no-allreduce"))
    assert checks["grad-sync"].status == "fail" and "differ across ranks" in checks["grad-sync"].summary
    assert checks["param-sync"].status == "fail" and checks["param-sync"].details["first_divergent_step"] == 1
    assert checks["collectives"].status == "pass"


@pytest.mark.slow
@needs_torch
def test_a_dead_rank_is_named_with_its_step_and_traceback():
    report = probe("rank-dies")
    checks = by_id(report)
    conv = checks["convergence"]
    assert conv.status == "error"
    assert "rank 1 died in convergence at step 2" in conv.summary
    assert "planted fault rank-dies" in conv.ranks["1"]["traceback"]
    # What ran before the death keeps its verdict.
    assert checks["grad-sync"].status == "pass" and checks["sampler"].status == "pass"
    assert not report.ok


@pytest.mark.slow
@needs_torch
def test_a_stalled_rank_is_named_within_the_timeout():
    # Collectives give up after 5 s, long before the wall clock: the stall is attributed, not timed out.
    report = probe("rank-stalls", timeout_s=120.0, env={COLLECTIVE_TIMEOUT_ENV: "5"})
    conv = by_id(report)["convergence"]
    assert conv.status == "error"
    assert "rank 1 stalled in convergence at step 2" in conv.summary and "rank 0" in conv.summary
    assert not conv.details["launch"]["timed_out"]
    assert report.duration_s < 120.0


def _result(**kwargs) -> LaunchResult:
    base = dict(returncode=1, timed_out=False, interrupted=False, duration_s=30.0, rank_exitcodes={}, rank_errors={},
                output="")
    return LaunchResult(**{**base, **kwargs})


def test_diagnosis_past_the_wall_clock_names_the_rank_behind():
    progress = {0: {"check": "convergence", "step": 4, "time": 2.0}, 1: {"check": "convergence", "step": 2, "time": 1.0}}
    failure = diagnose(_result(timed_out=True), progress)
    assert failure["rank"] == 1 and failure["check"] == "convergence"
    assert "wall clock; rank 1 is behind the others, in convergence at step 2" in failure["summary"]


def test_diagnosis_past_the_wall_clock_with_ranks_level_names_no_culprit():
    progress = {0: {"check": "sampler", "step": None}, 1: {"check": "sampler", "step": None}}
    failure = diagnose(_result(interrupted=True), progress)
    assert failure["rank"] is None and failure["check"] == "sampler"
    assert failure["summary"].startswith("interrupted; ranks 0, 1 stopped in sampler")


def test_diagnosis_prefers_the_rank_that_died_over_the_ones_that_lost_it():
    errors = {0: "Traceback ...\nRuntimeError: Connection closed by peer [127.0.0.1]:1234",
              1: "Traceback ...\nValueError: bad shape"}
    failure = diagnose(_result(rank_exitcodes={0: 1, 1: 1}, rank_errors=errors),
                       {0: {"check": "grad-sync", "step": 0}, 1: {"check": "grad-sync", "step": 0}})
    assert failure["rank"] == 1 and failure["summary"] == "rank 1 died in grad-sync at step 0: ValueError: bad shape"
    assert failure["ranks"]["1"]["exit"] == "exit code 1"


def test_a_crash_after_every_rank_finished_changes_no_verdict(tmp_path):
    # gloo can abort a rank in interpreter teardown after the results are written (SIGABRT).
    evidence = {"sampler": {"epochs": [[0, 1], [1, 0]]}}
    (tmp_path / GATHERED_FILE).write_text(json.dumps([evidence, {"sampler": {"epochs": [[2, 3], [3, 2]]}}]))
    for rank in (0, 1):
        progress_file(tmp_path, rank).write_text(json.dumps({"check": "done", "step": None}))
    spec = LaunchSpec(nproc=2, backend="gloo")
    crashed = _result(rank_exitcodes={1: -6})
    report = build_report(spec, ["sampler"], crashed, tmp_path, 1.0)
    assert [c.id for c in report.checks] == ["sampler"] and report.checks[0].status != "error"
    progress_file(tmp_path, 1).write_text(json.dumps({"check": "sampler", "step": None}))
    assert build_report(spec, ["sampler"], crashed, tmp_path, 1.0).checks[-1].id == "launch"


@pytest.mark.slow
@needs_torch
def test_two_nodes_on_one_machine_reach_one_verdict():
    endpoint = f"127.0.0.1:{free_port()}"
    marker = new_marker()
    reports = {}

    def node(rank: int) -> None:
        spec = LaunchSpec(nproc=1, backend="gloo", nnodes=2, node_rank=rank, rdzv_endpoint=endpoint, timeout_s=90,
                          env={"DISTDOCTOR_TEST_MARKER": marker})
        reports[rank] = run_builtin(spec, checks=["env", "grad-sync", "param-sync", "sampler"], steps=3)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    assert wait_for_no_processes(marker) == []
    first, second = reports[0], reports[1]
    assert first.world_size == second.world_size == 2
    assert [(c.id, c.status, c.summary) for c in first.checks] == [(c.id, c.status, c.summary) for c in second.checks]
    assert {c.status for c in first.checks} == {"pass"}
    assert set(by_id(first)["env"].ranks) == {"0", "1"}


def test_unknown_check_ids_and_faults_are_refused_before_any_launch():
    with pytest.raises(CatalogError, match="unknown check.* nope for the built-in probe; its checks: env, "):
        run_builtin(LaunchSpec(nproc=2, backend="gloo"), checks=["env", "nope"])
    with pytest.raises(CatalogError, match="unknown fault.* clip-before-sync"):
        run_builtin(LaunchSpec(nproc=2, backend="gloo"), faults=["clip-before-sync"])
