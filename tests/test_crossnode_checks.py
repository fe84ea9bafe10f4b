"""Cross-node verdicts on recorded evidence: `env` across hosts, `bandwidth` per link scope, and a
script probe whose nodes were given different `--steps`. Pure: no process, no torch."""

from __future__ import annotations

from distdoctor.probe.checks import Evidence, select_checks
from distdoctor.probe.script.records import RankTrace, RunTrace


def _check(check_id: str, probe: str = "builtin"):
    (check,) = select_checks(probe, "torch", [check_id])
    return check


def _env(rank: int, host: str, node: str, world_size: int = 4, **overrides) -> dict:
    ev = {"host": host, "node": node, "torch": "2.13.0", "cuda": None, "nccl": None, "python": "3.12.3",
          "backend": "gloo", "world_size": world_size, "device": "cpu", "launcher": {"RANK": str(rank)},
          "nccl_env": {}, "gloo_env": {"GLOO_SOCKET_IFNAME": f"veth{node}"}, "horovod": None}
    for key, value in overrides.items():
        ev[key] = {**ev[key], **value} if isinstance(value, dict) else value
    return ev


def _two_hosts(**on_b) -> dict[int, dict]:
    return {0: _env(0, "node-a", "0"), 1: _env(1, "node-a", "0"),
            2: _env(2, "node-b", "1", **on_b), 3: _env(3, "node-b", "1", **on_b)}


def test_env_passes_across_hosts_and_lists_ranks_per_host():
    result = _check("env").judge(Evidence(_two_hosts(), 4))
    assert result.status == "pass", result.summary
    assert result.details["ranks_per_host"] == {"node-a": [0, 1], "node-b": [2, 3]}
    assert "node-a: ranks 0, 1; node-b: ranks 2, 3" in result.summary
    assert "network settings agree across hosts" in result.summary


def test_env_fails_on_a_network_setting_that_must_agree_naming_hosts_and_values():
    result = _check("env").judge(Evidence(_two_hosts(nccl_env={"NCCL_IB_DISABLE": "1"}), 4))
    assert result.status == "fail"
    assert ("NCCL_IB_DISABLE differs across hosts: unset on node-a (ranks 0, 1); NCCL_IB_DISABLE=1 on node-b "
            "(ranks 2, 3)") in result.summary
    assert result.details["network_mismatch"] == {"NCCL_IB_DISABLE": {"node-a": "None", "node-b": "1"}}


def test_env_fails_on_versions_that_differ_between_hosts():
    result = _check("env").judge(Evidence(_two_hosts(torch="2.12.1", python="3.11.9"), 4))
    assert result.status == "fail"
    assert "torch version differs across hosts: 2.13.0 on node-a (ranks 0, 1); 2.12.1 on node-b (ranks 2, 3)" in result.summary
    assert "Python version differs across hosts" in result.summary


def test_interface_names_may_differ_per_host_but_unset_on_one_host_warns():
    differ = _check("env").judge(Evidence(_two_hosts(nccl_env={"NCCL_SOCKET_IFNAME": "ens5"}), 4))
    # Set on node-b only: node-a lets NCCL pick its interface.
    assert differ.status == "warn" and "NCCL_SOCKET_IFNAME is set on node-b but not on node-a" in differ.summary
    both = _two_hosts(nccl_env={"NCCL_SOCKET_IFNAME": "ens5"})
    for rank in (0, 1):
        both[rank]["nccl_env"] = {"NCCL_SOCKET_IFNAME": "eth0"}
    assert _check("env").judge(Evidence(both, 4)).status == "pass"


def test_one_host_with_an_unset_setting_is_not_compared_across_hosts():
    ranks = {0: _env(0, "box", "0", 2, nccl_env={"NCCL_IB_DISABLE": "1"}), 1: _env(1, "box", "0", 2)}
    result = _check("env").judge(Evidence(ranks, 2))
    assert result.status == "warn" and "NCCL_IB_DISABLE=1" in result.summary  # the old one-host warning


def test_two_nodes_with_one_host_name_stay_apart():
    ranks = {0: _env(0, "pod", "0", 2), 1: _env(1, "pod", "1", 2, nccl_env={"NCCL_NET": "Socket"})}
    result = _check("env").judge(Evidence(ranks, 2))
    assert result.status == "fail" and "NCCL_NET=Socket on pod (node 1) (rank 1)" in result.summary


def _bw(rank: int, node: str, intra_us: float | None, inter_us: float | None, nodes: int = 2, per_node: int = 2) -> dict:
    sizes = [{"bytes": 1 << 20, "time_us": 1000.0}, {"bytes": 4 << 20, "time_us": 4000.0}]
    scopes = {}
    if intra_us is not None:
        scopes["intra"] = {"bytes": 4 << 20, "group_size": per_node, "node": node, "time_us": intra_us}
    if inter_us is not None:
        scopes["inter"] = {"bytes": 4 << 20, "group_size": nodes, "time_us": inter_us}
    return {"sizes": sizes, "nodes": nodes, "ranks_per_node": per_node, **({"scopes": scopes} if scopes else {})}


def test_bandwidth_reports_intra_and_inter_node_apart():
    ranks = {0: _bw(0, "0", 400.0, 8000.0), 1: _bw(1, "0", 420.0, None),
             2: _bw(2, "1", 500.0, 8100.0), 3: _bw(3, "1", 450.0, None)}
    result = _check("bandwidth").judge(Evidence(ranks, 4))
    assert result.status == "pass"
    intra, inter = result.details["scopes"]["intra"], result.details["scopes"]["inter"]
    # The slowest node's intra figure (node 1, 500 us), and the slowest leader's inter figure.
    assert intra["time_us"] == 500.0 and intra["nodes"] == 2 and set(intra["per_node"]) == {"0", "1"}
    assert inter["time_us"] == 8100.0 and inter["group_size"] == 2
    assert intra["busbw_GBps"] > 10 * inter["busbw_GBps"]
    assert "intra-node 8.39 GB/s (2 ranks, slowest of 2 nodes); inter-node 0.518 GB/s (2 nodes" in result.summary


def test_bandwidth_with_one_rank_per_node_labels_the_world_figure_inter_node():
    ranks = {0: _bw(0, "0", None, None, per_node=1), 1: _bw(1, "1", None, None, per_node=1)}
    result = _check("bandwidth").judge(Evidence(ranks, 2))
    assert "scopes" not in result.details and "(inter-node: 2 nodes, one rank each)" in result.summary


def test_bandwidth_on_one_node_says_nothing_of_nodes():
    ranks = {r: {"sizes": [{"bytes": 4 << 20, "time_us": 4000.0}]} for r in (0, 1)}  # older evidence too
    result = _check("bandwidth").judge(Evidence(ranks, 2))
    assert result.status == "pass" and "node" not in result.summary


def _rank(rank: int, budget: int, steps: int, host: str) -> RankTrace:
    trace = RankTrace(rank)
    trace.add({"e": "start", "rank": rank, "host": host, "steps": budget, "pid": 1})
    for n in range(1, steps + 1):
        trace.add({"e": "bwd", "n": n, "site": "train.py:10"})
        trace.add({"e": "bwd_end", "n": n})
        trace.add({"e": "step", "opt": 0, "n": n, "bwd": n, "coll": 0, "site": "train.py:11"})
    trace.add({"e": "stop", "steps": steps})
    return trace


def test_desync_names_different_step_budgets_first():
    trace = RunTrace("/x/train.py", 2, 8, {0: _rank(0, 8, 8, "node-a"), 1: _rank(1, 3, 3, "node-b")})
    result = _check("desync", "script").judge(trace)
    assert result.status == "fail"
    assert result.summary.startswith("the ranks were given different --steps (8 for rank 0; 3 for rank 1)")
    assert "what followed: ranks ended at different points" in result.summary
    assert result.details["steps_budget"] == {"0": 8, "1": 3}


def test_desync_with_one_budget_is_unchanged():
    trace = RunTrace("/x/train.py", 2, 3, {0: _rank(0, 3, 3, "node-a"), 1: _rank(1, 3, 3, "node-b")})
    result = _check("desync", "script").judge(trace)
    assert result.status == "pass" and "steps_budget" not in result.details
