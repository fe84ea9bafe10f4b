"""The probe across two real hosts: two network namespaces joined by a veth pair, each with its own
host name (resolved on both sides), no shared run directory, gloo over that link.

Needs root and iproute2 (`ip netns`) and util-linux `unshare` (a host name per namespace); skipped
with the reason where they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "probe"
DISTDOCTOR = [sys.executable, "-m", "distdoctor"]


def _namespaces_possible() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return ""


class TwoHosts:
    """Namespaces dda<S> / ddb<S> with hosts node-a (10.231.S.1) and node-b (10.231.S.2)."""

    def __init__(self, suffix: int) -> None:
        self.s = suffix
        self.names = (f"dda{suffix}", f"ddb{suffix}")
        self.links = (f"dva{suffix}", f"dvb{suffix}")
        self.hosts = ("node-a", "node-b")
        self.addresses = (f"10.231.{suffix}.1", f"10.231.{suffix}.2")

    def up(self) -> None:
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
        for name in self.names:
            run("ip", "netns", "add", name)
            hosts = Path("/etc/netns") / name
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hosts)))
        run("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses):
            run("ip", "link", "set", link, "netns", name)
            run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link)
            run("ip", "-n", name, "link", "set", link, "up")
            run("ip", "-n", name, "link", "set", "lo", "up")

    def down(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)

    def start(self, node: int, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """`distdoctor probe ARGS` on one host, in a process group of its own."""
        inner = " ".join(["hostname", self.hosts[node], ";", "exec", *map(_quote, DISTDOCTOR + args)])
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.links[node], "PYTHONPATH": str(ROOT), **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c", inner],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


@pytest.fixture
def hosts():
    reason = _namespaces_possible()
    if reason:
        pytest.skip(reason)
    pair = TwoHosts(200 + os.getpid() % 50)
    try:
        pair.up()
    except subprocess.CalledProcessError as exc:
        pair.down()
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    procs: list[subprocess.Popen] = []
    pair.procs = procs
    yield pair
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pair.down()


def _both(hosts: TwoHosts, args: list[str], port: int, timeout: float = 150, *,
          on_b: list[str] = (), env_b: dict[str, str] | None = None) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """`distdoctor ARGS` on both hosts; node-b (node 1) also gets `on_b` and `env_b`."""
    endpoint = f"{hosts.addresses[0]}:{port}"
    procs = []
    for node in (0, 1):
        extra = [*on_b] if node == 1 else []
        procs.append(hosts.start(node, [*args, *extra, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint],
                                 env=env_b if node == 1 else None))
        hosts.procs.append(procs[-1])
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        out.append((proc.returncode, stdout, stderr))
    return out[0], out[1]


def test_builtin_probe_passes_across_two_hosts(hosts):
    (rc0, out0, err0), (rc1, out1, err1) = _both(
        hosts, ["probe", "--nproc", "1", "--checks", "env,collectives,grad-sync", "--timeout", "120"], 29621)
    assert rc0 == 0, out0 + err0
    assert rc1 == 0, out1 + err1
    assert "grad-sync" in out0 and "PASS" in out0


def test_script_probe_healthy_across_two_hosts_names_the_hosts(hosts):
    script = str(FIXTURES / "healthy_env_local_rank.py")
    (rc0, out0, err0), (rc1, out1, err1) = _both(hosts, ["probe", script, "--nproc", "1", "--timeout", "120"], 29631)
    assert rc0 == 0, out0 + err0
    assert "ranks per host: node-a: 0; node-b: 1" in out0
    assert "desync         PASS" in out0
    assert rc1 == 0, out1 + err1
    assert "went to node 0" in out1 and "10.231." in out1


def test_sampler_sharded_by_local_rank_fails_data_shard_naming_both_hosts(hosts):
    script = str(FIXTURES / "multinode" / "fault_sampler_local_rank.py")
    (rc0, out0, err0), _ = _both(hosts, ["probe", script, "--nproc", "1", "--timeout", "120"], 29641)
    assert rc0 == 1, out0 + err0
    line = next(line for line in out0.splitlines() if line.startswith("data-shard"))
    assert "FAIL" in line and "node-a" in line and "node-b" in line


def test_a_killed_node_is_named_and_what_it_sent_is_judged(hosts, tmp_path):
    script = str(FIXTURES / "healthy_slow_steps.py")
    endpoint = f"{hosts.addresses[0]}:29651"
    args = ["probe", script, "--nproc", "1", "--steps", "150", "--timeout", "120", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    # Node 0's run directory is kept where the test can see node 1's records arrive.
    node0 = hosts.start(0, [*args, "--node-rank", "0"], env={"DISTDOCTOR_RUN_DIR": str(tmp_path)})
    node1 = hosts.start(1, [*args, "--node-rank", "1"])
    hosts.procs += [node0, node1]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # until node 1's rank has made a few steps, seen on node 0
        records = tmp_path / "rank1.jsonl"
        if records.exists() and records.read_text().count('"e":"step"') >= 3:
            break
        time.sleep(0.5)
    else:
        pytest.fail("node 1's records never reached node 0")
    # Kill node 1 whole: its launcher and the ranks, which live in sessions of their own.
    for pid in subprocess.run(["ip", "netns", "pids", hosts.names[1]], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    stdout, stderr = node0.communicate(timeout=150)
    assert node0.returncode == 1, stdout + stderr
    assert "lost: node 1 (node-b) did not finish reporting to node 0" in stdout, stdout
    desync = next(line for line in stdout.splitlines() if line.startswith("desync"))
    assert "FAIL" in desync and "rank 1 (node-b)" in desync, stdout


def test_a_node_that_cannot_reach_the_rendezvous_says_so_in_time(hosts):
    script = str(FIXTURES / "healthy_env_local_rank.py")
    proc = hosts.start(1, ["probe", script, "--nproc", "1", "--timeout", "120", "--nnodes", "2", "--node-rank", "1",
                           "--rdzv-endpoint", f"{hosts.addresses[0]}:29661"])
    hosts.procs.append(proc)
    stdout, stderr = proc.communicate(timeout=200)
    assert proc.returncode != 0
    assert "node 1 could not rendezvous at 10.231." in stdout + stderr
    # Said by the rendezvous (its store gives up within 40% of the wall clock), not by the wall clock itself.
    assert "wall-clock limit" not in stdout + stderr


# --- cross-node checks and faults only two nodes show -----------------------------------------------


def _line(out: str, check: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(check + " "))


def test_env_fails_when_one_host_disables_infiniband_and_names_it(hosts):
    # Real, not planted: node-b alone is started with NCCL_IB_DISABLE=1 (a forgotten export). Its
    # NCCL would talk sockets while node-a's talks InfiniBand; gloo runs the probe regardless.
    (rc0, out0, err0), (rc1, out1, err1) = _both(
        hosts, ["probe", "--nproc", "1", "--checks", "env,collectives", "--timeout", "120"], 29671,
        env_b={"NCCL_IB_DISABLE": "1"})
    assert rc0 == 1, out0 + err0
    env = _line(out0, "env")
    assert "FAIL" in env and "NCCL_IB_DISABLE differs across hosts" in env, out0
    assert "unset on node-a (rank 0)" in env and "NCCL_IB_DISABLE=1 on node-b (rank 1)" in env, env
    assert "PASS" in _line(out0, "collectives")
    assert rc1 == 1 and "NCCL_IB_DISABLE=1 on node-b" in out1, out1 + err1  # every node reports the same


def test_env_passes_across_two_hosts_and_lists_ranks_per_host(hosts):
    (rc0, out0, err0), _ = _both(hosts, ["probe", "--nproc", "1", "--checks", "env", "--timeout", "120",
                                         "--format", "json"], 29676)
    assert rc0 == 0, out0 + err0
    (env,) = json.loads(out0)["checks"]
    assert env["status"] == "pass" and env["details"]["ranks_per_host"] == {"node-a": [0], "node-b": [1]}
    assert env["ranks"]["1"]["gloo_env"]["GLOO_SOCKET_IFNAME"] == hosts.links[1]  # per host, not compared


def test_bandwidth_measures_intra_and_inter_node_links_apart(hosts):
    (rc0, out0, err0), _ = _both(hosts, ["probe", "--nproc", "2", "--checks", "bandwidth", "--timeout", "150",
                                         "--format", "json"], 29681, timeout=200)
    assert rc0 == 0, out0 + err0
    (bandwidth,) = json.loads(out0)["checks"]
    scopes = bandwidth["details"]["scopes"]
    assert scopes["intra"]["nodes"] == 2 and scopes["intra"]["group_size"] == 2
    assert set(scopes["intra"]["per_node"]) == {"0", "1"}
    assert scopes["inter"]["group_size"] == 2 and scopes["inter"]["busbw_GBps"] > 0
    assert "intra-node" in bandwidth["summary"] and "inter-node" in bandwidth["summary"]


def _inter_node_busbw(hosts: TwoHosts, port: int) -> float:
    (rc0, out0, err0), _ = _both(hosts, ["probe", "--nproc", "1", "--checks", "bandwidth", "--timeout", "150",
                                         "--format", "json"], port, timeout=200)
    assert rc0 in (0, 1), out0 + err0  # a slow enough link warns
    (bandwidth,) = json.loads(out0)["checks"]
    assert "inter-node: 2 nodes, one rank each" in bandwidth["summary"]
    return bandwidth["details"]["sizes"][-1]["busbw_GBps"]


# How to slow node-a's side of the link: netem's delay where the kernel has it, else tbf's rate limit.
SHAPING = (["netem", "delay", "20ms"], ["tbf", "rate", "100mbit", "burst", "64kb", "latency", "400ms"])


def test_a_slowed_link_shows_as_an_inter_node_bandwidth_drop(hosts):
    qdisc = ["ip", "netns", "exec", hosts.names[0], "tc", "qdisc"]
    errors = []
    for shaping in SHAPING:  # which one this kernel has, tried before the measurements
        tried = subprocess.run([*qdisc, "add", "dev", hosts.links[0], "root", *shaping], capture_output=True, text=True)
        if tried.returncode == 0:
            subprocess.run([*qdisc, "del", "dev", hosts.links[0], "root"], check=True, capture_output=True)
            break
        errors.append(f"{shaping[0]}: {tried.stderr.strip()}")
    else:
        pytest.skip(f"tc cannot slow the link here ({'; '.join(errors)})")
    fast = _inter_node_busbw(hosts, 29686)
    subprocess.run([*qdisc, "add", "dev", hosts.links[0], "root", *shaping], check=True, capture_output=True)
    slow = _inter_node_busbw(hosts, 29688)
    print(f"inter-node busbw: {fast} GB/s, then {slow} GB/s under {' '.join(shaping)}")
    assert slow < fast / 3, (shaping, fast, slow)


def test_rank_from_local_rank_only_feeds_both_hosts_the_same_rows(hosts):
    script = str(FIXTURES / "multinode" / "fault_rank_from_local_rank.py")
    (rc0, out0, err0), _ = _both(hosts, ["probe", script, "--nproc", "1", "--timeout", "120"], 29691)
    assert rc0 == 1, out0 + err0
    line = _line(out0, "data-shard")
    assert "FAIL" in line and "rank(s) 0,1 (node-a, node-b) were fed identical batches" in line, line
    for check in ("param-sync", "grad-sync", "desync", "loss"):
        assert "PASS" in _line(out0, check), out0


def test_a_node_given_other_steps_is_named_by_the_script_probe(hosts):
    # Each node's launcher passes its own flags: node-b stops after 4 steps, node-a waits for it.
    script = str(FIXTURES / "healthy_env_local_rank.py")
    (rc0, out0, err0), (rc1, out1, err1) = _both(
        hosts, ["probe", script, "--nproc", "1", "--steps", "30", "--timeout", "120"], 29701, on_b=["--steps", "4"])
    assert rc0 == 1, out0 + err0
    desync = _line(out0, "desync")
    assert "FAIL" in desync, out0
    assert "the ranks were given different --steps (30 for rank 0 (node-a); 4 for rank 1 (node-b))" in desync, desync


def test_a_node_given_other_steps_is_a_usage_error_of_the_builtin_probe(hosts):
    (rc0, out0, err0), (rc1, out1, err1) = _both(
        hosts, ["probe", "--nproc", "1", "--checks", "env,convergence", "--steps", "6", "--timeout", "120"], 29711,
        on_b=["--steps", "3"])
    for rc, out in ((rc0, out0 + err0), (rc1, out1 + err1)):
        assert rc == 2, out
        assert "different probe flags: --steps 6 on node-a (rank 0); 3 on node-b (rank 1)" in out, out
