"""Multi-node pieces that need no second host: the record relay over loopback, Slurm's
environment, the torchrun command line, hosts named in findings."""

from __future__ import annotations

import socket
import time

import pytest

from distdoctor.probe.launch.relay import RelayClient, RelayServer, finish_relay, relay_address
from distdoctor.probe.launch.slurm import first_host, slurm_nodes
from distdoctor.probe.launch.torchrun import LaunchResult, LaunchSpec, rendezvous_timeout_s, store_timeout_s, torchrun_command
from distdoctor.probe.report import Report
from distdoctor.probe.render import render_text
from distdoctor.probe.script.launcher import name_hosts, ranks_per_host


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_records_travel_to_node_0_line_by_line_and_the_node_says_done(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    port = _free_port()
    server = RelayServer(node0, port).start()
    client = RelayClient(node1, ("127.0.0.1", port), node_rank=1).start()
    (node1 / "rank2.jsonl").write_text('{"e":"start"}\n{"e":"step","n":1}\n{"e":"st')  # a line being written
    received = node0 / "rank2.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (received.exists() and received.read_text().count("\n") == 2):
        time.sleep(0.1)
    assert (node0 / "rank2.jsonl").read_text() == '{"e":"start"}\n{"e":"step","n":1}\n'  # the torn line waits
    with open(node1 / "rank2.jsonl", "a") as f:
        f.write('ep","n":2}\n')
    assert client.stop() == ""
    outcome = finish_relay(server, nnodes=2, node_rank=0)
    assert outcome.missing_nodes == ()
    assert outcome.hosts == {1: socket.gethostname()}
    assert (node0 / "rank2.jsonl").read_text().endswith('{"e":"step","n":2}\n')


def test_a_node_that_never_says_done_is_named_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("distdoctor.probe.launch.relay.FINAL_WAIT_S", 0.5)
    server = RelayServer(tmp_path, _free_port()).start()
    outcome = finish_relay(server, nnodes=3, node_rank=0)
    assert outcome.missing_nodes == (1, 2)


def test_the_relay_never_writes_outside_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = RelayServer(run_dir, _free_port())
    server._receive({"node": 1, "file": "../evil.jsonl", "data": "x\n"})
    server._receive({"node": 1, "file": "/etc/passwd", "data": "x\n"})
    server._receive({"node": 1, "file": "rank1.jsonl", "data": "ok\n"})
    server.stop()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["rank1.jsonl"]


def test_a_client_that_cannot_reach_node_0_says_where_it_tried(tmp_path):
    client = RelayClient(tmp_path, ("127.0.0.1", _free_port()), node_rank=1, connect_timeout_s=0.1)
    (tmp_path / "rank1.jsonl").write_text('{"e":"start"}\n')
    error = client.stop()
    assert "cannot reach node 0's relay at 127.0.0.1:" in error


def test_relay_port_is_the_rendezvous_port_plus_one_unless_set(monkeypatch):
    assert relay_address("10.0.0.1:29500") == ("10.0.0.1", 29501)
    monkeypatch.setenv("DISTDOCTOR_RELAY_PORT", "40000")
    assert relay_address("[::1]:29500") == ("::1", 40000)


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[003-010,012],cpu01", "gpu003"), ("node7", "node7"), ("a,b", "a"), ("n[1,3]", "n1"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_environment_gives_nodes_rank_and_a_shared_endpoint():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    nodes = slurm_nodes(env)
    assert (nodes.nnodes, nodes.node_rank) == (4, 2)
    host, port = nodes.rdzv_endpoint.split(":")
    assert host == "gpu01" and 29500 <= int(port) < 39500
    assert slurm_nodes({**env, "SLURM_NNODES": "1"}) is None
    assert slurm_nodes({}) is None


def test_node_0_hosts_the_rendezvous_explicitly_and_joins_time_out_inside_the_wall_clock():
    spec = LaunchSpec(nproc=2, backend="gloo", nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500", timeout_s=120)
    join, store = rendezvous_timeout_s(120), store_timeout_s(120)
    assert f"--rdzv-conf=is_host=1,join_timeout={join},read_timeout={store}" in torchrun_command(spec, ["t.py"])
    other = LaunchSpec(nproc=2, backend="gloo", nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", timeout_s=120)
    assert any(arg.startswith("--rdzv-conf=is_host=0,") for arg in torchrun_command(other, ["t.py"]))
    assert rendezvous_timeout_s(120) < 120
    # torchrun's store client tries twice with a back-off of up to its timeout in between.
    assert 2 * store_timeout_s(120) <= rendezvous_timeout_s(120)


def test_a_failed_rendezvous_names_the_node_and_the_address():
    result = LaunchResult(1, False, False, 30.0, {}, {}, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
                          node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    assert result.failure_message().startswith("node 1 could not rendezvous at 10.0.0.1:29500")


def test_findings_name_the_host_of_each_rank_on_several_hosts():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert name_hosts("rank(s) 2,3 differ from rank 0", hosts) == "rank(s) 2,3 (b) differ from rank 0 (a)"
    assert ranks_per_host(hosts) == {"a": [0, 1], "b": [2, 3]}


def test_a_node_other_than_0_says_where_the_report_is():
    report = Report(mode="script", backend="gloo", world_size=4, duration_s=1.0, checks=(),
                    extra={"node_rank": 1, "relayed_to": "10.0.0.1:29501", "relay_error": "", "launch_ok": True})
    assert "node 1: its ranks' records went to node 0 (10.0.0.1:29501)" in render_text(report)
