"""The script probe's verdicts on sharded layouts, hyperparameters, the probe's own failures and
the false alarms of issue 13, from recorded evidence (no launch, no torch): each verdict is shown to
fail on the planted difference and to pass without it. The real runs are the fixtures of
fixtures/probe (test_probe_script.py) and the HSDP test at the end (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from distdoctor.cli import main
from distdoctor.probe import cli as cli_probe
from distdoctor.probe.render import render_text
from distdoctor.probe.report import CheckResult, Report
from distdoctor.probe.script import layouts, protocol
from distdoctor.probe.script.launcher import unobserved
from distdoctor.probe.script.records import RankTrace, RunTrace, first_divergence
from distdoctor.probes.script import data_shard, epoch_shuffle, grad_sync, hparams, loss, param_sync

HSDP_MESH = {"ranks": [[0, 1], [2, 3]], "names": ["replicate", "shard"]}


def _hsdp_record(rank: int, placements: str = "R,S0") -> dict[str, Any]:
    coord = [rank // 2, rank % 2]
    return {"e": protocol.OPTIMIZER, "opt": 0, "cls": "AdamW", "site": "/w/train.py:9", "names": ["w", "b"],
            "ddp": None, "spec": [[0, placements], [0, placements]], "meshes": [{**HSDP_MESH, "coord": coord}]}


def _trace(per_rank: dict[int, list[dict[str, Any]]], script: str = "/w/train.py") -> RunTrace:
    ranks = {}
    for rank, records in per_rank.items():
        t = RankTrace(rank)
        for record in records:
            t.add(record)
        ranks[rank] = t
    return RunTrace(script=script, world_size=len(ranks), steps_requested=3, ranks=ranks)


def _step(n: int, param: list[Any], grad: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"e": protocol.STEP, "opt": 0, "n": n, "bwd": n, "coll": 0, "dfwd": 0, "site": "/w/train.py:20",
            "grad": grad if grad is not None else param, "param": param, "loss": [1.0 / n], "fwd": [], **extra}


# --- layouts: who must agree --------------------------------------------------------------------


def test_replicas_of_an_hsdp_mesh_are_compared_and_shards_are_not():
    records = {r: _hsdp_record(r) for r in range(4)}
    assert layouts.comparison_groups(records, 0) == [[0, 2], [1, 3]]
    fsdp = {r: {"spec": [[0, "S0"]], "meshes": [{"ranks": [0, 1], "coord": [r]}]} for r in range(2)}
    assert layouts.comparison_groups(fsdp, 0) == []
    assert layouts.describe(fsdp, 0) == "S0 on a mesh of 2"
    partial = {r: _hsdp_record(r, "P,S0") for r in range(4)}
    assert layouts.comparison_groups(partial, 0) == []
    plain = {r: {"names": ["w"]} for r in range(3)}
    assert layouts.comparison_groups(plain, 0) == [[0, 1, 2]]


def test_a_replica_that_drifts_is_found_between_its_replicas_only():
    # rank 2 is rank 0's HSDP replica; ranks 1 and 3 hold other shards and may differ from 0 and 2.
    shard_a, shard_b, drifted = [1.0, 2.0], [5.0, 6.0], [1.5, 2.0]
    values = {0: shard_a, 1: shard_b, 2: shard_a, 3: shard_b}
    healthy = _trace({r: [_hsdp_record(r), _step(1, [values[r], values[r]])] for r in range(4)})
    divergence, compared = first_divergence(healthy, ("param",))
    assert divergence is None and compared == 1
    values[2] = drifted
    broken = _trace({r: [_hsdp_record(r), _step(1, [values[r], values[r]])] for r in range(4)})
    divergence, _ = first_divergence(broken, ("param",))
    assert divergence is not None and divergence.params == ("w", "b") and divergence.groups == [[0], [2]]
    result = param_sync.verdict(broken)
    assert result.status == "fail" and "R,S0 on a 2x2 mesh" in result.summary and result.details["ranks"] == [2]


def test_every_parameter_sharded_once_is_said_not_compared_instead_of_passing():
    def record(rank: int) -> dict[str, Any]:
        return {"e": protocol.OPTIMIZER, "opt": 0, "cls": "AdamW", "site": "/w/t.py:1", "names": ["w"],
                "spec": [[0, "S0"]], "meshes": [{"ranks": [0, 1], "names": [], "coord": [rank]}]}

    trace = _trace({r: [record(r), _step(1, [[float(r + 1), 1.0]])] for r in range(2)})
    result = param_sync.verdict(trace)
    assert result.status == "skip" and "sharded with one copy" in result.summary
    assert result.details["not_compared"] == ["w"]
    grads = grad_sync.verdict(trace)
    assert grads.status == "pass" and "no gradient could be compared" in grads.summary
    nan = _trace({0: [record(0), _step(1, [[1.0, 1.0]])], 1: [record(1), _step(1, [[2.0, 1.0]], [[float("nan"), 1.0]])]})
    bad = grad_sync.verdict(nan)
    assert bad.status == "fail" and bad.details["ranks"] == [1] and "not finite" in bad.summary


def test_a_tensor_parallel_group_is_not_expected_to_see_different_batches():
    same = [[3.0, 4.0]]
    records = {r: [{"e": protocol.TENSOR_PARALLEL, "ranks": [0, 1]}, _step(1, [[1.0, 1.0]], fwd=same),
                   _step(2, [[1.0, 1.0]], fwd=same)] for r in range(2)}
    assert data_shard.verdict(_trace(records)).status == "skip"
    for r in records:
        records[r] = records[r][1:]  # no tensor parallelism: identical batches are a fault
    assert data_shard.verdict(_trace(records)).status == "fail"


# --- hparams ------------------------------------------------------------------------------------


def _settings(lr: float, clips: tuple = (), scale: float | None = None, n: int = 1) -> hparams.StepSettings:
    return hparams.StepSettings(opt=0, n=n, site="t.py:9", groups=({"lr": lr, "betas": [0.9, 0.999]},),
                                clips=clips, clip_sites=("t.py:8",) * len(clips), scale=scale,
                                optimizer="AdamW at t.py:5")


def test_hparams_pass_when_every_rank_steps_with_the_same_settings():
    result = hparams.compare({0: [_settings(1e-3), _settings(5e-4, n=2)], 1: [_settings(1e-3), _settings(5e-4, n=2)]})
    assert result.status == "pass" and "lr" in result.summary and result.details["compared_steps"] == 2


def test_hparams_name_rank_optimizer_group_and_values():
    result = hparams.compare({0: [_settings(1e-3)], 1: [_settings(1e-3)], 2: [_settings(2e-3)]})
    assert result.status == "fail"
    assert result.details == {**result.details, "step": 1, "ranks": [2], "optimizer": 0, "group": 0, "field": "lr"}
    assert "lr of param group 0" in result.summary and "AdamW at t.py:5" in result.summary
    assert "rank 2: 0.002" in result.summary and "rank 0,1: 0.001" in result.summary


def test_hparams_catch_a_clip_on_one_rank_and_a_diverging_grad_scaler():
    clip = (("clip_grad_norm_", 1.0, 2.0),)
    result = hparams.compare({0: [_settings(1e-3, clip)], 1: [_settings(1e-3)]})
    assert result.status == "fail" and result.details["field"] == "clip"
    assert "clip_grad_norm_(max 1) at t.py:8" in result.summary and "no clipping call" in result.summary
    scaled = hparams.compare({0: [_settings(1e-3, scale=65536.0)], 1: [_settings(1e-3, scale=32768.0)]})
    assert scaled.status == "fail" and scaled.details["field"] == "scale"


def test_hparams_read_from_step_records_carry_forward_between_changes():
    def steps(lr2: float) -> list[dict[str, Any]]:
        return [{"e": protocol.OPTIMIZER, "opt": 0, "cls": "SGD", "site": "/w/t.py:4", "names": ["w"]},
                _step(1, [[1.0, 1.0]], hp=[{"lr": 0.1}]), _step(2, [[1.0, 1.0]]), _step(3, [[1.0, 1.0]], hp=[{"lr": lr2}])]

    assert hparams.verdict(_trace({0: steps(0.05), 1: steps(0.05)})).status == "pass"
    result = hparams.verdict(_trace({0: steps(0.05), 1: steps(0.01)}))
    assert result.status == "fail" and result.details["step"] == 3 and "SGD at t.py:4" in result.summary


# --- the probe's own failures -------------------------------------------------------------------


def test_a_failed_hook_makes_its_checks_an_error_of_the_probe_not_a_pass():
    trace = _trace({0: [{"e": protocol.PROBE_ERROR, "what": "steps", "hook": "optimizer step pre-hook",
                         "type": "RuntimeError", "message": "not supported for tensor subclasses", "step": 2}],
                    1: []})
    passing = CheckResult("param-sync", "pass", "4 parameters equal")
    result = unobserved(passing, trace)
    assert result.status == "error" and result.summary.startswith("distdoctor could not observe optimizer steps")
    assert "rank(s) 0 from step 3" in result.summary and "the script itself was not affected" in result.summary
    found = CheckResult("param-sync", "fail", "w differs", details={"step": 1})
    assert unobserved(found, trace) is found  # a finding made before the hook failed stands
    later = CheckResult("desync", "fail", "ranks ended at different points", details={"step": 3})
    assert unobserved(later, trace).status == "error"  # the records that stopped, not the script
    other = CheckResult("epoch-shuffle", "pass", "ok")
    assert unobserved(other, trace) is other  # sampler observation still worked


# --- false alarms -------------------------------------------------------------------------------


def _pass_record(passes: int, epoch: int, step: int, site: str = "/w/t.py:30") -> dict[str, Any]:
    return {"e": protocol.SAMPLER_ITER, "sampler": 0, "cls": "DistributedSampler", "created": "/w/t.py:10",
            "site": site, "source": "for x, y in loader:", "epoch": epoch, "shuffle": True, "set_epoch_calls": epoch,
            "passes": passes, "step": step}


def test_a_peek_before_the_epoch_loop_is_not_an_epoch():
    # pass 1 is `next(iter(loader))` (no step while it lasted), passes 2 and 3 are epochs 0 and 1.
    records = [_pass_record(1, 0, 0, "/w/t.py:25"), _pass_record(2, 0, 0), {"e": protocol.SAMPLER_FED, "sampler": 0,
                                                                          "passes": 2},
               _pass_record(3, 1, 5), {"e": protocol.SAMPLER_FED, "sampler": 0, "passes": 3}]
    result = epoch_shuffle.verdict(_trace({0: records, 1: records}))
    assert result.status == "pass" and "t.py:25" in result.summary
    # the same passes all feeding training: epoch 0 twice is the fault
    fed = records + [{"e": protocol.SAMPLER_FED, "sampler": 0, "passes": 1}]
    assert epoch_shuffle.verdict(_trace({0: fed, 1: fed})).status == "fail"


def test_an_evaluation_loader_without_set_epoch_does_not_fail():
    evaluation = [_pass_record(k, 0, 5 * k, "/w/t.py:40") for k in range(1, 4)]
    result = epoch_shuffle.verdict(_trace({0: evaluation, 1: evaluation}))
    assert result.status == "skip" and "t.py:40" in result.summary


def test_everything_skipped_is_nothing_verified_exit_2(monkeypatch):
    skipped = Report("script", "gloo", 2, 1.0, (CheckResult("desync", "skip", "the script made no optimizer step"),
                                                 CheckResult("loss", "skip", "no backward() was observed")),
                     extra={"nothing_verified": "every check was skipped: the script ended (exit status 0)"})
    assert "NOTHING VERIFIED (every check was skipped: the script ended" in render_text(skipped).splitlines()[0]
    monkeypatch.setattr(cli_probe, "count_visible_gpus", lambda allow_torch: 0)
    monkeypatch.setattr(cli_probe, "dispatch", lambda *a, **k: skipped)
    result = CliRunner().invoke(main, ["probe", "train.py"])
    assert result.exit_code == 2 and "NOTHING VERIFIED" in result.output


def test_sys_exit_without_a_code_is_exit_status_0():
    trace = RankTrace(0)
    trace.add({"e": protocol.EXIT, "code": None})
    assert "exit status 0" in trace.where()


def test_backward_without_a_step_says_so():
    trace = _trace({0: [{"e": protocol.BACKWARD, "n": 1, "site": "/w/t.py:3"}], 1: []})
    result = loss.verdict(trace)
    assert result.status == "skip" and "no optimizer step followed" in result.summary


def test_overhead_per_step_is_in_the_text_report():
    report = Report("script", "gloo", 2, 1.0, (CheckResult("desync", "pass", "ok"),),
                    extra={"overhead": {"ranks": {"0": {"steps": 3, "hook_ms_per_step": 0.25,
                                                        "share_of_train_time": 0.02}},
                                        "max_share_of_train_time": 0.02}})
    assert "probe overhead: 0.25 ms per step at most (2% of the training time)" in render_text(report)


# --- the rank side, in process (torch needed) ----------------------------------------------------


def test_a_failing_probe_hook_disables_itself_and_never_reaches_the_script(tmp_path: Path, monkeypatch):
    torch = pytest.importorskip("torch")
    from distdoctor.probe.script import hooks

    probe = hooks.Probe(hooks.RecordWriter(tmp_path / "rank0.jsonl"), 0, 0, str(tmp_path / "t.py"))

    def refuse(tensors):
        raise RuntimeError(".tolist() is not supported for tensor subclasses")

    monkeypatch.setattr(hooks, "_checksums", refuse)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    for _ in range(2):  # the user's step goes on, twice, and is counted
        probe.on_step_pre(opt, (), {})
        opt.step()
        probe.on_step_post(opt, (), {})
    assert probe.step_counts[0] == 2 and "steps" in probe.disabled
    records = protocol.read_records(tmp_path / "rank0.jsonl")[0]
    errors = [r for r in records if r["e"] == protocol.PROBE_ERROR]
    assert len(errors) == 1 and errors[0]["what"] == "steps" and "tensor subclasses" in errors[0]["message"]
    guarded = probe.guarded("forward", lambda: 1 / 0)
    assert guarded() is None and "forward" in probe.disabled
    import functools

    unnamed = probe.guarded("collectives", functools.partial(int, "not a number"))  # no __name__
    assert unnamed() is None and "collectives" in probe.disabled


# --- HSDP on a 2x2 mesh: four real ranks ----------------------------------------------------------

NPROC4 = Path(__file__).resolve().parent.parent / "fixtures" / "probe" / "nproc4"


@pytest.mark.slow
@pytest.mark.parametrize("fixture", sorted(NPROC4.glob("*.py")), ids=lambda p: p.stem)
def test_hsdp_fixtures_on_four_ranks(fixture: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from test_probe_script import expectations

    from distdoctor.probe.launch.torchrun import LaunchSpec
    from distdoctor.probe.script.launcher import run_script_probe

    report = run_script_probe(str(fixture), [], LaunchSpec(nproc=4, backend="gloo", timeout_s=90.0), steps=6,
                              framework="torch", log_file=str(tmp_path / "output.log"))
    checks = {c.id: c for c in report.checks}
    for check_id, (status, detail) in expectations(fixture).items():
        check = checks[check_id]
        assert check.status == status, (check_id, check.summary)
        if "ranks" in detail:
            assert check.details.get("ranks") == [int(r) for r in detail["ranks"].split("+")], check.details
        if "parameter" in detail:
            assert check.details.get("parameter") == detail["parameter"], check.details
    if fixture.name.startswith("healthy"):
        assert report.ok and "replicas" in checks["param-sync"].summary


@pytest.mark.slow
def test_grad_scaler_loss_is_unscaled_and_the_script_report_has_a_loss_plot(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from distdoctor.probe.launch.torchrun import LaunchSpec
    from distdoctor.probe.plots import write_report
    from distdoctor.probe.script.launcher import run_script_probe

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "probe" / "healthy_grad_scaler.py"
    report = run_script_probe(str(fixture), [], LaunchSpec(nproc=2, backend="gloo", timeout_s=90.0), steps=4,
                              framework="torch", log_file=str(tmp_path / "output.log"))
    checks = {c.id: c for c in report.checks}
    curve = checks["loss"].ranks["0"]["curve"]
    assert len(curve) == 4 and max(curve) < 100, curve  # the scaled loss would be ~2**16 times larger
    assert "GradScaler scale" in checks["hparams"].summary
    written = write_report(report, tmp_path / "report")
    assert tmp_path / "report" / "loss.png" in written and (tmp_path / "report" / "loss.png").stat().st_size > 0


def test_fsdp1_shards_are_laid_out_as_one_copy_per_rank_and_plain_ddp_records_do_not_grow():
    torch = pytest.importorskip("torch")
    from distdoctor.probe.script import tensors

    plain = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    assert tensors.layouts(plain) == (None, [])
    flat = torch.nn.Parameter(torch.ones(4))
    flat._fsdp_flattened = True
    spec, meshes = tensors.layouts([flat, plain[0]])
    assert spec == [[0, "S0"], None] and meshes == [{"ranks": [0], "names": ["fsdp1"], "coord": [0]}]
    records = {r: {"spec": spec, "meshes": [{**meshes[0], "ranks": [0, 1], "coord": [r]}]} for r in range(2)}
    assert layouts.comparison_groups(records, 0) == [] and layouts.comparison_groups(records, 1) == [[0, 1]]
    sums = tensors.checksums([flat, plain[0]])
    assert [float(v) for v in sums] == pytest.approx([4.0, 2.0, 3.0, 3 ** 0.5])


def test_script_checks_are_validated_and_hparams_is_one_of_them(monkeypatch):
    monkeypatch.setattr(cli_probe, "count_visible_gpus", lambda allow_torch: 0)
    calls = []
    monkeypatch.setattr(cli_probe, "dispatch", lambda *a, **k: calls.append(k) or Report(
        "script", "gloo", 2, 1.0, (CheckResult("hparams", "pass", "equal"),)))
    bad = CliRunner().invoke(main, ["probe", "train.py", "--checks", "hparams,bogus"])
    assert bad.exit_code == 2 and "bogus" in bad.output and "hparams" in bad.output and not calls
    good = CliRunner().invoke(main, ["probe", "train.py", "--checks", "hparams"])
    assert good.exit_code == 0 and calls
