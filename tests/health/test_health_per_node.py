"""Per-node bandwidth: ranks grouped by node, a node flagged when it falls well below the others (pure), and
the measurement itself on a real gloo world whose four ranks pose as two nodes."""

from _dist import run_distributed
from rayspeed.health import analysis


def _measured(links, intra=None):
    out = {}
    for i, (node, link) in enumerate(links.items()):
        out[node] = {"ranks": [2 * i, 2 * i + 1], "intra_busbw_gbps": (intra or {}).get(node, 10.0),
                     "link_gbps": link, "cross_busbw_gbps": 3.0}
    return out


def test_a_slow_link_flags_its_node_only():
    table, found = analysis.per_node(_measured({"10.0.0.1": 5.0, "10.0.0.2": 5.2, "10.0.0.3": 1.0}), factor=0.5)
    assert [r["node"] for r in table] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert [r["slow"] for r in table] == [[], [], ["link_gbps"]]
    (f,) = found
    assert f.id == "slow_node" and f.extra["node"] == "10.0.0.3" and f.extra["median_others"] == 5.1
    assert "ranks 4,5" in f.evidence[0]


def test_two_nodes_compare_with_each_other_and_healthy_nodes_pass():
    table, found = analysis.per_node(_measured({"a": 4.0, "b": 1.0}, intra={"a": 10.0, "b": 9.0}), factor=0.5)
    assert [r["slow"] for r in table] == [[], ["link_gbps"]]
    table, found = analysis.per_node(_measured({"a": 4.0, "b": 3.0}, intra={"a": 10.0, "b": 2.0}), factor=0.5)
    assert [r["slow"] for r in table] == [[], ["intra_busbw_gbps"]] and len(found) == 1


def test_nodes_without_ranks_are_listed_and_wrong_results_are_errors_not_speeds():
    m = _measured({"a": 4.0, "b": 4.0})
    m["b"]["intra_busbw_gbps"] = -1.0  # the sweep's correctness marker: b's intra-node all-reduce returned wrong data
    table, found = analysis.per_node(m, factor=0.5, all_nodes=["head", "a", "b"])
    assert [(r["node"], r["ranks"]) for r in table] == [("a", [0, 1]), ("b", [2, 3]), ("head", [])]
    assert [r["wrong_result"] for r in table] == [[], ["intra_busbw_gbps"], []]
    assert [r["slow"] for r in table] == [[], [], []]  # never compared as a speed
    (f,) = found
    assert (f.id, f.severity, f.extra["node"]) == ("collective_wrong_result", "error", "b")
    assert f.evidence == ["node b (ranks 2,3): the intra-node all-reduce returned wrong data"]
    lines = analysis.per_node_lines(table)
    assert lines[1].startswith("node b: ranks 2,3; intra-node all-reduce busbw BAD GB/s")
    assert lines[1].endswith("WRONG RESULT (the intra-node all-reduce)")
    assert lines[2] == "node head: no ranks"


def test_a_wrong_per_node_result_fails_the_healthcheck_and_the_preflight():
    """The verdicts on recorded data: a wrong result in the per-node table alone (every other figure healthy)."""
    from types import SimpleNamespace

    from rayspeed.health import healthcheck, preflight

    m = _measured({"a": 4.0, "b": 4.0})
    m["a"]["cross_busbw_gbps"] = m["b"]["cross_busbw_gbps"] = -1.0
    table, found = analysis.per_node(m, factor=0.5)
    assert {f.id for f in found} == {"collective_wrong_result"}
    rep = {"findings": [f.to_json() for f in found]}
    assert healthcheck.exit_code(rep) == 1
    assert healthcheck.exit_code({"findings": []}) == 0
    h = SimpleNamespace(preflight_min_busbw_gbps=0.0, fail_on_slow_rank=False)
    sweep = [{"bytes": 1 << 20, "ok": True, "busbw_gbps": 3.0}]
    reason = preflight.verdict(h, sweep, {"tp": 2.0}, table, found, [])
    assert reason.startswith("a collective returned wrong data")
    assert "node a: the all-reduce across nodes; node b: the all-reduce across nodes" in reason
    healthy, ok_found = analysis.per_node(_measured({"a": 4.0, "b": 4.0}), factor=0.5)
    assert preflight.verdict(h, sweep, {"tp": 2.0}, healthy, ok_found, []) == ""


def _node_bw(rank, world):
    from rayspeed.health.collectives import node_bandwidth

    return node_bandwidth(["a", "a", "b", "b"], "cpu", nbytes=64 << 10, iters=2)


def test_node_bandwidth_on_a_gloo_world():
    res = run_distributed(_node_bw, 4, timeout_s=60)
    assert all(r == res[0] for r in res)  # every rank returns the same table
    a, b = res[0]["a"], res[0]["b"]
    assert a["ranks"] == [0, 1] and b["ranks"] == [2, 3]
    for n in (a, b):
        assert n["intra_busbw_gbps"] > 0 and n["link_gbps"] > 0 and n["cross_busbw_gbps"] > 0
    assert a["cross_busbw_gbps"] == b["cross_busbw_gbps"]
