"""distdoctor stacks: the stack analysis on recorded py-spy reads of real hung jobs (fast), discovery
on a fake /proc (fast), bad input (fast), and real hung jobs under plain torchrun on gloo (slow).

The recorded reads in tests/data/stacks/ were taken from the fixtures in fixtures/stacks/ running
under `python -m torch.distributed.run --standalone --nproc-per-node 2` (three non-blocking samples
of each rank 0.5 s apart, a native read of the rank that waits in backward, and the rank's
DataLoader worker), with the fixtures folder written as @FIXTURES@ and the interpreter's prefix
as /usr/lib.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from _probe_helpers import marked_env, new_marker, processes_with_marker, wait_for_no_processes
from distdoctor.cli import main
from distdoctor.probe.script.watch import waiting_site
from distdoctor.probe.stacks import analysis, discover, flight, live, report, sampler
from distdoctor.probe.stacks.analysis import Frame, RankStacks

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "stacks"
DATA = Path(__file__).resolve().parent / "data" / "stacks"
SITE = "/usr/lib/python3.11/site-packages"


def marker_line(fixture: str, marker: str) -> int:
    """The line of `fixtures/stacks/FIXTURE.py` that carries the comment `# stacks: MARKER`."""
    lines = (FIXTURES / f"{fixture}.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# stacks: {marker}"))


def recorded(fixture: str, native: bool = True) -> list[RankStacks]:
    """The two ranks of a recorded fixture run, as `live.read_jobs` would have built them."""
    raw = json.loads((DATA / f"{fixture}.json").read_text().replace("@FIXTURES@", str(FIXTURES)))
    ranks = []
    for r in (0, 1):
        rank = RankStacks(pid=1000 + r, rank=r, local_rank=r, world_size=2, host="node0")
        for s in range(3):
            read = sampler.Read(rank.pid, sampler.parse_dump(json.dumps(raw[f"rank{r}.{s}"])))
            live._take(rank, read)
        if native and f"rank{r}.native" in raw:
            rank.native = list(sampler.parse_dump(json.dumps(raw[f"rank{r}.native"]))[0].frames)
        if f"rank{r}.child" in raw and not rank.moved and not rank.activity.in_collective:  # as live.read_jobs does
            rank.children.append((2000 + r, list(sampler.parse_dump(json.dumps(raw[f"rank{r}.child"]))[0].frames)))
        ranks.append(rank)
    return ranks


# --- the verdict on recorded hung jobs -----------------------------------------------------------


def test_a_barrier_on_one_rank_names_that_rank_its_line_and_its_guard():
    verdict = analysis.diagnose(recorded("barrier_one_rank"), 2)
    assert verdict.hung
    odd, other = verdict.groups
    assert [r.rank for r in odd.ranks] == [1] and odd.activity.op == "barrier"
    assert odd.activity.user.line == marker_line("barrier_one_rank", "odd rank 1")
    assert odd.guard is not None and odd.guard[1].test == "rank == 1"
    assert [r.rank for r in other.ranks] == [0] and other.activity.op == "all_reduce"
    assert other.activity.user.line == marker_line("barrier_one_rank", "rank 0 waits here")
    assert odd.ranks[0].step == 3 and other.ranks[0].step == 4
    assert verdict.summary.startswith("ranks parted at step 3: rank 1 waits in barrier, from ")
    assert f"barrier_one_rank.py:{odd.activity.user.line} in main, under `if rank == 1`" in verdict.summary


def test_a_collective_under_a_rank_guard_and_ddp_backward_read_through_native_frames():
    verdict = analysis.diagnose(recorded("collective_under_guard"), 2)
    odd, other = verdict.groups
    assert [r.rank for r in odd.ranks] == [0] and odd.activity.op == "barrier"
    assert odd.activity.user.func == "save_checkpoint"
    assert odd.guard[1].test == "rank == 0" and odd.guard[0].func == "main"
    assert [r.rank for r in other.ranks] == [1]
    assert other.activity.op == "all_reduce" and "DDP backward" in other.activity.via
    assert other.activity.user.line == marker_line("collective_under_guard", "rank 1 waits here")


def test_without_native_frames_a_rank_idle_in_backward_is_said_to_be_in_backward():
    ranks = recorded("collective_under_guard", native=False)
    assert ranks[1].activity.kind == analysis.BACKWARD
    assert live._wants_native(ranks[1]) and not live._wants_native(ranks[0])


def test_a_rank_in_an_endless_loop_is_named_first_with_its_line():
    verdict = analysis.diagnose(recorded("endless_loop"), 2)
    assert verdict.hung
    first = verdict.groups[0]
    assert [r.rank for r in first.ranks] == [1] and not first.activity.in_collective
    assert first.activity.user.func == "search"
    assert first.activity.user.line in (marker_line("endless_loop", "odd rank 1"), marker_line("endless_loop", "odd rank 1") + 1)
    assert "rank 1 is not in a collective: computing" in first.describe()
    assert verdict.groups[1].activity.op == "all_reduce"


def test_a_rank_waiting_for_a_dataloader_worker_names_the_worker_line():
    verdict = analysis.diagnose(recorded("dataloader_stuck"), 2)
    first = verdict.groups[0]
    assert [r.rank for r in first.ranks] == [1]
    assert first.activity.kind == analysis.DATA and "DataLoader worker" in first.activity.op
    assert first.activity.user.line == marker_line("dataloader_stuck", "odd rank 1")
    (_pid, worker), = first.ranks[0].children
    assert analysis.user_frame(worker).line == marker_line("dataloader_stuck", "rank 1's worker")
    text = report.format_text([live.JobStacks("torchrun:x@h:1", "torchrun", recorded("dataloader_stuck"), 2)], 1.0, "test")
    assert "DataLoader worker pid 2001: " in text and "threading.Event().wait()" in text


def test_mismatched_collectives_name_both_ops_and_both_branches():
    verdict = analysis.diagnose(recorded("mismatched"), 2)
    ops = {g.ranks[0].rank: (g.activity.op, g.guard[1]) for g in verdict.groups}
    assert ops[0][0] == "all_reduce" and not ops[0][1].orelse
    assert ops[1][0] == "broadcast" and ops[1][1].orelse and ops[1][1].test == "rank == 0"
    assert "in the else branch of `if rank == 0`" in verdict.summary


def test_fsdp2_all_gather_in_forward_is_named_through_fsdp_internals():
    verdict = analysis.diagnose(recorded("fsdp_skipped_forward"), 2)
    odd, other = verdict.groups
    assert [r.rank for r in odd.ranks] == [1] and odd.activity.op == "barrier"
    assert [r.rank for r in other.ranks] == [0]
    assert other.activity.op == "all_gather_single" and other.activity.via == "FSDP foreach_all_gather"
    assert other.activity.user.line == marker_line("fsdp_skipped_forward", "rank 0 waits here")


def test_a_healthy_job_is_progressing_even_when_its_stack_stays_in_one_line():
    ranks = recorded("healthy")
    assert len({analysis.signature(s) for s in ranks[0].samples}) == 1  # asleep at the same line...
    assert ranks[0].steps[0] < ranks[0].steps[-1]  # ...but the step advanced
    verdict = analysis.diagnose(ranks, 2)
    assert not verdict.hung and verdict.summary == "all 2 ranks progressing: nothing hung"


def test_every_rank_waiting_at_the_same_place_points_at_the_other_nodes():
    ranks = recorded("barrier_one_rank")[:1]
    verdict = analysis.diagnose(ranks, 4)
    assert verdict.hung and "only 1 of 4 ranks are on this machine" in verdict.summary and "--merge" in verdict.summary


# --- the analysis on hand-made stacks ------------------------------------------------------------


def _f(func, file, line=1, **locals_):
    return Frame(func, file, line, tuple((k, str(v)) for k, v in locals_.items()))


USER = "/home/u/train.py"


@pytest.mark.parametrize(("inner", "op", "via"), [
    ([_f("all_gather_into_tensor", f"{SITE}/torch/distributed/distributed_c10d.py"),
      _f("_all_gather_flat_param", f"{SITE}/torch/distributed/fsdp/_flat_param.py"),
      _f("_unshard", f"{SITE}/torch/distributed/fsdp/_runtime_utils.py")], "all_gather_into_tensor", "FSDP _all_gather_flat_param"),
    ([_f("wait_for_unshard", f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py")], "all_gather", "FSDP wait_for_unshard"),
    ([_f("foreach_reduce", f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py")], "reduce_scatter", "FSDP foreach_reduce"),
    ([_f("synchronize", f"{SITE}/horovod/torch/mpi_ops.py"), _f("allreduce", f"{SITE}/horovod/torch/mpi_ops.py")], "hvd.allreduce", "Horovod"),
    ([_f("synchronize", f"{SITE}/horovod/torch/mpi_ops.py"), _f("_DistributedOptimizer.synchronize", f"{SITE}/horovod/torch/optimizer.py"),
      _f("_DistributedOptimizer.step", f"{SITE}/horovod/torch/optimizer.py")], "hvd.synchronize", "Horovod"),
    ([_f("_sync_buffers", f"{SITE}/torch/nn/parallel/distributed.py"), _f("_pre_forward", f"{SITE}/torch/nn/parallel/distributed.py")],
     "broadcast (DDP buffer sync before forward)", None),
    ([_f("wait_tensor", f"{SITE}/torch/distributed/_functional_collectives.py")], "wait_tensor", "functional collectives"),
    ([_f("_store_based_barrier", f"{SITE}/torch/distributed/distributed_c10d.py"),
      _f("init_process_group", f"{SITE}/torch/distributed/distributed_c10d.py")], "init_process_group", None),
])
def test_collectives_behind_ddp_fsdp_horovod_and_functional_calls(inner, op, via):
    activity = analysis.classify([*inner, _f("main", USER, 40)], active=False)
    assert activity.in_collective and activity.op == op and activity.via == via
    assert activity.user.site == f"{USER}:40"


@pytest.mark.parametrize(("inner", "kind"), [
    ([_f("_save", f"{SITE}/torch/serialization.py"), _f("save", f"{SITE}/torch/serialization.py")], analysis.CHECKPOINT),
    ([_f("_next_data", f"{SITE}/torch/utils/data/dataloader.py")], analysis.DATA),
    ([_f("compile_fx", f"{SITE}/torch/_inductor/compile_fx.py")], analysis.COMPILE),
    ([_f("sleep_helper", "/usr/lib/python3.11/threading.py")], analysis.IDLE),
])
def test_what_a_rank_does_outside_collectives(inner, kind):
    assert analysis.classify([*inner, _f("main", USER, 7)], active=False).kind == kind


def test_a_busy_rank_in_its_own_code_is_computing():
    activity = analysis.classify([_f("loss_fn", USER, 12), _f("main", USER, 40)], active=True)
    assert activity.kind == analysis.COMPUTE and activity.user.line == 12


def test_the_user_frame_skips_torch_the_stdlib_and_distdoctor():
    frames = [_f("wait", "/usr/lib/python3.11/threading.py"), _f("x", f"{SITE}/torch/nn/modules/module.py"),
              _f("hook", str(ROOT / "distdoctor" / "probe" / "script" / "hooks.py")), _f("step", USER, 9), _f("<module>", "<string>")]
    assert analysis.user_frame(frames).line == 9
    assert analysis.user_frame(frames[:3]) is None
    assert analysis.user_frame(frames, roots=("/home/u",)).line == 9


def test_the_step_is_read_from_the_innermost_user_frame_that_has_one():
    frames = [_f("inner", USER, 3, x=1), _f("train", USER, 20, global_step="812"), _f("main", USER, 30, step="4")]
    assert analysis.step_of(frames) == 812
    assert analysis.step_of([_f("main", USER, 30, step="<tensor>")]) is None


def test_rank_guards(tmp_path):
    path = tmp_path / "g.py"
    path.write_text(
        "if args.local_rank == 0:\n"
        "    save()\n"
        "    if epoch > 3:\n"
        "        dist.barrier()\n"
        "else:\n"
        "    dist.all_reduce(t)\n"
        "if epoch > 3:\n"
        "    dist.broadcast(t, 0)\n"
        "if dist.get_rank() != 0 and x:\n"
        "    f()\n"
    )
    assert analysis.rank_guard(str(path), 4) == analysis.Guard("args.local_rank == 0", 1)
    assert analysis.rank_guard(str(path), 6) == analysis.Guard("args.local_rank == 0", 1, orelse=True)
    assert analysis.rank_guard(str(path), 8) is None
    assert analysis.rank_guard(str(path), 10).test == "dist.get_rank() != 0 and x"
    assert analysis.rank_guard(str(tmp_path / "missing.py"), 1) is None
    (tmp_path / "bad.py").write_text("if rank == 0\n")
    assert analysis.rank_guard(str(tmp_path / "bad.py"), 1) is None


def test_rank_lists():
    assert analysis.ranks_text([3]) == "rank 3"
    assert analysis.ranks_text([0, 2, 3]) == "ranks 0,2,3"
    assert analysis.ranks_text([5, 0, 1, 2, 3, 7]) == "ranks 0-3,5,7"
    assert analysis.ranks_text([41, 40], pids=True) == "pids 40,41"


def test_the_probe_stall_reader_keeps_its_wording():
    frames = [(f"{SITE}/torch/autograd/graph.py", 979, "_engine_run_backward"),
              (f"{SITE}/torch/_tensor.py", 623, "Tensor.backward"), ("/job/train.py", 45, "main")]
    assert waiting_site(frames, "/job") == "train.py:45 in main (blocked in _engine_run_backward, graph.py:979)"
    frames = [(f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"), ("/job/train.py", 12, "main")]
    assert waiting_site(frames, "/job") == "train.py:12 in main (blocked in all_reduce, distributed_c10d.py:3252)"
    assert waiting_site([], "/job") == "no Python stack (the rank did not answer)"


# --- py-spy output and errors --------------------------------------------------------------------


def test_py_spy_errors_are_told_apart():
    gone = 2**22 + 17  # above any pid_max: never a live process
    kind, message = sampler._classify_error(os.getpid(), "Error: Permission Denied (os error 13)\n\nStack backtrace:\n 0: x")
    assert kind == sampler.PERMISSION and "SYS_PTRACE" in message
    kind, message = sampler._classify_error(os.getpid(), "Error: Failed to find python version from target process")
    assert kind == sampler.NOT_PYTHON and "not a Python process" in message
    kind, message = sampler._classify_error(gone, "Error: Failed to get process executable name. Check that the process is running.")
    assert kind == sampler.EXITED and "exited while it was being read" in message


def test_unreadable_py_spy_output_is_an_error_not_a_crash():
    with pytest.raises(ValueError):
        sampler.parse_dump("{}")
    with pytest.raises(ValueError):
        sampler.parse_dump("not json")


def test_a_missing_py_spy_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("DISTDOCTOR_PY_SPY", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    result = CliRunner().invoke(main, ["stacks", "123"])
    assert result.exit_code == 2 and "distdoctor[stacks]" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["stacks", "--py-spy", str(tmp_path / "nope"), "123"])
    assert result.exit_code == 2 and "py-spy not found at" in result.output


@pytest.fixture()
def fake_py_spy(tmp_path):
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\nexit 3\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize(("args", "message"), [
    (["abc"], "'abc' is not a process id"),
    (["node0.json"], "add --merge"),
    ([str(2**22 + 17)], "no process with pid"),
    (["0"], "0 is not a process id"),
])
def test_bad_pids_exit_2_with_a_message(fake_py_spy, args, message):
    result = CliRunner().invoke(main, ["stacks", "--py-spy", fake_py_spy, *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


# --- JSON and --merge ----------------------------------------------------------------------------


def _node_file(tmp_path, name, ranks, world=2):
    job = live.JobStacks("torchrun:abc@10.0.0.1:29500", "torchrun", ranks, world)
    path = tmp_path / name
    path.write_text(report.format_json([job], 1.0, {"name": "py-spy"}))
    return str(path)


def test_merge_gives_the_job_wide_verdict_from_per_node_files(tmp_path):
    rank0, rank1 = recorded("barrier_one_rank")
    rank1.host = "node1"
    a = _node_file(tmp_path, "node0.json", [rank0])
    b = _node_file(tmp_path, "node1.json", [rank1])
    alone = json.loads(Path(a).read_text())["jobs"][0]
    assert alone["hung"] and "only 1 of 2 ranks" in alone["summary"]
    result = CliRunner().invoke(main, ["stacks", "--merge", a, b, "--format", "json"])
    assert result.exit_code == 1, result.output
    merged = json.loads(result.output)["jobs"][0]
    assert [g["ranks"] for g in merged["groups"]] == [[1], [0]]
    assert merged["groups"][0]["activity"]["op"] == "barrier" and merged["hosts"] == ["node0", "node1"]
    text = CliRunner().invoke(main, ["stacks", "--merge", a, b])
    assert text.exit_code == 1 and "HUNG: ranks parted at step 3; the likely cause first\n- rank 1 waits in barrier" in text.output


def test_merge_keeps_what_the_verdict_needs(tmp_path):
    ranks = recorded("healthy")
    merged = report.load_merge([_node_file(tmp_path, "n.json", ranks)])
    assert not merged[0].verdict.hung and merged[0].ranks[0].steps == ranks[0].steps
    guarded = report.load_merge([_node_file(tmp_path, "g.json", recorded("collective_under_guard"))])[0]
    assert guarded.verdict.groups[1].activity.via.startswith("DDP backward")


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    ('{"tool": "distdoctor", "checks": []}', "is not the output of `distdoctor stacks --format json`"),
    ('{"command": "stacks", "jobs": [{"key": "k"}]}', "unexpected content"),
])
def test_merge_bad_input_exits_2(tmp_path, content, message):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(main, ["stacks", "--merge", str(path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_merge_refuses_the_same_node_twice(tmp_path):
    a = _node_file(tmp_path, "a.json", recorded("mismatched"))
    result = CliRunner().invoke(main, ["stacks", "--merge", a, a])
    assert result.exit_code == 2 and "give each node's file once" in result.output


def test_merge_needs_files():
    result = CliRunner().invoke(main, ["stacks", "--merge"])
    assert result.exit_code == 2 and "--merge needs the JSON files" in result.output


# --- reading several ranks -----------------------------------------------------------------------


def _jobs(n, launcher="torchrun"):
    ident = lambda r: discover.Identity(launcher, f"{launcher}:x", r if launcher != "mp.spawn" else None, r, n, 0, "h")  # noqa: E731
    return [discover.Job(f"{launcher}:x", launcher, [discover.RankProc(10_000 + r, ident(r)) for r in range(n)])]


def test_read_jobs_samples_every_rank_and_reads_native_only_where_it_helps(monkeypatch):
    raw = json.loads((DATA / "collective_under_guard.json").read_text().replace("@FIXTURES@", str(FIXTURES)))
    calls = []

    def fake_dump(binary, pid, timeout_s, native=False, with_locals=True):
        calls.append((pid, native))
        r = pid - 10_000
        key = f"rank{r}.native" if native else f"rank{r}.0"
        return sampler.Read(pid, sampler.parse_dump(json.dumps(raw[key])))

    monkeypatch.setattr(sampler, "dump", fake_dump)
    (job,) = live.read_jobs(_jobs(2), "py-spy", live.Options(samples=2, interval_s=0.0))
    assert sorted(calls) == [(10_000, False), (10_000, False), (10_001, False), (10_001, False), (10_001, True)]
    assert job.verdict.hung and job.verdict.groups[1].activity.via.startswith("DDP backward")


def test_mp_spawn_ranks_are_numbered_from_their_stack(monkeypatch):
    wrap = lambda i: [{"name": "main", "filename": USER, "line": 5, "module": None, "locals": []},  # noqa: E731
                      {"name": "_wrap", "filename": f"{SITE}/torch/multiprocessing/spawn.py", "line": 90, "module": None,
                       "locals": [{"name": "i", "repr": str(i)}]}]
    monkeypatch.setattr(sampler, "dump", lambda binary, pid, timeout_s, native=False, with_locals=True: sampler.Read(
        pid, sampler.parse_dump(json.dumps([{"thread_name": "MainThread", "os_thread_id": pid, "active": False,
                                             "frames": wrap(11_000 - pid)}]))))
    jobs = _jobs(2, "mp.spawn")
    for rp in jobs[0].ranks:
        rp.pid = 11_000 - rp.identity.local_rank
    (job,) = live.read_jobs(jobs, "py-spy", live.Options(samples=1, native=False))
    assert sorted((r.pid, r.rank) for r in job.ranks) == [(10_999, 1), (11_000, 0)] and job.world_size == 2


def test_a_rank_that_fails_to_be_read_is_kept_with_its_reason(monkeypatch):
    def fake_dump(binary, pid, timeout_s, native=False, with_locals=True):
        if pid == 10_001:
            return sampler.Read(pid, error=f"pid {pid} did not answer within {timeout_s:g} s", kind=sampler.TIMEOUT)
        return sampler.Read(pid, [sampler.ThreadStack("MainThread", pid, False, (
            Frame("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 5356), Frame("main", USER, 3)))])

    monkeypatch.setattr(sampler, "dump", fake_dump)
    (job,) = live.read_jobs(_jobs(3), "py-spy", live.Options(samples=2, interval_s=0.0, native=False))
    verdict = job.verdict
    assert [r.rank for r in verdict.unread] == [1] and "did not answer within 5 s" in verdict.unread[0].error
    assert verdict.hung and [r.rank for r in verdict.groups[0].ranks] == [0, 2]
    assert "rank 1 (pid 10001) not read: pid 10001 did not answer" in report.format_text([job], 0.1, "test")


# --- discovery on a fake /proc -------------------------------------------------------------------


def _proc(root: Path, pid: int, ppid: int, argv: list[str], env: dict[str, str] | None = None, comm: str = "python") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "status").write_text("Name:\tpython\nUid:\t1000\t1000\t1000\t1000\n")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (env or {}).items()) + b"\0")


@pytest.fixture()
def fake_proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    py = "/usr/bin/python3"
    _proc(root, 1, 0, ["/sbin/init"], comm="init")
    _proc(root, 100, 1, ["/bin/bash", "run.sh"], comm="bash")
    _proc(root, 101, 100, [py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"], {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"})
    for r in (0, 1):
        env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "run1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}
        _proc(root, 110 + r, 101, [py, "-u", "train.py"], env)
    _proc(root, 120, 111, [py, "-u", "train.py"], {"RANK": "1", "TORCHELASTIC_RUN_ID": "run1", "MASTER_ADDR": "127.0.0.1",
                                                     "MASTER_PORT": "29500", "WORLD_SIZE": "2"})  # rank 1's DataLoader worker
    _proc(root, 200, 1, [py, "spawn_train.py"])
    for i in (0, 1):
        _proc(root, 210 + i, 200, [py, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
                                   "--multiprocessing-fork"])
    _proc(root, 300, 1, ["horovodrun", "-np", "2", "python", "hvd.py"])
    for r in (0, 1):
        _proc(root, 310 + r, 300, [py, "hvd.py"], {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                                                    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"})
    # horovodrun's Gloo launcher: a multiprocessing child per slot runs `sh -c env HOROVOD_RANK=... python`
    _proc(root, 600, 1, [py, "/usr/bin/horovodrun", "-np", "2", "--gloo", "python", "hvd2.py"])
    for r in (0, 1):
        _proc(root, 610 + r, 600, [py, "-B", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=14)",
                                   "--multiprocessing-fork"])
        _proc(root, 620 + r, 610 + r, ["/bin/sh", "-c", f"env HOROVOD_RANK={r} python hvd2.py"], comm="sh")
        _proc(root, 630 + r, 620 + r, [py, "hvd2.py"], {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                                                         "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "9538"})
    _proc(root, 400, 1, [py, "notebook.py"])
    _proc(root, 500, 1, ["/usr/bin/sleep", "100"], comm="sleep")
    return str(root)


def test_every_job_on_the_machine_is_found(fake_proc):
    jobs = discover.find_jobs(root=fake_proc, host="node0")
    by = {j.launcher: j for j in jobs}
    assert set(by) == {"torchrun", "mp.spawn", "horovod"}
    torchrun = by["torchrun"]
    assert [(r.pid, r.identity.rank, r.identity.local_rank) for r in torchrun.ranks] == [(110, 0, 0), (111, 1, 1)]
    assert torchrun.ranks[1].children == [120] and torchrun.agents == [101] and torchrun.world_size == 2
    assert [r.pid for r in by["mp.spawn"].ranks] == [210, 211]
    assert [(r.identity.rank, r.identity.world_size) for r in by["horovod"].ranks] == [(0, 2), (1, 2)]


def test_horovodrun_slot_helpers_are_not_an_mp_spawn_job(fake_proc):
    (job,) = discover.find_jobs([600], root=fake_proc, host="node0")
    assert job.launcher == "horovod" and [r.pid for r in job.ranks] == [630, 631]
    assert not any(j.launcher == "mp.spawn" and 610 in [r.pid for r in j.ranks] for j in discover.find_jobs(root=fake_proc, host="node0"))


@pytest.mark.parametrize(("pid", "ranks"), [(101, [110, 111]), (110, [110, 111]), (120, [110, 111]), (100, [110, 111]),
                                            (200, [210, 211]), (311, [310, 311]), (400, [400])])
def test_a_pid_may_be_an_agent_a_rank_a_worker_a_launcher_or_a_plain_python_process(fake_proc, pid, ranks):
    jobs = discover.find_jobs([pid], root=fake_proc, host="node0")
    assert [r.pid for job in jobs for r in job.ranks] == ranks


@pytest.mark.parametrize(("pid", "message"), [(500, "is not a Python process and runs no training ranks"),
                                              (999, "no process with pid 999")])
def test_pids_that_cannot_be_diagnosed(fake_proc, pid, message):
    with pytest.raises(discover.DiscoveryError, match=message):
        discover.find_jobs([pid], root=fake_proc)


# --- real hung jobs (slow) -----------------------------------------------------------------------

# fixture -> (hung, [(ranks, op or activity kind, marker of the user's line)] in the verdict's order)
REAL_CASES = {
    "barrier_one_rank": (True, [([1], "barrier", "odd rank 1"), ([0], "all_reduce", "rank 0 waits here")]),
    "collective_under_guard": (True, [([0], "barrier", "odd rank 0"), ([1], "all_reduce", "rank 1 waits here")]),
    "endless_loop": (True, [([1], analysis.COMPUTE, "odd rank 1"), ([0], "all_reduce", "rank 0 waits here")]),
    "dataloader_stuck": (True, [([1], analysis.DATA, "odd rank 1"), ([0], "all_reduce", "rank 0 waits here")]),
    "mismatched": (True, [([0], "all_reduce", "rank 0 in all_reduce"), ([1], "broadcast", "rank 1 in broadcast")]),
    "fsdp_skipped_forward": (True, [([1], "barrier", "odd rank 1"), ([0], "all_gather_single", "rank 0 waits here")]),
    "healthy": (False, [([0, 1], None, None)]),
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _launch(fixture: str, tmp_path: Path, marker: str) -> subprocess.Popen:
    ready = tmp_path / "ready"
    ready.mkdir()
    env = marked_env(marker, STACKS_READY_DIR=str(ready), OMP_NUM_THREADS="1")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(FIXTURES / f"{fixture}.py")], cwd=tmp_path, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not all((ready / f"rank{r}").exists() for r in (0, 1)):
        if job.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{fixture} did not reach its hang (exit {job.poll()})")
        time.sleep(0.2)
    time.sleep(1.0)  # from the ready mark to the hang itself
    return job


def _kill(job: subprocess.Popen, marker: str) -> None:
    """SIGKILL the launcher's process group and each worker's (torchrun starts every worker in a
    session of its own, and a SIGKILLed agent cannot end them), then check nothing is left."""
    groups = {job.pid}
    for pid in processes_with_marker(marker):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    job.wait(timeout=30)
    assert wait_for_no_processes(marker, 10.0) == []


def _stacks(*args: str, marker: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "distdoctor", "stacks", *args], capture_output=True, text=True,
                            env=marked_env(marker), timeout=60)
    return result, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("fixture", sorted(REAL_CASES))
def test_real_hung_job_under_torchrun(fixture, tmp_path):
    pytest.importorskip("torch")
    if sampler.shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (pip install 'distdoctor[stacks]')")
    hung, expected = REAL_CASES[fixture]
    marker = new_marker()
    job = _launch(fixture, tmp_path, marker)
    try:
        workers = [int(p) for p in subprocess.run(["ps", "--ppid", str(job.pid), "-o", "pid="], capture_output=True,
                                                  text=True).stdout.split()]
        result, took = _stacks(str(job.pid), "--format", "json", marker=marker)
        print(f"{fixture}: verdict in {took:.2f} s")
        assert took < 10.0, f"{fixture}: the verdict took {took:.1f} s"
        assert result.returncode == (1 if hung else 0), result.stdout + result.stderr
        (seen,) = json.loads(result.stdout)["jobs"]
        assert seen["hung"] is hung and seen["launcher"] == "torchrun" and seen["world_size"] == 2
        assert sorted(r["pid"] for r in seen["ranks"]) == sorted(workers)
        assert [g["ranks"] for g in seen["groups"]] == [ranks for ranks, _, _ in expected]
        for group, (_, what, marker_text) in zip(seen["groups"], expected):
            activity = group["activity"]
            if what is None:
                assert group["progressing"]
                continue
            assert what in (activity["op"], activity["kind"]), (fixture, activity)
            assert activity["user"].split(" in ")[0].endswith(f"{fixture}.py:{marker_line(fixture, marker_text)}") or (
                fixture == "endless_loop" and f"{fixture}.py:" in activity["user"]), (fixture, activity)
        assert _alive(job.pid) and all(_alive(p) for p in workers), "the job did not survive being read"
    finally:
        _kill(job, marker)


@pytest.mark.slow
def test_real_hung_job_text_and_discovery_without_pid(tmp_path):
    pytest.importorskip("torch")
    marker = new_marker()
    job = _launch("barrier_one_rank", tmp_path, marker)
    try:
        result, took = _stacks(marker=marker)  # every job on this machine: ours is among them
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr
        assert "rank 1 waits in barrier, from " in result.stdout and "under `if rank == 1`" in result.stdout
        worker = int(subprocess.run(["ps", "--ppid", str(job.pid), "-o", "pid="], capture_output=True, text=True).stdout.split()[0])
        result, took = _stacks(str(worker), marker=marker)  # a rank stands for its whole job
        assert result.returncode == 1 and result.stdout.count("pid ") >= 2 and "the job was not stopped" in result.stdout
    finally:
        _kill(job, marker)


SPAWN_SCRIPT = """
import sys, time
import torch.distributed as dist
import torch.multiprocessing as mp
from pathlib import Path

def run(index, world, port, ready):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    Path(ready, f"rank{index}").touch()
    if index == 1:
        dist.barrier()
    else:
        time.sleep(1000)

if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


@pytest.mark.slow
def test_real_mp_spawn_job_found_from_its_parent(tmp_path):
    pytest.importorskip("torch")
    from _probe_helpers import free_port

    script = tmp_path / "spawn_job.py"
    script.write_text(SPAWN_SCRIPT)
    ready = tmp_path / "ready"
    ready.mkdir()
    marker = new_marker()
    job = subprocess.Popen([sys.executable, str(script), str(free_port()), str(ready)], env=marked_env(marker),
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all((ready / f"rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        result, took = _stacks(str(job.pid), "--format", "json", marker=marker)
        assert took < 10.0 and result.returncode == 1, result.stdout + result.stderr
        (seen,) = json.loads(result.stdout)["jobs"]
        assert seen["launcher"] == "mp.spawn" and sorted(r["rank"] for r in seen["ranks"]) == [0, 1]
        idle, waiting = seen["groups"]  # the rank asleep outside any collective is the cause: first
        assert idle["ranks"] == [0] and idle["activity"]["kind"] == analysis.IDLE
        assert waiting["ranks"] == [1] and waiting["activity"]["op"] == "barrier"
    finally:
        _kill(job, marker)


def _script_py_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture()
def sleeper(tmp_path):
    marker = new_marker()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=marked_env(marker), start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.slow
def test_no_ptrace_permission_says_what_to_add(tmp_path, sleeper):
    fake = _script_py_spy(tmp_path, 'echo "Error: Permission Denied (os error 13)" >&2\nexit 1\n')
    result = CliRunner().invoke(main, ["stacks", "--py-spy", fake, str(sleeper.pid)])
    assert result.exit_code == 2 and "SYS_PTRACE" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_rank_that_exits_while_read(tmp_path, sleeper):
    # This fake sampler ends the process it is asked to read, then fails as py-spy does.
    fake = _script_py_spy(tmp_path, 'kill -9 "$3"; sleep 0.2\n'
                                    'echo "Error: Failed to get process executable name. Check that the process is running." >&2\nexit 1\n')
    result = CliRunner().invoke(main, ["stacks", "--py-spy", fake, str(sleeper.pid)])
    assert result.exit_code == 2 and "exited while it was being read" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_pid_that_is_not_python(tmp_path):
    fake = _script_py_spy(tmp_path, "exit 3\n")
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        result = CliRunner().invoke(main, ["stacks", "--py-spy", fake, str(proc.pid)])
        assert result.exit_code == 2 and "is not a Python process and runs no training ranks" in result.output
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_hundreds_of_ranks_are_read_in_bounded_time(tmp_path):
    # A sampler that answers at once for most pids and never for every tenth: 300 ranks, 32 at a time,
    # each bounded by 1 s, must finish in a few seconds, the silent ranks named.
    thread = json.dumps([{"thread_name": "MainThread", "os_thread_id": 1, "active": False, "frames": [
        {"name": "barrier", "filename": f"{SITE}/torch/distributed/distributed_c10d.py", "line": 5356, "module": None},
        {"name": "main", "filename": USER, "line": 3, "module": None}]}])
    (tmp_path / "out.json").write_text(thread)
    fake = _script_py_spy(tmp_path, f'case "$3" in *0) exec sleep 30;; esac\ncat {tmp_path / "out.json"}\n')
    started = time.monotonic()
    (job,) = live.read_jobs(_jobs(300), fake, live.Options(samples=1, timeout_s=1.0, jobs=32, native=False))
    took = time.monotonic() - started
    assert took < 8.0, took
    assert len(job.verdict.unread) == 30 and all("did not answer within 1 s" in r.error for r in job.verdict.unread)
    assert job.verdict.hung and len(job.verdict.groups[0].ranks) == 270


@pytest.mark.slow
def test_horovod_hung_job(tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed here: run scripts/install-horovod.sh")
    if sampler.shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (pip install 'distdoctor[stacks]')")
    if shutil.which("horovodrun") is None:
        pytest.skip("horovodrun is not on PATH")
    ready = tmp_path / "ready"
    ready.mkdir()
    marker = new_marker()
    env = marked_env(marker, STACKS_READY_DIR=str(ready), OMP_NUM_THREADS="1", PYTHONPATH=str(FIXTURES))
    job = subprocess.Popen(["horovodrun", "-np", "2", "--gloo", "-H", "localhost:2", sys.executable,
                            str(FIXTURES / "horovod_allreduce_one_rank.py")], cwd=tmp_path, env=env,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not all((ready / f"rank{r}").exists() for r in (0, 1)):
            if job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the Horovod job did not reach its hang (exit {job.poll()})")
            time.sleep(0.2)
        time.sleep(1.5)
        result, took = _stacks(str(job.pid), "--format", "json", marker=marker)
        assert took < 10.0, f"the verdict took {took:.1f} s"
        assert result.returncode == 1, result.stdout + result.stderr
        (seen,) = json.loads(result.stdout)["jobs"]
        assert seen["hung"] and seen["world_size"] == 2
        groups = {tuple(g["ranks"]): g["activity"] for g in seen["groups"]}
        waiting = groups[(1,)]
        assert waiting["kind"] == analysis.COLLECTIVE and waiting["op"].startswith("hvd."), waiting
        assert waiting["user"].split(" in ")[0].endswith(
            f"horovod_allreduce_one_rank.py:{marker_line('horovod_allreduce_one_rank', 'odd rank 1')}"), waiting
        assert groups[(0,)]["kind"] == analysis.IDLE, groups[(0,)]
        assert _alive(job.pid), "the job did not survive being read"
    finally:
        _kill(job, marker)


# --- Flight Recorder dumps -----------------------------------------------------------------------


def _entry(seq, op, state, pg="default_pg"):
    # The shape torch 2.13's gloo process group records (torch._C._distributed_c10d._dump_fr_trace()).
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", pg), "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": op, "time_created_ns": 1, "input_sizes": [[4]], "state": state,
            "retired": True, "timeout_ms": 1800000, "is_p2p": False}


def test_a_flight_recorder_dump_gives_each_group_its_last_collective(tmp_path):
    import pickle

    path = tmp_path / "fr_1"
    dump = {"version": "2.10", "pg_config": {}, "entries": [_entry(1, "gloo:all_reduce", "completed"),
                                                            _entry(2, "gloo:all_reduce", "completed"),
                                                            _entry(3, "gloo:barrier", "scheduled")]}
    path.write_bytes(pickle.dumps(dump))
    read = flight.read_dump(str(path), now=path.stat().st_mtime + 5)
    assert read.describe() == "default_pg: #3 gloo:barrier scheduled, last completed #2 (dump written 5 s ago)"
    assert flight.read_dump(str(path), since=path.stat().st_mtime + 60) is None  # an earlier job's dump
    path.write_text(json.dumps(dump))
    assert flight.read_dump(str(path)).groups[0].last_seq == 3
    assert flight.dump_path({"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_")}, 1) == str(tmp_path / "fr_1")
    assert flight.dump_path({}, 0) == "/tmp/nccl_trace_rank_0"


def test_a_flight_recorder_file_that_would_run_code_is_not_loaded(tmp_path):
    import pickle

    class Hostile:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    path = tmp_path / "fr_0"
    path.write_bytes(pickle.dumps({"entries": [Hostile()]}))
    assert flight.read_dump(str(path)) is None and not (tmp_path / "ran").exists()
    path.write_bytes(b"\x80\x04garbage")
    assert flight.read_dump(str(path)) is None
    assert flight.read_dump(str(tmp_path / "absent")) is None


FR_SCRIPT = """
import os, torch, torch.distributed as dist
from pathlib import Path

def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    for step in range(3):
        dist.all_reduce(t)
    prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    Path(f"{prefix}{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    Path(os.environ["STACKS_READY_DIR"], f"rank{rank}").touch()
    if rank == 1:
        dist.barrier()
    dist.all_reduce(t)

main()
"""


@pytest.mark.slow
def test_real_flight_recorder_dumps_are_shown_beside_the_stacks(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "fr_job.py"
    script.write_text(FR_SCRIPT)
    ready = tmp_path / "ready"
    ready.mkdir()
    marker = new_marker()
    env = marked_env(marker, STACKS_READY_DIR=str(ready), TORCH_FR_BUFFER_SIZE="100",
                     TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "fr_"), OMP_NUM_THREADS="1")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                           cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not all((ready / f"rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        result, _ = _stacks(str(job.pid), "--format", "json", marker=marker)
        assert result.returncode == 1, result.stdout + result.stderr
        ranks = json.loads(result.stdout)["jobs"][0]["ranks"]
        assert all(r["flight_recorder"].startswith("default_pg: #3 gloo:all_reduce") for r in ranks), ranks
    finally:
        _kill(job, marker)


def test_no_job_found_while_other_users_processes_are_hidden(tmp_path, monkeypatch):
    root = tmp_path / "proc"
    root.mkdir()
    _proc(root, 42, 1, ["/usr/bin/python3", "train.py"])
    real_read = discover._read
    monkeypatch.setattr(discover, "_read", lambda path: (_ for _ in ()).throw(PermissionError(path))
                        if path.endswith("/environ") else real_read(path))
    with pytest.raises(discover.DiscoveryError, match="environment of 1 Python process of other users could not be read"):
        discover.find_jobs(root=str(root))
    with pytest.raises(discover.DiscoveryError, match="cannot read the environment of pid 42"):
        discover.find_jobs([42], root=str(root))


def test_a_side_thread_waiting_in_a_collective_is_shown_and_survives_merge(tmp_path):
    ranks = recorded("healthy")
    ranks[1].other_threads = {"saver 77": [Frame("all_gather_object", f"{SITE}/torch/distributed/distributed_c10d.py", 3000),
                                           Frame("save_async", USER, 88)]}
    text = report.format_text([live.JobStacks("torchrun:x@h:1", "torchrun", ranks, 2)], 1.0, "test")
    assert "thread saver 77 waits in all_gather_object, from /home/u/train.py:88 in save_async" in text
    merged = report.load_merge([_node_file(tmp_path, "t.json", ranks)])[0]
    assert list(merged.ranks[1].threads_in_collectives()) == ["saver 77"]


def test_a_rank_blocked_on_the_gpu_stream_waits_with_its_peers():
    # NCCL: all_reduce returned once queued; the rank blocks at .item() until the kernel's peer comes.
    native = [Frame("cudaStreamSynchronize", "/usr/lib/libcudart.so.12", 0, native=True),
              Frame("at::native::_local_scalar_dense_cuda", "/usr/lib/libtorch_cuda.so", 0, native=True),
              _f("main", USER, 51)]
    activity = analysis.classify(native, active=False)
    assert activity.kind == analysis.GPU_WAIT and activity.in_collective and activity.user.line == 51
    assert "queued collective" in activity.describe()
    python_only = analysis.classify([_f("main", USER, 51)], active=False)
    assert python_only.kind == analysis.IDLE  # ...which the native read then tells apart
    rank = RankStacks(1, 0, 0, 2, "h", samples=[[_f("main", USER, 51)]] * 2, active=[False, False])
    assert live._wants_native(rank)


def test_one_failed_read_of_a_rank_already_read_does_not_discard_it():
    rank = RankStacks(7)
    good = sampler.Read(7, [sampler.ThreadStack("MainThread", 7, True, (_f("main", USER, 3),))])
    live._take(rank, good)
    live._take(rank, sampler.Read(7, error="py-spy could not read pid 7: torn", kind=sampler.FAILED))
    assert rank.error is None and len(rank.samples) == 1
    live._take(rank, sampler.Read(7, error="pid 7 exited while it was being read", kind=sampler.EXITED))
    assert rank.error_kind == sampler.EXITED


@pytest.mark.slow
def test_real_two_node_job_merged_from_per_node_files(tmp_path):
    # Two torchrun agents on this machine stand for two nodes (static rendezvous, one rank each):
    # each node alone sees its rank wait; the merged files name rank 1's barrier.
    pytest.importorskip("torch")
    from _probe_helpers import free_port

    ready = tmp_path / "ready"
    ready.mkdir()
    marker = new_marker()
    env = marked_env(marker, STACKS_READY_DIR=str(ready), OMP_NUM_THREADS="1")
    port = free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                                "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                                "--master-port", str(port), str(FIXTURES / "barrier_one_rank.py")],
                               cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for node in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not all((ready / f"rank{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the two-node job did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        files = []
        for node, agent in enumerate(agents):
            result, took = _stacks(str(agent.pid), "--format", "json", marker=marker)
            assert took < 10.0 and result.returncode == 1, result.stdout + result.stderr
            (alone,) = json.loads(result.stdout)["jobs"]
            assert [r["rank"] for r in alone["ranks"]] == [node] and "only 1 of 2 ranks are on this machine" in alone["summary"]
            files.append(tmp_path / f"node{node}.json")
            files[-1].write_text(result.stdout)
        result, _ = _stacks("--merge", *map(str, files), "--format", "json", marker=marker)
        assert result.returncode == 1, result.stdout + result.stderr
        (merged,) = json.loads(result.stdout)["jobs"]
        assert [g["ranks"] for g in merged["groups"]] == [[1], [0]] and merged["groups"][0]["activity"]["op"] == "barrier"
    finally:
        for agent in agents:
            _kill(agent, marker)
