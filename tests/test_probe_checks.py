"""The catalog of runtime checks (`distdoctor.probe.checks`): one shape for every check, one
validation of check ids, planted faults that exist, verdicts on recorded evidence for Horovod as for
torchrun, and a probe half without import circles. Pure: no process is launched, no torch needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distdoctor.probe.builtin import horovod_worker
from distdoctor.probe.builtin.horovod import judge_builtin
from distdoctor.probe.builtin.protocol import FAULTS as TORCH_FAULTS
from distdoctor.probe.checks import (
    FRAMEWORKS, PROBES, CatalogError, Check, Evidence, all_checks, checks_of, select_checks, select_faults,
)
from distdoctor.probe.launch.torchrun import LaunchResult
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script.records import RankTrace, RunTrace

ROOT = Path(__file__).resolve().parents[1]
PLANTED = {"torch": set(TORCH_FAULTS), "horovod": set(horovod_worker.FAULTS) - {"none"}}
# Faults that exercise the launcher's diagnosis of a dead or stalled rank, not one check.
LAUNCH_FAULTS = {"rank-dies", "rank-stalls"}


# --- the catalog -------------------------------------------------------------------------------


def test_every_check_has_the_one_shape():
    checks = all_checks()
    assert {c.probe for c in checks} == set(PROBES)
    for check in checks:
        assert isinstance(check, Check)
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", check.id), check.id
        assert check.title and "\n" not in check.title and len(check.title) <= 120, check.id
        assert set(check.frameworks) <= set(FRAMEWORKS) and check.needs and check.faults, check.id
        assert callable(check.verdict), check.id
        module = __import__(check.verdict.__module__, fromlist=["ID"])
        assert module.CHECK is check and module.ID == check.id


def test_report_order_is_the_catalog_order():
    assert [c.id for c in checks_of("builtin", "torch")] == [
        "env", "collectives", "bandwidth", "grad-sync", "param-sync", "syncbn", "sampler", "convergence"]
    assert [c.id for c in checks_of("builtin", "horovod")] == ["env", "grad-sync", "param-sync", "convergence"]
    script = ["param-sync", "grad-sync", "epoch-shuffle", "data-shard", "desync", "loss", "hparams"]
    assert [c.id for c in checks_of("script", "torch")] == [c.id for c in checks_of("script", "horovod")] == script
    # The user's order does not change the report's.
    assert [c.id for c in select_checks("script", "torch", ["loss", "param-sync"])] == ["param-sync", "loss"]


def test_one_grad_sync_verdict_per_probe_for_both_frameworks():
    for probe in PROBES:
        (torch_check,) = [c for c in checks_of(probe, "torch") if c.id == "grad-sync"]
        (hvd_check,) = [c for c in checks_of(probe, "horovod") if c.id == "grad-sync"]
        assert torch_check is hvd_check


@pytest.mark.parametrize("probe,framework", [(p, f) for p in PROBES for f in FRAMEWORKS])
def test_unknown_ids_raise_one_error_naming_the_known_ones(probe, framework):
    with pytest.raises(CatalogError) as raised:
        select_checks(probe, framework, ["bogus"])
    message = str(raised.value)
    assert "bogus" in message and all(c.id in message for c in checks_of(probe, framework))
    assert select_checks(probe, framework, None) == select_checks(probe, framework, []) == checks_of(probe, framework)


def test_an_id_of_another_probe_says_where_it_lives():
    with pytest.raises(CatalogError, match=r"other probes have syncbn \(the built-in probe\)"):
        select_checks("script", "torch", ["syncbn"])


def test_faults_are_validated_with_the_same_error():
    assert select_faults(TORCH_FAULTS, ["rank-init"], "builtin", "torch") == ("rank-init",)
    with pytest.raises(CatalogError, match="unknown fault.* nope .* known: rank-init"):
        select_faults(TORCH_FAULTS, ["rank-init", "nope"], "builtin", "torch")


def test_a_check_without_a_planted_fault_or_a_rank_side_is_refused():
    def verdict(evidence):
        return CheckResult("x", "pass", "")

    with pytest.raises(TypeError, match="no planted fault"):
        Check("x", "t", "script", ("torch",), ("step",), verdict, (), 0)
    with pytest.raises(TypeError, match="run\\(ctx\\)"):
        Check("x", "t", "builtin", ("torch",), ("a",), verdict, ("f",), 0)
    with pytest.raises(TypeError, match="frameworks"):
        Check("x", "t", "script", ("jax",), ("step",), verdict, ("f",), 0)


def test_builtin_faults_are_planted_by_a_framework_the_check_runs_under():
    claimed: dict[str, set[str]] = {f: set() for f in FRAMEWORKS}
    for check in (c for c in all_checks() if c.probe == "builtin"):
        for fault in check.faults:
            frameworks = [f for f in check.frameworks if fault in PLANTED[f]]
            assert frameworks, f"{check.id}: no framework it runs under plants {fault}"
            for framework in frameworks:
                claimed[framework].add(fault)
    for framework, planted in PLANTED.items():
        assert planted - LAUNCH_FAULTS == claimed[framework], framework  # every planted fault fails a check


def _expected_statuses(path: Path) -> dict[str, str]:
    line = next(line for line in path.read_text().splitlines() if line.startswith("# probe-expect:"))
    return {m[1]: m[2] for m in re.finditer(r"([\w-]+)=(\w+)", line.split(":", 1)[1])}


def test_script_faults_are_fixtures_that_expect_the_check_to_fail():
    claimed = set()
    for check in (c for c in all_checks() if c.probe == "script"):
        for fixture in check.faults:
            path = ROOT / fixture
            assert path.is_file(), fixture
            assert _expected_statuses(path).get(check.id) == "fail", f"{fixture} does not expect {check.id}=fail"
            claimed.add((check.id, path.name))
    for path in sorted((ROOT / "fixtures" / "probe").glob("*.py")):
        for check_id, status in _expected_statuses(path).items():
            if status == "fail":
                assert (check_id, path.name) in claimed, f"{path.name} fails {check_id}, which does not name it"


def test_evidence_lacking_what_a_check_needs_is_an_error_not_a_crash():
    (grad,) = select_checks("builtin", "torch", ["grad-sync"])
    result = grad.judge(Evidence({0: _grad(), 1: {"checksum": [1.0, 2.0]}}, 2))
    assert result.status == "error" and result.summary.startswith("rank 1 recorded no matches_reference")
    (loss,) = select_checks("script", "torch", ["loss"])
    broken = loss.judge(object())  # a verdict that raises is reported, not propagated
    assert broken.status == "error" and "could not judge" in broken.summary


# --- built-in verdicts: the same checks for torchrun and horovodrun --------------------------------


def _grad(checksum=(1.0, 2.0), matches=True, ratio=1.0) -> dict:
    return {"checksum": list(checksum), "matches_reference": matches, "max_abs_diff_vs_reference": 1e-8 if matches else 0.3,
            "grad_norm_ratio_vs_reference": ratio}


def _hvd_rank(rank: int, *, params=(5.0, 6.0), grad=None, state=(0.5, 0.7), lr=0.04, losses=None) -> dict:
    reference = [1.0, 0.8, 0.6, 0.5]
    return {
        "rank": rank, "size": 2,
        "env": {"torch": "2.13.0", "device": "cpu", "world_size": 2, "horovod": "0.28.1", "nccl_env": {}},
        "grad-sync": grad or _grad(),
        "param-sync": {"checksums": [list(params), [7.0, 8.0]], "optimizer_state": list(state) if state else None},
        "convergence": {"losses": losses or reference, "reference_losses": reference, "lr": lr, "scaled_lr": 0.04},
    }


def _judge(*ranks: dict):
    launch = LaunchResult(0, False, False, 1.0, {0: 0, 1: 0}, {}, "")
    return {c.id: c for c in judge_builtin(dict(enumerate(ranks)), len(ranks), launch)}


def test_horovod_healthy_evidence_passes_every_check():
    checks = _judge(_hvd_rank(0), _hvd_rank(1))
    assert {i: c.status for i, c in checks.items()} == dict.fromkeys(["env", "grad-sync", "param-sync", "convergence"], "pass")
    assert "Horovod 0.28.1" in checks["env"].summary
    assert "parameters and optimizer state equal" in checks["param-sync"].summary


def test_horovod_faults_fail_their_checks_with_horovod_words():
    no_broadcast = _judge(_hvd_rank(0), _hvd_rank(1, params=(9.0, 1.0), state=None))["param-sync"]
    assert no_broadcast.status == "fail" and "hvd.broadcast_parameters called?" in no_broadcast.summary
    no_state = _judge(_hvd_rank(0), _hvd_rank(1, state=None))["param-sync"]
    assert no_state.status == "fail" and "broadcast_optimizer_state" in no_state.summary
    clipped = _judge(_hvd_rank(0, grad=_grad(matches=False)), _hvd_rank(1, grad=_grad(matches=False)))["grad-sync"]
    assert clipped.status == "fail" and "single-process reference" in clipped.summary
    assert clipped.details["when"] == "after synchronize(), step 0"
    apart = _judge(_hvd_rank(0), _hvd_rank(1, grad=_grad(checksum=(1.5, 2.0))))["grad-sync"]
    assert apart.status == "fail" and "after synchronize()" in apart.summary
    unscaled = _judge(_hvd_rank(0, lr=0.02, losses=[1.0, 0.9, 0.85, 0.8]),
                      _hvd_rank(1, lr=0.02, losses=[1.0, 0.9, 0.85, 0.8]))["convergence"]
    assert unscaled.status == "fail" and "not the scaled lr 0.04" in unscaled.summary


def test_horovod_ranks_that_disagree_on_the_size_fail_env():
    odd = _hvd_rank(1)
    odd["env"] = {**odd["env"], "world_size": 1}
    env = _judge(_hvd_rank(0), odd)["env"]
    assert env.status == "fail" and "hvd.size()" in env.summary


def test_a_horovod_rank_that_left_no_evidence_makes_every_check_report_it():
    launch = LaunchResult(1, False, False, 1.0, {0: 0, 1: 1}, {1: "Traceback ...\nRuntimeError: x"}, "", "horovodrun")
    results = judge_builtin({0: _hvd_rank(0)}, 2, launch)
    assert [c.status for c in results] == ["error"] * 4
    assert all("rank 1 did not finish" in c.summary and "RuntimeError" in c.ranks["1"]["traceback"] for c in results)


def test_summed_gradients_are_named_for_either_framework():
    for framework in FRAMEWORKS:
        (grad,) = select_checks("builtin", framework, ["grad-sync"])
        result = grad.judge(Evidence({r: _grad(matches=False, ratio=2.0) for r in (0, 1)}, 2, framework))
        assert result.status == "fail" and "summed, not averaged?" in result.summary


# --- script verdicts: Horovod facts come with the trace ----------------------------------------


def _script_trace(framework: str, param0: dict[int, float], extra: dict[int, list[dict]] | None = None) -> RunTrace:
    ranks = {}
    for rank, first in param0.items():
        trace = RankTrace(rank)
        trace.add({"e": "start", "pid": 100 + rank})
        trace.add({"e": "opt", "opt": 0, "names": ["fc.weight"], "ddp": None})
        for n in (1, 2, 3):
            trace.add({"e": "step", "opt": 0, "n": n, "bwd": n, "coll": 0, "site": "/job/train.py:30", "loss": [1.0 / n],
                       "grad": [[1.0, 2.0]], "param": [[first + n, first + n]],
                       "param0": [[first, first]] if n == 1 else None})
        for record in (extra or {}).get(rank, []):
            trace.add(record)
        ranks[rank] = trace
    return RunTrace(script="/job/train.py", world_size=len(ranks), steps_requested=3, ranks=ranks, framework=framework)


def _script_check(check_id: str, framework: str) -> Check:
    (check,) = select_checks("script", framework, [check_id])
    return check


def test_script_param_sync_under_horovod_says_whether_broadcast_parameters_ran():
    never = _script_check("param-sync", "horovod").judge(_script_trace("horovod", {0: 1.0, 1: 2.0}))
    assert never.status == "fail" and never.details["step"] == 0
    assert "hvd.broadcast_parameters(model.state_dict(), root_rank=0) was never called" in never.summary
    broadcast = {r: [{"e": "hvd", "what": "broadcast_parameters", "site": "/job/train.py:12", "step": 0}] for r in (0, 1)}
    after = _script_check("param-sync", "horovod").judge(_script_trace("horovod", {0: 1.0, 1: 2.0}, broadcast))
    assert "changed on a rank after hvd.broadcast_parameters" in after.summary and after.details["broadcast_ranks"] == [0, 1]
    ddp = _script_check("param-sync", "torch").judge(_script_trace("torch", {0: 1.0, 1: 2.0}))
    assert "initialised per rank and never broadcast" in ddp.summary and "hvd" not in ddp.summary


def test_script_grad_sync_under_horovod_fails_on_clipping_before_synchronize():
    edit = {"e": "hvd", "what": "unsynchronized_edit", "op": "clip_grad_norm_", "site": "/job/train.py:41", "step": 0,
            "reducing": 2}
    records = {0: [edit], 1: [edit]}
    result = _script_check("grad-sync", "horovod").judge(_script_trace("horovod", {0: 1.0, 1: 1.0}, records))
    assert result.status == "fail" and result.summary.startswith("clip_grad_norm_ at train.py:41 changed gradients")
    assert result.details["checksum_verdict"]["status"] == "pass"  # the checksums alone looked fine
    assert result.ranks["1"]["unsynchronized_edits"] == 1
    healthy = _script_check("grad-sync", "horovod").judge(_script_trace("horovod", {0: 1.0, 1: 1.0}))
    assert healthy.status == "pass"
