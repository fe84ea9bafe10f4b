"""distdoctor.probe.launch.torchrun: torchrun command lines, per-rank failures, timeouts, Ctrl-C, busy ports."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from _probe_helpers import marked_env, new_marker, wait_for_no_processes
from distdoctor.probe.launch.torchrun import LaunchError, LaunchSpec, collective_timeout_s, launch, torchrun_command

# Real launches need torch (torchrun is torch.distributed.run); the command lines do not.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    mode = sys.argv[1]
    print(f"rank {rank} started", flush=True)
    if mode == "fail" and rank == 1:
        raise RuntimeError("boom on rank 1")
    if mode == "stall":
        open(sys.argv[2] + f".{rank}", "w").close()
        time.sleep(1000)
    time.sleep(0.5)
""")


@pytest.fixture()
def rank_script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return path


def test_single_node_command_is_standalone_and_ends_with_the_target():
    cmd = torchrun_command(LaunchSpec(nproc=3, backend="gloo"), ["-m", "pkg.mod", "--x", "1"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=3" in cmd and "--max-restarts=0" in cmd
    assert cmd[-4:] == ["-m", "pkg.mod", "--x", "1"]


def test_multi_node_command_passes_rendezvous_through():
    spec = LaunchSpec(nproc=2, backend="nccl", nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    cmd = torchrun_command(spec, ["train.py"])
    assert "--standalone" not in cmd
    for arg in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"):
        assert arg in cmd
    assert cmd[-1] == "train.py"


@pytest.mark.parametrize("spec", [
    LaunchSpec(nproc=2, backend="gloo", nnodes=2),  # several nodes need an endpoint
    LaunchSpec(nproc=2, backend="gloo", nnodes=2, node_rank=2, rdzv_endpoint="h:1"),
    LaunchSpec(nproc=2, backend="gloo", nnodes=2, rdzv_endpoint="no-port"),
    LaunchSpec(nproc=0, backend="gloo"),
])
def test_impossible_specs_are_refused_with_a_message(spec):
    with pytest.raises(LaunchError):
        torchrun_command(spec, ["train.py"])


def test_collective_timeout_stays_inside_the_wall_clock():
    for wall in (5.0, 20.0, 120.0, 600.0):
        assert 2.0 <= collective_timeout_s(wall) < wall


@pytest.mark.slow
@needs_torch
def test_a_rank_that_dies_is_named_with_its_exit_code_and_traceback(rank_script):
    result = launch(LaunchSpec(nproc=2, backend="gloo", timeout_s=60), [str(rank_script), "fail"])
    assert result.returncode != 0 and not result.timed_out
    assert result.rank_exitcodes[1] == 1
    assert "RuntimeError: boom on rank 1" in result.rank_errors[1]
    assert 0 not in result.rank_errors
    assert "rank 1 exited with exit code 1" in result.failure_message()
    assert "[default0]:rank 0 started" in result.output


@pytest.mark.slow
@needs_torch
def test_a_healthy_launch_reports_every_rank_at_zero(rank_script):
    result = launch(LaunchSpec(nproc=2, backend="gloo", timeout_s=60), [str(rank_script), "ok"])
    assert result.ok and result.rank_exitcodes == {0: 0, 1: 0} and result.rank_errors == {}


@pytest.mark.slow
@needs_torch
def test_timeout_kills_every_rank(rank_script, tmp_path, monkeypatch):
    marker = new_marker()
    monkeypatch.setenv("DISTDOCTOR_TEST_MARKER", marker)
    started = time.monotonic()
    result = launch(LaunchSpec(nproc=2, backend="gloo", timeout_s=6), [str(rank_script), "stall", str(tmp_path / "up")])
    assert result.timed_out and not result.ok
    assert time.monotonic() - started < 6 + 15  # the wall clock plus the SIGTERM/SIGKILL grace
    assert (tmp_path / "up.0").exists() and (tmp_path / "up.1").exists()  # the ranks really ran
    assert wait_for_no_processes(marker, within_s=2) == []


@pytest.mark.slow
@needs_torch
def test_ctrl_c_stops_every_rank(rank_script, tmp_path):
    marker = new_marker()
    code = textwrap.dedent(f"""
        from distdoctor.probe.launch.torchrun import LaunchSpec, launch
        r = launch(LaunchSpec(nproc=2, backend="gloo", timeout_s=120), [{str(rank_script)!r}, "stall", {str(tmp_path / 'up')!r}])
        print("interrupted" if r.interrupted else "not interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=marked_env(marker))
    deadline = time.monotonic() + 60
    while not ((tmp_path / "up.0").exists() and (tmp_path / "up.1").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "interrupted" in out and "not interrupted" not in out
    assert wait_for_no_processes(marker, within_s=3) == []


def test_a_busy_rendezvous_port_is_a_clear_error(rank_script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = LaunchSpec(nproc=1, backend="gloo", nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}")
        with pytest.raises(LaunchError, match=f"port {port} .* already in use"):
            launch(spec, [str(rank_script), "ok"])
