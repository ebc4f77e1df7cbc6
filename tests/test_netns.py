"""Two "machines" joined by a real link: two network namespaces and a veth pair (root only).

One torchrun agent per namespace meets the other at node0's address. Then the classic
failure: each machine's own name resolves to a second network the other machine is not on,
so gloo listens where the other rank cannot connect: node0's rank waits in
init_process_group until the launcher's timeout (node1's may fail first with gloo's
"No route to host"), and both messages name GLOO_SOCKET_IFNAME. That with
GLOO_SOCKET_IFNAME=lesson0 the same job runs is notebook 08's check (section 4a)."""
import json
from pathlib import Path

import pytest

from ddp_lesson.launcher import failures, launch, multinode
from ddp_lesson.rank.bundled import script

SCRIPT = script("nic_check.py")


@pytest.fixture
def machines():
    why = multinode.why_no_netns()
    if why:
        pytest.skip(why)
    return multinode.TwoMachines


def results(dirs):
    return [json.loads((d / "result.json").read_text()) for d in dirs]


def stdout(d):
    return "".join(p.read_text() for p in sorted((d / "logs").glob("rank*.stdout.log")))


def test_one_network_two_nodes_meet(machines, tmp_path):
    with machines() as m:
        dirs = m.run(SCRIPT, tmp_path, nproc_per_node=1, timeout=240, port=launch.free_port())
        assert m.exists() == list(m.names)
    assert m.exists() == [] and not any((Path("/etc/netns") / n).exists() for n in m.names)
    res = results(dirs)
    assert [r["status"] for r in res] == ["ok", "ok"], [r.get("message") for r in res]
    assert "node0: gloo listens on 192.0.2.1" in stdout(dirs[0])
    assert "node1: gloo listens on 192.0.2.2" in stdout(dirs[1])
    assert "rank 1 of 2 on node1: all_reduce gave 2" in stdout(dirs[1])


def test_unreachable_interface_waits_until_the_launchers_timeout(machines, tmp_path):
    """gloo's own timeout far beyond the launcher's: the ranks wait, as with the default 30 min,
    until the launcher ends them and says where they waited. (Notebook 08's section 4a runs the
    same two machines with gloo's own short timeout, both ranks failing with a hint, side by side
    with the fix, GLOO_SOCKET_IFNAME=lesson0, and asserts its all_reduce: not run again here.)"""
    with machines(side_network=True) as m:
        # the launcher's timeout only has to outlast both ranks' start (import torch, cold, in
        # a namespace each) on a busy machine: then both wait in init_process_group
        bad = m.run(SCRIPT, tmp_path / "bad", timeout=50, args=["--timeout", "1800"], port=launch.free_port())
    assert m.exists() == []
    res = results(bad)
    assert "node0: gloo listens on 198.51.100.1" in stdout(bad[0])  # the side network
    assert "node1: gloo listens on 198.51.100.2" in stdout(bad[1])
    assert "all_reduce gave" not in stdout(bad[0]) + stdout(bad[1])
    # node0's rank waits for node1's to connect, until the launcher's timeout; node1's rank
    # gives up first (gloo: "timed out connecting: No route to host") or waits too
    assert res[0]["status"] == "timeout", res[0].get("message")
    assert "waited in init_process_group" in res[0]["message"], res[0]["message"]
    assert res[1]["status"] in ("timeout", "failed"), res[1].get("message")
    for r in res:
        assert "GLOO_SOCKET_IFNAME" in r["message"], r["message"]


def test_hints_name_gloo_socket_ifname():
    """The two ways it ends: gloo's own connect timeout (its message as seen in this
    namespace test with a short timeout), and the launcher's timeout on several nodes."""
    seen = ("RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed "
            "out connecting: SO_ERROR: No route to host, remote=[198.51.100.1]:28055")
    assert "GLOO_SOCKET_IFNAME" in failures.hint({"message": seen, "nnodes": 2})
    assert failures.hint({"message": seen, "nnodes": 1}) is None   # one node: a peer, not a NIC
    init = {0: {"state": "init", "call": "init_process_group", "at": "script.py line 9"}}
    assert "GLOO_SOCKET_IFNAME" in failures.after_timeout("stopped", {"nnodes": 2}, init)
    assert failures.after_timeout("stopped", {"nnodes": 1}, init) == "stopped"
    busy = {0: {"state": "busy", "call": "", "at": "script.py line 3"}}
    assert failures.after_timeout("stopped", {"nnodes": 2}, busy) == "stopped"
